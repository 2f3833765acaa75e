"""Template and prompt flags against the reference, mlx-lm's own generate (its
`main`, the same flags, the same float32 weights): the same text."""

import json
import sys

import pytest
import tiny

from flashnorm_mlx.cli import main

# The tiny tokenizer's ChatML, and a line a template argument adds.
GREETING = "{% if greeting %}<|im_start|>system\n{{ greeting }}<|im_end|>\n{% endif %}"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tiny.make_llama(tmp_path_factory.mktemp("m"), "gqa_untied")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = GREETING + config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def mlx_lm_text(monkeypatch, capsys, model, *flags) -> str:
    """mlx_lm.generate's text for the flags (verbose: between '==========' lines)."""
    import importlib

    cli = importlib.import_module("mlx_lm.generate")  # the module, not the function
    monkeypatch.setattr(sys, "argv", ["mlx_lm.generate", "--model", str(model), *flags])
    cli.main()
    out = capsys.readouterr().out
    return out.split("==========\n", 1)[1].split("\n==========")[0]


def our_text(capsys, model, *flags) -> str:
    rc = main(["generate", str(model), "--dtype", "float32", *flags])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out.split("\n==========")[0]


CASES = {
    "system": ["--system-prompt", "Be brief."],
    "prefill": ["--prefill-response", "Sure, "],
    "template config": ["--chat-template-config", '{"greeting": "Welcome"}'],
    "all three": [
        "--system-prompt",
        "Be brief.",
        "--prefill-response",
        "Well",
        "--chat-template-config",
        '{"greeting": "Hi"}',
    ],
    "raw": ["--ignore-chat-template"],
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["flashnorm", "stock"])
def test_template_flags_give_mlx_lm_s_text(llama, monkeypatch, capsys, case, mode):
    flags = ["-p", "Tell me", "-m", "12", *CASES[case]]
    want = mlx_lm_text(monkeypatch, capsys, llama, *flags)
    got = our_text(capsys, llama, "--mode", mode, *flags)
    plain = our_text(capsys, llama, "-p", "Tell me", "-m", "12")
    print(f"{case}: mlx-lm {want!r}\nours {got!r}\nno flags {plain!r}")
    assert got == want
    assert got != plain  # the flag changed the prompt


def test_extra_eos_token_stops_as_mlx_lm_s(llama, monkeypatch, capsys):
    from mlx_lm.utils import load_tokenizer

    flags = ["-p", "Tell me", "-m", "12"]
    plain = our_text(capsys, llama, *flags)
    tok = load_tokenizer(llama)
    stop = tok.encode(plain[3:], add_special_tokens=False)[0]  # the 4th byte's token
    flags += ["--extra-eos-token", "<|endoftext|>", str(stop)]
    want = mlx_lm_text(monkeypatch, capsys, llama, *flags)
    got = our_text(capsys, llama, *flags)
    print(f"plain {plain!r}; stopped at token {stop}: {got!r} (mlx-lm {want!r})")
    assert got == want and len(got) < len(plain)


def test_unknown_extra_eos_token_is_one_line(llama, capsys):
    rc = main(["generate", str(llama), "-m", "2", "--extra-eos-token", "<nope>"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "<nope>" in err[0], err


def test_use_default_chat_template(tmp_path):
    """A tokenizer without a template gets transformers' former default
    (ChatML); one with its own keeps it."""
    from mlx_lm.utils import load_tokenizer

    from flashnorm_mlx.chat_template import prompt_ids, set_template

    path = tiny.make_llama(tmp_path / "m")
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(path)
    assert prompt_ids(tok, "Hi") == tok.encode("Hi")  # raw: no template
    set_template(tok, use_default=True)
    want = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_ids(tok, "Hi") == tok.encode(want, add_special_tokens=False)
    own = load_tokenizer(tiny.make_llama(tmp_path / "n"))
    before = own.chat_template
    set_template(own, use_default=True)
    assert own.chat_template == before


def test_serve_template_flags_and_adapter(llama, tmp_path):
    """serve --chat-template, --chat-template-args and --adapter-path: the
    prompt is the template's with the arguments, and each reply token's
    logprob is mlx-lm's adapted model's for its greedy tokens (logprobs, not
    text: the tiny model samples ids past this byte tokenizer's vocabulary,
    which mlx-lm's streaming detokenizer shows as '!' and tokenizer.decode,
    serve's, drops)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load
    from serve_process import Server
    from test_adapters import make_adapter

    adapter = make_adapter(llama, tmp_path / "a")
    template = "{{ greeting }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}>"
    args = ["--chat-template", template, "--chat-template-args", '{"greeting": "Yo"}']
    flags = ["--dtype", "float32", "--adapter-path", str(adapter), *args]
    server = Server(str(llama), *flags)
    try:
        messages = [{"role": "user", "content": "Hello"}]
        r = server.client().chat.completions.create(
            model="default",
            messages=messages,
            temperature=0,
            max_tokens=8,
            logprobs=True,
        )
    finally:
        server.kill()
    model, tok = load(str(llama), adapter_path=str(adapter))
    tok.chat_template = template
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, greeting="Yo")
    assert r.usage.prompt_tokens == len(ids) == len("Yo[Hello]>")
    want = []
    for (token, logprobs), _ in zip(generate_step(mx.array(ids), model), range(8)):
        want.append(logprobs[token].item())
    got = [c.logprob for c in r.choices[0].logprobs.content]
    print(f"served logprobs {got}\nmlx-lm adapted {want}")
    assert len(got) == len(want) == 8
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3


def test_serve_chat_template_kwargs_per_request(llama):
    """mlx_lm.server's `chat_template_kwargs`: a request's own arguments over
    --chat-template-args, for that request alone; not an object: a 400."""
    from serve_process import Server

    template = "{{ greeting }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}>"
    args = ["--chat-template", template, "--chat-template-args", '{"greeting": "Yo"}']
    server = Server(str(llama), "--dtype", "float32", *args)
    try:

        def prompt_tokens(**extra):
            body = {"messages": [{"role": "user", "content": "Hello"}], **extra}
            status, r = server.request(
                "POST", "/v1/chat/completions", {**body, "max_tokens": 1}
            )
            return status, r

        status, r = prompt_tokens(chat_template_kwargs={"greeting": "Ahoy there"})
        assert status == 200, r
        assert r["usage"]["prompt_tokens"] == len("Ahoy there[Hello]>"), r
        status, r = prompt_tokens()  # the flag's again: nothing was kept
        assert status == 200 and r["usage"]["prompt_tokens"] == len("Yo[Hello]>"), r
        status, r = prompt_tokens(chat_template_kwargs=["greeting"])
        assert status == 400 and r["error"]["param"] == "chat_template_kwargs", r
    finally:
        server.kill()
