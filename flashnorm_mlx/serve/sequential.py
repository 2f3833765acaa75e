"""serve with a draft model or KV cache options: requests run one at a time,
unbatched, as mlx_lm.server runs them (docs/design.md section 3f).

mlx-lm's `BatchGenerator` has no speculative decoding, no quantized KV cache
and no window per sequence; mlx_lm.server serves such requests one at a time
with `stream_generate`. Here `SequentialGenerator` offers the BatchGenerator's
calls the generation thread makes (insert, next, remove, close) over mlx-lm's
`generate_step` or `speculative_generate_step`, one request at a time in
arrival order, so the thread (scheduler.Worker: stop strings, logprobs,
streaming, the prompt cache pool) stays as it is.
"""

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional

from ..decode_options import DraftTally, KVOptions, after_prefix, make_cache
from .log import log
from .scheduler import Worker


@dataclass
class Decoding:
    """The options that make serve run requests one at a time. `draft_model`
    is set by the build, on the generation thread (MLX streams are per thread)."""

    kv: KVOptions
    draft_path: Optional[str] = None
    num_draft_tokens: int = 3
    draft_model: Optional[object] = None

    @property
    def sequential(self) -> bool:
        return self.draft_path is not None or not self.kv.plain

    def worker(self):
        """The generation thread's class for Service: the batched Worker, or
        SequentialWorker with these options (say why() first)."""
        if not self.sequential:
            return Worker
        return functools.partial(SequentialWorker, decoding=self)

    def why(self) -> str:
        flags = [f"--draft-model {self.draft_path}"] if self.draft_path else []
        if self.kv.max_kv_size is not None:
            flags.append(f"--max-kv-size {self.kv.max_kv_size}")
        if self.kv.kv_bits is not None:
            flags.append(f"--kv-bits {self.kv.kv_bits}")
        return (
            f"{', '.join(flags)}: requests run one at a time, unbatched, as "
            "mlx_lm.server runs them"
        )


class _Response:
    """What `BatchGenerator.next()` gives per sequence, as the Worker reads it."""

    def __init__(self, uid, token, logprobs, finish_reason, cache=None, tokens=None):
        self.uid, self.token, self.logprobs = uid, token, logprobs
        self.finish_reason = finish_reason
        self.prompt_cache, self.all_tokens = cache, tokens


@dataclass
class _Sequence:
    steps: object  # the token generator: (token, logprobs, from_draft)
    cache: list
    tokens: List[int]  # everything fed or generated, in order
    max_tokens: int
    matcher: object
    tally: Optional[DraftTally]
    made: int = 0


class SequentialGenerator:
    """BatchGenerator's calls, one sequence decoding at a time (see the module
    doc). The others wait in arrival order, without responses."""

    def __init__(self, model, decoding: Decoding, stream):
        self.model, self.decoding, self.stream = model, decoding, stream
        self.sequences: Dict[int, _Sequence] = {}
        self.next_uid = 0

    def insert(
        self,
        prompts,
        max_tokens,
        caches=None,
        all_tokens=None,
        samplers=None,
        logits_processors=None,
        stop_sequences=None,
    ) -> List[int]:
        uids = []
        for i, rest in enumerate(prompts):
            fed = list(all_tokens[i]) if all_tokens else []
            cache = caches[i] if caches else None
            processors = (logits_processors or [[]] * len(prompts))[i]
            sequence = self._start(
                rest, fed, cache, max_tokens[i], samplers[i], processors
            )
            sequence.matcher = stop_sequences[i].matcher()
            self.sequences[self.next_uid] = sequence
            uids.append(self.next_uid)
            self.next_uid += 1
        return uids

    def _start(self, rest, fed, cache, max_tokens, sampler, processors):
        import mlx.core as mx
        from mlx_lm.generate import generate_step, speculative_generate_step

        d = self.decoding
        if cache is None:
            cache = make_cache(self.model, d.kv.max_kv_size)
            if d.draft_model is not None:
                cache += make_cache(d.draft_model)
        if processors and fed:  # they see the whole prompt, cached part too
            prefix = mx.array(fed)
            processors = [after_prefix(prefix, p) for p in processors]
        kwargs = dict(
            max_tokens=max_tokens,
            sampler=sampler,
            logits_processors=processors or None,
            prompt_cache=cache,
            **d.kv.quantize_kwargs(),
        )
        prompt = mx.array(rest)
        if d.draft_model is None:
            plain = generate_step(prompt, self.model, self.stream, **kwargs)
            steps = ((t, lp, False) for t, lp in plain)
            tally = None
        else:
            steps = speculative_generate_step(
                prompt,
                self.model,
                d.draft_model,
                self.stream,
                num_draft_tokens=d.num_draft_tokens,
                **kwargs,
            )
            tally = DraftTally(d.num_draft_tokens, max_tokens)
        return _Sequence(steps, cache, fed + list(rest), max_tokens, None, tally)

    def next(self):
        """(None, [the response of the first sequence's next token])."""
        if not self.sequences:
            return None, []
        uid, s = next(iter(self.sequences.items()))
        token, logprobs, from_draft = next(s.steps)
        s.tokens.append(token)
        s.made += 1
        if s.tally is not None:
            s.tally.add(from_draft)
        reason = "stop" if s.matcher.advance(token) else None
        if reason is None and s.made >= s.max_tokens:
            reason = "length"
        if reason is None:
            return None, [_Response(uid, token, logprobs, None)]
        cache, tokens = self._end(uid)
        return None, [_Response(uid, token, logprobs, reason, cache, tokens)]

    def _end(self, uid):
        """Close a sequence: (its cache, the tokens it holds), or (None, None)
        where its layers disagree (a draft's cache may end a token apart)."""
        s = self.sequences.pop(uid)
        s.steps.close()  # speculative decoding rewinds its caches here
        if s.tally is not None and s.made:
            log(s.tally.short())
        offsets = {int(getattr(c, "offset", -1)) for c in s.cache}
        if len(offsets) != 1 or not 0 < offsets.pop() <= len(s.tokens):
            return None, None
        return s.cache, s.tokens[: s.cache[0].offset]

    def remove(self, uids, return_prompt_caches: bool = False):
        out = {uid: self._end(uid) for uid in uids if uid in self.sequences}
        return out if return_prompt_caches else None

    def close(self):
        for uid in list(self.sequences):
            self._end(uid)


class SequentialWorker(Worker):
    """The generation thread with a `SequentialGenerator` in place of mlx-lm's
    BatchGenerator."""

    def __init__(self, build, settings, tokenizer_lock, decoding: Decoding):
        super().__init__(build, settings, tokenizer_lock)
        self.decoding = decoding

    def _new_generator(self):
        return SequentialGenerator(self.model, self.decoding, self.stream)
