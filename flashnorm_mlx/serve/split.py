"""The split of a serve request's reply (thinking.py): the request's tools
and parallel_tool_calls (read once, into chat_body.Chat), at most one call
where it is false."""

from ..thinking import ReplySplit


def reply_split(service, request, streaming: bool):
    """A ReplySplit for a chat request whose reply may hold a thought or tool
    calls (its tools checked already by Service.parse), else None."""
    if request.kind != "chat":
        return None
    tools, tokenizer = request.tools, service.tokenizer
    if not tools and not getattr(tokenizer, "has_thinking", False):
        return None
    most = 1 if request.parallel_tool_calls is False else None
    return ReplySplit(tokenizer, tools, streaming, request.thought, most)
