"""The chat page's Compare (POST /compare): the last reply's prompt run again
on the server's model and on the same weights built the other way (stock for
a FlashNorm server, FlashNorm for a stock one), decode timed as chat's
/compare times it (timing.compare_decode_speed: the same prompt and token
count for both, end-of-sequence ignored, greedy).

The other model is built on the first Compare and kept: one more copy of the
weights in memory from then on, none before (docs/serve.md). It is built and
both are timed on the generation thread (Worker.call), between batch steps:
no request decodes meanwhile, so neither figure holds another request's work;
requests in flight wait for the comparison.
"""

import time
from typing import Callable, List

from ..errors import UnsupportedModel
from ..modes import FLASHNORM, STOCK, mode_named
from .log import log
from .schema import RequestError

TIMEOUT_S = 1800  # building the other model and two runs, on a slow machine


def other_mode(mode: str) -> str:
    """What a server running `mode` is compared with (its name)."""
    return (FLASHNORM if mode_named(mode).is_mlx_lms else STOCK).name


class Comparer:
    """The server's model against the other mode on the same weights.
    build_other() -> that model, called once, on the generation thread;
    `settle` gives the server's mode once the model is read (serve's --mode
    defaults by family)."""

    def __init__(self, build_other: Callable[[], object], mode: str = "flashnorm"):
        self.build_other = build_other
        self.settle(mode)
        self.model = None  # the other model, once built

    def settle(self, mode: str) -> None:
        self.mode, self.other = mode, other_mode(mode)

    def run(self, worker, prompt: List[int], n: int) -> dict:
        """On the generation thread: both models' decode speed on `prompt`."""
        from ..timing import compare_decode_speed

        built_s = 0.0
        if self.model is None:
            start = time.perf_counter()
            try:
                self.model = self.build_other()
            except UnsupportedModel as e:  # a family FlashNorm does not cover
                raise RequestError(f"nothing to compare: {e}") from None
            # Never 0 once built: 0 says "built before" to the page and the log.
            built_s = max(time.perf_counter() - start, 0.01)
        models = {self.mode: worker.model, self.other: self.model}
        r = compare_decode_speed(models, prompt, n)
        ids = {m: r[m]["tokens"] for m in models}
        agree = 0  # leading tokens the two greedy runs share
        for a, b in zip(ids[self.mode], ids[self.other]):
            if a != b:
                break
            agree += 1
        tps = {m: round(r[m]["decode_tps"], 2) for m in models}
        return {
            "object": "compare",
            "prompt_tokens": len(prompt),
            "tokens": n,
            "sampler": "greedy",
            "modes": [self.mode, self.other],  # the server's own first
            "results": {
                m: {
                    "decode_tokens_per_second": tps[m],
                    "prompt_tokens_per_second": round(r[m]["prompt_tps"], 2),
                    "token_ids": ids[m],
                    "model": type(models[m]).__module__,  # whose class it is
                }
                for m in models
            },
            "ratio": round(tps["flashnorm"] / tps["stock"], 3),  # FlashNorm / stock
            "agree": agree,
            "built_seconds": round(built_s, 2),
        }


def compare(h) -> None:
    """POST /compare {"messages", "max_tokens": the reply's token count, and
    any other chat field} -> Comparer.run's JSON."""
    s = h.service
    body = h.read_json()
    if s.comparer is None:
        raise RequestError("this server does not compare", status=404)
    n = body.get("max_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise RequestError(
            "'max_tokens' must be the reply's token count, 2 or more",
            param="max_tokens",
            code="invalid_value",
        )
    requests = s.parse("chat", {**body, "stream": False})
    prompt = requests[0].prompt
    c = s.comparer
    out = s.worker.call(lambda w: c.run(w, prompt, n), TIMEOUT_S)
    tps = {m: out["results"][m]["decode_tokens_per_second"] for m in out["modes"]}
    log(
        f"compare: {' | '.join(f'{m} {v} tok/s' for m, v in tps.items())} "
        f"({out['ratio']}x), {n} tokens, prompt {len(prompt)}, "
        f"{out['agree']}/{n} tokens alike"
        + (
            f", {c.other} built in {out['built_seconds']} s"
            if out["built_seconds"]
            else ""
        )
    )
    h.send_json(200, out)
