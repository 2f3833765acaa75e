"""A reply's text split as mlx_lm.server splits it (docs/serve.md, "Thinking
models"): mlx-lm's TextStateMachine over the tokenizer's think markers and,
where there are tools, its tool-call markers. The thought comes out as
`reasoning`, calls parsed by the tokenizer's tool parser (with mlx_lm.server's
ToolCallFormatter), the rest as content. Shared by serve and chat."""

from typing import List, NamedTuple, Optional


class Pieces(NamedTuple):
    """What one piece of reply text completes."""

    reasoning: str
    content: str
    calls: List[dict]


def starts_in_thought(tokenizer, prompt: List[int]) -> bool:
    """Whether the reply begins inside a thought: the prompt opened one (a
    think start after the last think end), as mlx_lm.server's _tokenize
    decides its initial state; or the tokenizer's response format says so."""
    if getattr(tokenizer, "response_initial_state", None) == "reasoning":
        return True
    if not getattr(tokenizer, "has_thinking", False):
        return False
    return tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt)


def reasoning_tokens(tokenizer, ids: List[int], in_thought: bool) -> int:
    """How many of a reply's tokens `ids` are thought: from its start (or the
    think start it writes) through the think end (or the reply's end)."""
    if not getattr(tokenizer, "has_thinking", False):
        return 0
    start = 0 if in_thought else tokenizer.find_think_start(ids)
    if start < 0:
        return 0
    end = tokenizer.find_think_end(ids, start)
    if end < 0:
        return len(ids) - start
    marker = tokenizer.encode(tokenizer.think_end, add_special_tokens=False)
    return min(len(ids), end + len(marker)) - start


def _transitions(tokenizer, tools) -> dict:
    """mlx_lm.generate.make_text_state_machine's transitions, tool markers
    only where the request has tools (docs/serve.md, "Tool calls")."""
    out = {"normal": []}
    thinking = getattr(tokenizer, "has_thinking", False)
    if thinking:
        out["normal"].append((tokenizer.think_start, "reasoning"))
        out["reasoning"] = [(tokenizer.think_end, "normal")]
    if tools:
        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
        out["normal"].append((start, "tool"))
        if thinking:
            out["reasoning"].append((start, "tool"))
        out["tool"] = [(end, "normal")] if end else []
    return out


class ReplySplit:
    """One reply's text split into thought, content and OpenAI `tool_calls`,
    piece by piece: text between a tool call's markers is held back and
    parsed when its end marker (or the reply's end) arrives."""

    def __init__(
        self,
        tokenizer,
        tools: Optional[List[dict]],
        streaming: bool,
        thought: bool,
        most: Optional[int] = None,
    ):
        from mlx_lm.generate import TextStateMachine
        from mlx_lm.server import ToolCallFormatter

        self.sm = TextStateMachine(_transitions(tokenizer, tools))
        self.split, self.flush = TextStateMachine.split, TextStateMachine.flush
        self.where = "reasoning" if thought else "normal"
        self.state = self.sm.make_state(self.where)
        parser = tokenizer.tool_parser if tools else None
        self.format = ToolCallFormatter(parser, tools, streaming) if tools else None
        self.held = ""
        self.called = False  # any call parsed: finish_reason "tool_calls"
        self.most = most  # calls kept (parallel_tool_calls false: 1); None: all
        self.calls = 0

    def feed(self, text: str, final: bool = False) -> Pieces:
        """What `text` completes; `final` at the reply's end, which flushes
        what is held (an unclosed call is parsed as it is)."""
        self.state, segments = self.split(self.state, text)
        if final:
            self.state, rest, where = self.flush(self.state)
            segments.append((where, rest))
        thought, content, done = "", "", []
        for where, piece in segments:
            if where == "tool":
                self.held += piece
            else:
                if self.where == "tool":
                    done.append(self.held)
                    self.held = ""
                if where == "reasoning":
                    thought += piece
                else:
                    content += piece
            self.where = where
        if final and self.where == "tool" and self.held.strip():
            done.append(self.held)
            self.held = ""
        calls = self.format(done) if self.format and done else []
        if self.most is not None:  # the first `most` calls; the rest dropped
            calls = calls[: max(0, self.most - self.calls)]
        self.calls += len(calls)
        self.called = self.called or bool(calls)
        return Pieces(thought, content, calls)

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if reason == "stop" and self.called else reason
