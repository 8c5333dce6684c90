"""KV admission: may one more request join the running set?

All three modes see the running requests as pairs (own, b):
  own = device KV tokens the request holds privately (its prompt is allocated
        in full at admission; shared prefix-cache tokens are not counted,
        they are held by the locked cache nodes) plus a page slack of
        page_size - 1 (a request may waste at most part of its last page);
  b   = tokens it may still grow by: final length - positions held, where the
        final length is prompt + max_tokens - 1 (the last sampled token never
        gets a KV slot), capped by max_model_len.
and a `budget`: the tokens the running set may ever hold = free + evictable
(prefix cache) + what the running set holds privately now.

guaranteed  sum(own + b) + cand <= budget            (TRT-LLM GUARANTEED_NO_EVICT)
peak        max_i (own_1 + .. + own_i) + i * b_i <= budget, sorted by b desc
            (LightLLM Efficient Router, exact peak of future use; since
            i * b_i <= b_1 + .. + b_i it never admits less than guaranteed)
optimistic  cand_own + ratio * min(cand_b, cap) <= free + evictable
                                - ratio * sum(min(b, cap))   (SGLang)
            where ratio is new_token_ratio (decays; reset after preemption).

All of them are O(running) per admission attempt (peak sorts the running set
once per attempt), never O(queue).
"""
from __future__ import annotations

from bisect import insort


class AdmissionState:
    """Built once per scheduling step from the running set; `fits` checks one
    candidate, `add` commits it."""

    def __init__(self, mode: str, pairs: list[tuple[int, int]], free_tokens: int,
                 ratio: float = 0.0, cap: int = 4096):
        self.mode = mode
        self.free = free_tokens          # free + evictable device tokens right now
        self.ratio = ratio
        self.cap = cap
        if mode == "guaranteed":
            self.need = sum(o + b for o, b in pairs)        # future total
            self.held = sum(o for o, _ in pairs)
        elif mode == "peak":
            self.held = sum(o for o, _ in pairs)
            # sorted by b descending: keep list of (-b, own)
            self.items = sorted((-b, o) for o, b in pairs)
        else:
            self.reserve = ratio * sum(min(b, cap) for _, b in pairs)
        self.n = len(pairs)

    def _peak(self, extra: tuple[int, int] | None) -> int:
        items = self.items
        if extra is not None:
            items = list(items)
            insort(items, (-extra[1], extra[0]))
        best = 0
        cum = 0
        for i, (nb, o) in enumerate(items, 1):
            cum += o
            v = cum - i * nb
            if v > best:
                best = v
        return best

    def fits(self, own: int, b: int, locked_from_free: int = 0) -> bool:
        """own: tokens the candidate allocates now (incl. page slack);
        b: its growth; locked_from_free: evictable cache tokens its prefix hit
        would lock (they stop counting as free)."""
        free = self.free - locked_from_free
        if self.mode == "guaranteed":
            return self.need - self.held + own + b <= free
        if self.mode == "peak":
            budget = free + self.held
            return self._peak((own, b)) <= budget
        if self.n == 0:
            return own <= free          # progress: an idle server admits anything that fits now
        return own + self.ratio * min(b, self.cap) <= free - self.reserve

    def add(self, own: int, b: int, locked_from_free: int = 0) -> None:
        self.free -= own + locked_from_free
        self.n += 1
        if self.mode == "guaranteed":
            self.need += own + b
            self.held += own
        elif self.mode == "peak":
            self.held += own
            insort(self.items, (-b, own))
        else:
            self.reserve += self.ratio * min(b, self.cap)


def peak_usage(pairs: list[tuple[int, int]]) -> int:
    """LightLLM's estimate as a function (for tests and docs)."""
    items = sorted(pairs, key=lambda x: -x[1])
    best = cum = 0
    for i, (o, b) in enumerate(items, 1):
        cum += o
        best = max(best, cum + i * b)
    return best
