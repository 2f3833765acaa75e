"""Prompts through the chat template, as mlx-lm's generate, chat and server make
them: a system prompt, a prefilled response, template arguments, extra
end-of-sequence tokens, a template of the user's or the default one, and the
suffix a cached prompt prefix leaves to feed (docs/design.md section 5d).
"""

from typing import Iterable, List, Optional

from .errors import UserError

# transformers' former class default (ChatML), which mlx-lm's
# --use-default-chat-template reads as `tokenizer.default_chat_template`; the
# attribute is gone from transformers 5, so it is written out here.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def set_template(
    tokenizer,
    chat_template: Optional[str] = None,
    use_default: bool = False,
    template_args: Optional[dict] = None,
    extra_eos: Iterable[str] = (),
):
    """The tokenizer with mlx-lm's template options applied (in place):
    `chat_template` replaces the model's (serve's --chat-template); `use_default`
    gives a tokenizer without one the default; `template_args` become default
    keyword arguments of every apply_chat_template (serve's
    --chat-template-args); each `extra_eos` token also ends a reply."""
    if chat_template:
        tokenizer.chat_template = chat_template
        tokenizer.has_chat_template = True
        _tool_parser_from_template(tokenizer)
    if use_default and not getattr(tokenizer, "has_chat_template", False):
        default = getattr(tokenizer, "default_chat_template", None)
        tokenizer.chat_template = default or DEFAULT_CHAT_TEMPLATE
        tokenizer.has_chat_template = True
    if template_args:
        apply = tokenizer.apply_chat_template  # the class's, bound

        def with_args(*args, **kwargs):
            return apply(*args, **{**template_args, **kwargs})

        # An instance attribute: every caller (serve's requests) gets the defaults.
        tokenizer.apply_chat_template = with_args
    for token in extra_eos:
        try:
            tokenizer.add_eos_token(token)
        except (ValueError, KeyError, TypeError):
            raise UserError(
                f"--extra-eos-token {token!r} is not a token of this tokenizer"
            ) from None
    return tokenizer


def _tool_parser_from_template(tokenizer) -> None:
    """The tool-call format a replaced template names, as mlx-lm's load
    infers it from the model's own (docs/serve.md "Tools"); where it names
    none, the model's stays."""
    from .mlx_lm_compat import infer_tool_parser, set_tool_parser

    if not hasattr(tokenizer, "has_tool_calling"):  # not mlx-lm's wrapper
        return
    name = infer_tool_parser(tokenizer)
    if name is not None:
        set_tool_parser(tokenizer, name)


def prompt_ids(
    tokenizer,
    prompt: str,
    system_prompt: Optional[str] = None,
    raw: bool = False,
    prefill_response: Optional[str] = None,
    template_args: Optional[dict] = None,
    cached: bool = False,
) -> List[int]:
    """Token ids of a user prompt, as mlx_lm.generate builds them: through the
    chat template unless `raw` or there is none, with a system message and a
    prefilled start of the reply if given. `cached`: a prompt cache holds the
    conversation's start (cache-prompt's user message, left open), so only
    what follows it is returned: the template from this prompt on."""
    if raw or not getattr(tokenizer, "has_chat_template", False):
        return list(tokenizer.encode(prompt))
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": prompt})
    has_prefill = prefill_response is not None
    if has_prefill:
        messages.append({"role": "assistant", "content": prefill_response})
    kw = dict(
        tokenize=False,
        continue_final_message=has_prefill,
        add_generation_prompt=not has_prefill,
    )
    text = tokenizer.apply_chat_template(messages, **kw, **(template_args or {}))
    if cached:  # mlx-lm's marker: the part of the template after the prompt
        messages[-1]["content"] = "<query>"
        probe = tokenizer.apply_chat_template(messages, **kw)
        text = text[probe.index("<query>") :]
    return list(tokenizer.encode(text, add_special_tokens=False))


def cache_prompt_ids(
    tokenizer, prompt: str, system_prompt: Optional[str] = None
) -> List[int]:
    """The ids mlx-lm's cache_prompt stores: the prompt as an open user message
    (a later prompt continues it), raw where there is no chat template; after
    a system message if given (what a chat with that system prompt reuses)."""
    if not getattr(tokenizer, "has_chat_template", False):
        return list(tokenizer.encode(prompt))
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": prompt})
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=False, continue_final_message=True
        )
    )
