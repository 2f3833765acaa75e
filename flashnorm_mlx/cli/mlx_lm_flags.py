"""mlx-lm's flags, with mlx-lm's names, defaults and help: sampling,
speculative decoding and the KV cache (mlx_lm.generate), adapters, chat
templates and prompt caches (mlx_lm.generate, chat, server, cache_prompt).
Like flags.py, it imports no MLX: a bad flag is one line before seconds of
imports."""

import argparse

from ..limits import GROUP_SIZES, KV_BITS

# mlx-lm's sampler flags (mlx_lm.generate; make_sampler's arguments), default
# off: flag destination -> (type, default, help).
SAMPLER_FLAGS = {
    "top_p": (float, 1.0, "nucleus sampling threshold (1: off)"),
    "top_k": (int, 0, "sample from the k most likely tokens only (0: off)"),
    "min_p": (
        float,
        0.0,
        "drop tokens less likely than min-p times the most likely one (0: off)",
    ),
    "min_tokens_to_keep": (int, 1, "tokens that --min-p never drops"),
    "xtc_probability": (
        float,
        0.0,
        "XTC sampling: chance per token of excluding the top choices (0: off)",
    ),
    "xtc_threshold": (
        float,
        0.1,
        "XTC sampling: tokens at least this likely count as top choices",
    ),
}


def add_sampling_args(
    parser: argparse.ArgumentParser, max_tokens: int, sampler=tuple(SAMPLER_FLAGS)
) -> None:
    """-m/--max-tokens, --temp, the `sampler` flags of SAMPLER_FLAGS, --seed,
    as mlx-lm names them."""
    parser.add_argument(
        "-m", "--max-tokens", type=int, default=max_tokens, help="most tokens per reply"
    )
    parser.add_argument(
        "--temp", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    for dest in sampler:
        kind, default, text = SAMPLER_FLAGS[dest]
        flag = "--" + dest.replace("_", "-")
        parser.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="random seed for sampling (default: none, a different draw each run)",
    )


# mlx-lm's speculative decoding and KV cache flags (mlx_lm.generate), with its
# defaults; docs/design.md section 3f.
DEFAULT_NUM_DRAFT_TOKENS = 3  # mlx_lm.generate's --num-draft-tokens
DEFAULT_QUANTIZED_KV_START = 5000  # mlx_lm.generate.DEFAULT_QUANTIZED_KV_START
KV_KEEP = 4  # first tokens a rotating cache keeps (mlx-lm's make_prompt_cache)


def add_draft_args(parser: argparse.ArgumentParser) -> None:
    """--draft-model and --num-draft-tokens, as mlx-lm names them."""
    parser.add_argument(
        "--draft-model",
        default=None,
        help="a model to be used for speculative decoding: any checkpoint with "
        "the model's tokenizer, built in the same --mode; greedy text is the "
        "same with or without it",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=DEFAULT_NUM_DRAFT_TOKENS,
        help="number of tokens to draft when using speculative decoding",
    )


def add_kv_cache_args(parser: argparse.ArgumentParser) -> None:
    """--max-kv-size, --kv-bits, --kv-group-size, --quantized-kv-start, as
    mlx-lm names them."""
    parser.add_argument(
        "--max-kv-size",
        type=int,
        default=None,
        help="set the maximum key-value cache size: a rotating cache that keeps "
        f"the first {KV_KEEP} tokens and the latest ones (default: unlimited)",
    )
    parser.add_argument(
        "--kv-bits",
        type=int,
        choices=KV_BITS,
        default=None,
        help="number of bits for KV cache quantization (default: no quantization)",
    )
    parser.add_argument(
        "--kv-group-size",
        type=int,
        choices=GROUP_SIZES,
        default=64,
        help="group size for KV cache quantization; must divide the head dim",
    )
    parser.add_argument(
        "--quantized-kv-start",
        type=int,
        default=DEFAULT_QUANTIZED_KV_START,
        help="when --kv-bits is set, start quantizing the KV cache from this "
        "step onwards",
    )


def str2bool(text: str) -> bool:
    """A boolean flag's value as mlx_lm.generate reads it: anything but 'false'
    or 'f' (any case) is True."""
    return text.lower() not in ("false", "f")


def add_verbose_arg(parser: argparse.ArgumentParser) -> None:
    """mlx_lm.generate's --verbose True|False (False: the reply alone)."""
    parser.add_argument(
        "--verbose",
        type=str2bool,
        default=True,
        help="Log verbose output when 'True' or 'T' or only print the response "
        "when 'False' or 'F'",
    )


def add_eos_token_arg(parser: argparse.ArgumentParser) -> None:
    """mlx_lm.cache_prompt's --eos-token (the file's tokenizer_config keeps it)."""
    parser.add_argument(
        "--eos-token",
        type=str,
        default=None,
        help="End of sequence token for tokenizer (kept in the file: generate "
        "--prompt-cache-file stops at it too, as mlx-lm does)",
    )


# --- mlx-lm's adapter, template and prompt-cache flags (names, defaults and
# help as mlx_lm.generate, chat, server and cache_prompt give them) ----------


def add_adapter_args(parser: argparse.ArgumentParser) -> None:
    """--adapter-path: an mlx-lm LoRA or DoRA adapter folder, fused into the
    float weights before the fold (loading/adapters.py)."""
    parser.add_argument(
        "--adapter-path",
        type=_existing("a folder", "no such adapter folder"),
        default=None,
        help="Optional path for the trained adapter weights and config "
        "(an mlx-lm LoRA or DoRA folder: adapter_config.json, "
        "adapters.safetensors), fused into the weights before folding",
    )


def add_template_args(parser: argparse.ArgumentParser, prompt: bool = True) -> None:
    """generate's template flags: --extra-eos-token, --chat-template-config,
    --use-default-chat-template and, with `prompt`, --prefill-response."""
    parser.add_argument(
        "--extra-eos-token",
        type=str,
        default=(),
        nargs="+",
        help="Add tokens in the list of eos tokens that stop generation.",
    )
    if prompt:
        parser.add_argument(
            "--prefill-response",
            default=None,
            help="Prefill response to be used for the chat template",
        )
    parser.add_argument(
        "--use-default-chat-template",
        action="store_true",
        help="Use the default chat template",
    )
    parser.add_argument(
        "--chat-template-config",
        type=_json_object("--chat-template-config"),
        default=None,
        help="Additional config for `apply_chat_template`. Should be a dictionary "
        "of string keys to values represented as a JSON decodable string.",
    )


def add_serve_template_args(parser: argparse.ArgumentParser) -> None:
    """serve's --chat-template, --use-default-chat-template, --chat-template-args."""
    parser.add_argument(
        "--chat-template",
        type=str,
        default="",
        help="Specify a chat template for the tokenizer (default: the model's)",
    )
    parser.add_argument(
        "--use-default-chat-template",
        action="store_true",
        help="Use the default chat template",
    )
    parser.add_argument(
        "--chat-template-args",
        type=_json_object("--chat-template-args"),
        default="{}",
        help="A JSON formatted string of arguments for the tokenizer's "
        "apply_chat_template, e.g. '{\"enable_thinking\":false}'",
    )


def add_prompt_cache_args(parser: argparse.ArgumentParser) -> None:
    """--prompt-cache-file: a KV cache saved by `cache-prompt` (prompt_cache.py)."""
    parser.add_argument(
        "--prompt-cache-file",
        type=_existing("a file", "no such file"),
        default=None,
        help="A file containing saved KV caches to avoid recomputing them "
        "(made by `flashnorm-mlx cache-prompt`, or mlx-lm's cache_prompt: "
        "either mode, --mode stock for a model with recurrent layers)",
    )


def _existing(kind: str, missing: str):
    """An argparse type: a path that exists as `kind` ("a folder" or "a
    file"), checked before MLX is imported."""
    from pathlib import Path

    def check(text: str) -> str:
        path = Path(text).expanduser()
        if not (path.is_dir() if kind == "a folder" else path.is_file()):
            raise argparse.ArgumentTypeError(f"{missing}: {text}")
        return text

    check.__name__ = kind
    return check


def _json_object(flag: str):
    """An argparse type: a JSON object (mlx-lm passes it to apply_chat_template
    as keyword arguments), else one line and exit 2."""
    import json

    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError("not a JSON object ({...})")
        return value

    parse.__name__ = f"{flag} JSON object"
    return parse


# mlx-lm's prefill and tokenizer flags (mlx_lm.generate, chat, server).
DEFAULT_PREFILL_STEP_SIZE = 2048  # mlx_lm.generate.DEFAULT_PREFILL_STEP_SIZE


def add_prefill_step_arg(parser: argparse.ArgumentParser) -> None:
    """--prefill-step-size, as mlx_lm.generate and chat name it."""
    parser.add_argument(
        "--prefill-step-size",
        type=int,
        default=DEFAULT_PREFILL_STEP_SIZE,
        help="number of prompt tokens to process at a time; smaller values lower "
        "peak memory during prefill",
    )


def add_trust_remote_code_arg(parser: argparse.ArgumentParser) -> None:
    """--trust-remote-code: the tokenizer may run the model folder's own code."""
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="enable trusting remote code for the tokenizer (a class defined in "
        "the model's own Python files; a hub download then fetches them)",
    )


class _Refused(argparse.Action):
    """An mlx-lm flag taken by name and refused in one line (exit 2) saying why."""

    def __init__(self, option_strings, dest, why: str = "", **kw):
        self.why = why
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {self.why}")


IMAGE_WHY = (
    "flashnorm-mlx runs text models only (a multimodal wrapper's text model); "
    "mlx_lm generate --image runs the image-taking ones"
)
QUANTIZE_ACTIVATIONS_WHY = (
    "mlx-lm quantizes activations only in nvfp4/mxfp8 layers (its QQLinear), "
    "which FlashNorm's folded layers do not have; mlx_lm generate "
    "--quantize-activations runs them"
)


def add_refused_args(parser: argparse.ArgumentParser) -> None:
    """mlx_lm.generate's --image and --quantize-activations: one line each."""
    parser.add_argument(
        "--image", nargs="+", action=_Refused, why=IMAGE_WHY, help=IMAGE_WHY
    )
    parser.add_argument(
        "--quantize-activations",
        "-qa",
        nargs=0,
        action=_Refused,
        why=QUANTIZE_ACTIVATIONS_WHY,
        help=QUANTIZE_ACTIVATIONS_WHY,
    )


def add_generation_args(parser: argparse.ArgumentParser) -> None:
    """What generate and chat both take from mlx_lm.generate: the prefill step,
    --trust-remote-code, a draft, the KV cache options, an adapter and a
    prompt-cache file."""
    add_prefill_step_arg(parser)
    add_trust_remote_code_arg(parser)
    add_draft_args(parser)
    add_kv_cache_args(parser)
    add_adapter_args(parser)
    add_prompt_cache_args(parser)
