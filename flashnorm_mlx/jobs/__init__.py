"""The work behind the commands, one module per command's job (bench, chat,
convert, perplexity, verify), callable from tests; the commands (cli/) call
them, and they import none of each other (docs/design.md section 5d)."""
