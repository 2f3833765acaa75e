"""Fair prefill: how many prompt tokens the generation thread reads per step.

mlx-lm's BatchGenerator interleaves: each `next()` decodes one token for every
running stream, then reads one chunk (`prefill_step_size` tokens) of each
prompt still prefilling. A fixed chunk makes a running stream wait one chunk's
time, which on a slow machine is a minute for 512 tokens. Here the chunk is
sized by time, as chat's prefill (flashnorm_mlx/conversation.py) sizes its own: the
rate measured on the last chunk sets the next one to about `seconds`, at most
twice the last and never over `most` (--prefill-step-size). A chunk's cost is
what its pass takes beyond the step's decode pass (the cost of any forward
pass as such, large on a busy CPU), and a step reads FIRST_CHUNK tokens at
least. With no stream decoding, nobody waits: prompts are read `most` tokens
a step.
"""

FIRST_CHUNK = 4  # tokens, before any chunk was timed (chat.PREFILL_FIRST_CHUNK)


class PrefillPace:
    def __init__(self, seconds: float, most: int):
        self.seconds, self.most = seconds, most
        self.per_token = None  # seconds per prompt token, last measured
        self.last = FIRST_CHUNK

    def step(self, prompting: int, decoding: bool = True) -> int:
        """Tokens per prompt for the next step, with `prompting` prompts
        read in it together (their chunks are one forward pass). With no
        stream decoding, nobody waits: the whole `most`."""
        if not decoding:
            return self.most
        if self.per_token is None:
            return min(FIRST_CHUNK, self.most)
        fit = self.seconds / (self.per_token * max(prompting, 1))
        least = -(-FIRST_CHUNK // max(prompting, 1))
        self.last = max(least, min(int(fit), 2 * self.last, self.most))
        return self.last

    def measured(self, tokens: int, seconds: float, fixed: float = 0.0) -> None:
        """A step read `tokens` prompt tokens in `seconds`; its decode pass
        (one token a stream) took `fixed`, the cost of a forward pass as such."""
        if tokens > 0 and seconds > 0:
            # The chunk's own cost: what its pass took beyond a decode pass.
            self.per_token = max(seconds - fixed, seconds / 4) / tokens
