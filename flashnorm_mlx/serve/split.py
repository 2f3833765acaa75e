"""The split of a serve request's reply (thinking.py): the request's tools
(read once, by Service.parse), at most one call where `parallel_tool_calls`
is false."""

from ..thinking import ReplySplit


def reply_split(service, request, body: dict, streaming: bool):
    """A ReplySplit for a chat request whose reply may hold a thought or tool
    calls (its tools checked already by Service.parse), else None."""
    if request.kind != "chat":
        return None
    tools, tokenizer = request.tools, service.tokenizer
    if not tools and not getattr(tokenizer, "has_thinking", False):
        return None
    most = 1 if body.get("parallel_tool_calls") is False else None
    return ReplySplit(tokenizer, tools, streaming, request.thought, most)
