"""`flashnorm-mlx COMMAND ...`: dispatch to one module per command."""

import importlib
import os
import sys

from .. import interrupt

# command -> (module in flashnorm_mlx.cli, one-line help)
COMMANDS = {
    "chat": ("chat", "chat with a model in the terminal"),
    "generate": ("generate", "generate one completion for a prompt"),
    "verify": ("verify", "check FlashNorm against stock mlx-lm on the same weights"),
    "bench": ("bench", "tokens/sec of stock vs FlashNorm vs the norm-removed bound"),
    "convert": ("convert", "write a folded (optionally quantized) checkpoint"),
    "perplexity": ("perplexity", "perplexity of stock vs FlashNorm on real text"),
    "serve": (
        "serve",
        "an HTTP server: OpenAI's chat completions, completions and responses, "
        "Anthropic's messages",
    ),
    "cache-prompt": (
        "cache_prompt",
        "save a prompt's KV cache for --prompt-cache-file",
    ),
}


def _usage() -> str:
    lines = [
        "usage: flashnorm-mlx COMMAND [options]   (COMMAND --help for details)",
        "",
    ]
    lines.append("Exact FlashNorm inference on MLX for Llama-family models (llama,")
    lines.append(
        "mistral, ministral3, qwen2, qwen3, phi3, smollm3), openelm, gemma3_text,"
    )
    lines.append("gemma4_text, llama4_text (Llama 4's dense text model),")
    lines.append("the hybrids qwen3_5, qwen3_5_moe, qwen3_next, lfm2, lfm2_moe and")
    lines.append(
        "nemotron_h (Nemotron-H, Nemotron 3), granitemoehybrid (Granite 4) and"
    )
    lines.append("the mixtures of experts qwen3_moe, mixtral, gpt_oss, glm4_moe,")
    lines.append(
        "deepseek_v3 (DeepSeek V3), kimi_k2 (Kimi K2) and llama4 (Llama 4 Scout and"
    )
    lines.append("Maverick);")
    lines.append("every other model mlx-lm loads runs as stock (mlx-lm's own class).")
    lines.append("MODEL defaults to the embedded SmolLM2-135M-Instruct (4-bit GGUF).")
    lines.append("")
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # First: Ctrl-C while MLX imports (seconds) is one line and exit 130.
    name = argv[0] if argv and argv[0] in COMMANDS else ""
    restore = interrupt.at_start(f"flashnorm-mlx {name}".strip())
    try:
        return _main(argv)
    except KeyboardInterrupt:  # around a command's own handling (run_main)
        interrupt.say(interrupt.interrupted())
        return 130
    except BrokenPipeError:  # the reader went away (`... --help | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        restore()  # a caller in this process (a test) gets its own handler back


def _main(argv) -> int:
    if not argv:  # argparse's convention: usage on stderr, exit status 2
        print(_usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from .. import __version__

        print(f"flashnorm-mlx {__version__}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        choices = ", ".join(COMMANDS)
        print(
            f"flashnorm-mlx: error: unknown command {name!r} ({hint}choose from "
            f"{choices})",
            file=sys.stderr,
        )
        return 2
    # Light: a command imports MLX once its flags are checked (cli/flags.py).
    module = importlib.import_module(f"flashnorm_mlx.cli.{COMMANDS[name][0]}")
    sys.argv = [f"flashnorm-mlx {name}", *argv[1:]]
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
