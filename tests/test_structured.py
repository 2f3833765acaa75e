"""Structured output's grammar processor (flashnorm_mlx/grammar.py) inside
mlx-lm's BatchGenerator, in-process on a tiny random Llama with a byte-level
tokenizer: requests with different schemas join and leave one batch at
different steps, sample at temperature 1 with their own seeds, and each
reply must still parse and fit its own schema (the reference: the
`jsonschema` package). A processor that counted calls or batch rows, not its
own sequence's tokens, would mask one request with another's state."""

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx_lm.generate import BatchGenerator, make_stop_sequences
from mlx_lm.utils import load_tokenizer

from flashnorm_mlx import load
from flashnorm_mlx.grammar import (
    GROW,
    GrammarError,
    Grammars,
    closing_text,
    json_grammar,
    tool_call_grammar,
)
from flashnorm_mlx.serve.scheduler import make_seeded_sampler

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
            "s": {"type": "string", "maxLength": 6},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 4},
                "maxItems": 3,
            },
        },
        "required": ["n", "s", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 1,
        "maxItems": 4,
    },
    {"enum": ["red", "green", "blue"]},
]
JOIN_AT = [
    0,
    2,
    3,
    7,
]  # the batch grows at steps 2, 3, 7; replies end at their own steps


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tiny.make_llama(tmp_path_factory.mktemp("structured"), "gqa_untied")
    model, _ = load(str(path))
    return model, load_tokenizer(path)


def run_batch(model, tokenizer, schemas, join_at, seeds, max_tokens=60, close=False):
    """Each schema's reply text, request i joining the batch at step join_at[i]."""
    grammars = Grammars(tokenizer)
    prompt = tokenizer.encode("JSON please: ")
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    uids, out, step, eos = {}, {}, 0, list(tokenizer.eos_token_ids)
    try:
        while step <= max(join_at) or gen._generation_batch or gen._prompt_batch.uids:
            for i, at in enumerate(join_at):
                if at == step:
                    p = grammars.processor(
                        json_grammar(schemas[i]), max_tokens if close else None
                    )
                    (uid,) = gen.insert(
                        [prompt],
                        max_tokens=[max_tokens],
                        samplers=[make_seeded_sampler(1.0, 1.0, seeds[i])],
                        logits_processors=[[p]],
                        stop_sequences=[make_stop_sequences(tokenizer)],
                    )
                    uids[uid] = i
            _, responses = gen.next()
            for r in responses:
                ids, _ = out.setdefault(uids[r.uid], ([], None))
                ids.append(r.token)
                if r.finish_reason:
                    out[uids[r.uid]] = (ids, r.finish_reason)
            step += 1
            assert step < 400, "the schedule did not finish"
    finally:
        gen.close()
    replies = []
    for i in range(len(schemas)):
        ids, finish = out[i]
        ids = [t for t in ids if t not in eos]
        replies.append((tokenizer.decode(ids), finish))
    return replies


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_request_fits_its_schema_while_the_batch_changes(tiny_model, seed):
    model, tok = tiny_model
    seeds = [seed * 10 + i for i in range(4)]
    replies = run_batch(model, tok, SCHEMAS, JOIN_AT, seeds)
    for schema, (text, finish) in zip(SCHEMAS, replies):
        print(finish, repr(text))
        assert finish == "stop", (finish, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_is_closed_before_max_tokens_runs_out(tiny_model):
    """Any JSON object (json_object) from the random model, 16 tokens at most:
    with the budget known, the reply closes its strings, arrays and objects in
    time and parses; without, the same seeds leave cut JSON."""
    model, tok = tiny_model
    n = 6
    seeds, join_at = list(range(n)), [0] * n
    closed = run_batch(model, tok, [None] * n, join_at, seeds, 16, close=True)
    cut = run_batch(model, tok, [None] * n, join_at, seeds, 16)
    print(closed, cut)
    for text, finish in closed:
        assert isinstance(json.loads(text), dict), (text, finish)

    def parses(text):
        try:
            json.loads(text)
            return True
        except ValueError:
            return False

    assert not all(parses(text) for text, _ in cut), cut


def test_closing_text_writes_the_grammars_separators():
    """After "," or ":" the compact grammar writes a space first: counted, so
    the tokens that spell the closing fit the budget."""
    for text, want in [
        (b'{"a":', b' ""}'),
        (b'{"a": ', b'""}'),
        (b'{"a": 1,', b' "": ""}'),
        (b'{"a": 1, ', b'"": ""}'),
        (b"[1,", b' ""]'),
        (b"[1, ", b'""]'),
        (b'{"a"', b': ""}'),
        (b'{"a": "x, {', b'"}'),
        (b'{"a": [1, 2', b"]}"),
    ]:
        assert closing_text(text) == want, (text, closing_text(text), want)


def test_no_token_near_the_end_leaves_more_to_close_than_fits(tiny_model):
    """SmolLM2's json_object reply for seed 7 with 28 tokens ran out as
    '{..: 1234567890123, "": "",': a "," with 4 tokens left owes ' "": ""}'.
    Within GROW tokens of the closing text's length a token that leaves more
    to close than fits is masked; farther from the end it is allowed."""
    tok = tiny_model[1]
    g = Grammars(tok)
    prefix = tok.encode('{"a": 1', add_special_tokens=False)
    comma = [i for i, b in g.closing_tokens()[1] if b in (b",", b", ")]
    assert comma, "the tokenizer has no comma token"
    # '}' closes it: a budget of len(prefix) + 5 leaves 5, within 1 + 2 + GROW.
    for left, allowed in [(5, False), (3 + GROW + 1, True)]:
        p = g.processor(json_grammar(None), len(prefix) + left)
        p.advance(prefix)
        assert p.failed is None, p.failed
        mask = np.array(p.allowed(p.vocab_size))
        print(left, [(i, bool(mask[i])) for i in comma])
        assert all(mask[i] == allowed for i in comma), (left, allowed)
        assert mask[tok.encode("}", add_special_tokens=False)[0]], left


def test_without_the_grammar_the_tiny_model_writes_no_json(tiny_model):
    """The reference that the test above can fail: unconstrained, the random
    model's bytes do not parse."""
    model, tok = tiny_model
    from mlx_lm import generate

    text = generate(
        model,
        tok,
        "JSON please: ",
        max_tokens=20,
        sampler=make_seeded_sampler(1.0, 1.0, 0),
    )
    with pytest.raises(ValueError):
        json.loads(text)


def test_schemas_llguidance_cannot_compile_name_the_reason(tiny_model):
    g = Grammars(tiny_model[1])
    for schema, word in [
        ({"type": "object", "if": {}, "then": {}}, "if"),
        ({"type": "wrong"}, "wrong"),
        ({"$ref": "#/nowhere"}, "nowhere"),
    ]:
        with pytest.raises(GrammarError) as e:
            g.processor(json_grammar(schema))
        assert word in str(e.value), (schema, str(e.value))


def test_tool_call_grammar_holds_arguments_to_the_parameters(tiny_model):
    """A reply with text, then a call whose arguments must fit `parameters`."""
    tok = tiny_model[1]
    params = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    ]
    g = Grammars(tok)
    grammar = tool_call_grammar(tools, "<tool_call>", "</tool_call>")
    good = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    bad = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}'
    for text, fits in [(good, True), (bad, False), ("No call at all.", True)]:
        p = g.processor(grammar)
        p.advance(tok.encode(text))
        print(repr(text), p.failed)
        assert (p.failed is None) == fits, (text, p.failed)


# --- generate --json-schema / --json (the embedded SmolLM2) --------------------


def _generate(*args):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "flashnorm_mlx", "generate", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_generate_refuses_a_bad_schema_in_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "object", "if": {}, "then": {}}))
    for path, word in [(bad, "if"), (tmp_path / "missing.json", "missing.json")]:
        r = _generate("--json-schema", str(path), "-p", "x")
        print(r.stderr)
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and word in r.stderr, r.stderr


@pytest.mark.slow
def test_generate_json_schema_fits_at_temperature_0_7(tmp_path):
    schema = SCHEMAS[0]
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    for flags, check in [
        (["--json-schema", str(path)], lambda v: jsonschema.validate(v, schema)),
        (["--json"], lambda v: isinstance(v, dict) or pytest.fail(repr(v))),
    ]:
        r = _generate(
            *flags,
            *("-p", "A cat as JSON.", "--temp", "0.7", "--seed", "3", "-m", "80"),
            *("--system-prompt", "JSON only."),  # not SmolLM2's default, ~14 more
        )
        print(r.stdout, r.stderr[-500:])
        assert r.returncode == 0, r.stderr
        text = r.stdout.split("\n==========")[0].strip()
        check(json.loads(text))


def test_speculative_decoding_keeps_the_matcher_in_step(tiny_model, tmp_path):
    """mlx-lm's speculative step calls the processor on the draft's tokens
    and on the verified ones, rejected drafts included: the processor rolls
    back what the history no longer holds. A draft of another random model
    disagrees often, so rollbacks happen."""
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model, tok = tiny_model
    draft, _ = load(str(tiny.make_llama(tmp_path / "draft", "gqa_untied", seed=5)))
    prompt = tok.encode("JSON please: ")
    g = Grammars(tok)
    eos = set(tok.eos_token_ids)
    for seed, schema in enumerate(SCHEMAS):
        p = g.processor(json_grammar(schema))
        ids, drafted = [], 0
        steps = speculative_generate_step(
            mx.array(prompt),
            model,
            draft,
            num_draft_tokens=3,
            max_tokens=60,
            sampler=make_seeded_sampler(1.0, 1.0, seed),
            logits_processors=[p],
            prompt_cache=make_prompt_cache(model) + make_prompt_cache(draft),
        )
        for token, _, from_draft in steps:
            if int(token) in eos:
                break
            ids.append(int(token))
            drafted += bool(from_draft)
        text = tok.decode(ids)
        print(seed, drafted, len(ids), repr(text))
        jsonschema.validate(json.loads(text), schema)
