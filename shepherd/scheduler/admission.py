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
once per attempt), never O(queue). `Admission` builds the state a step's
attempts share from the running set and the KV manager; GrowthRatio is the
ratio optimistic admission reserves with.
"""
from __future__ import annotations

from bisect import insort
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from shepherd.scheduler.kv_manager import KVManager
    from shepherd.scheduler.state import Entry


class AdmissionState:
    """Built once per scheduling step from the running set; `fits` checks one
    candidate, `add` commits it. One subclass per mode."""

    def __init__(self, pairs: list[tuple[int, int]], free_tokens: int, ratio: float = 0.0, cap: int = 4096):
        self.free = free_tokens          # free + evictable device tokens right now
        self.ratio = ratio
        self.cap = cap
        self.n = len(pairs)

    def fits(self, own: int, b: int, locked_from_free: int = 0) -> bool:
        """own: tokens the candidate allocates now (incl. page slack);
        b: its growth; locked_from_free: evictable cache tokens its prefix hit
        would lock (they stop counting as free)."""
        raise NotImplementedError

    def add(self, own: int, b: int, locked_from_free: int = 0) -> None:
        self.free -= own + locked_from_free
        self.n += 1

    # A request that does not grow in lockstep with the decoders (its prefill spans steps that
    # decodes run between) is "pinned": only peak's estimate depends on lockstep, so only peak
    # treats it differently (its whole future reserved, as guaranteed would).
    def fits_pinned(self, own: int, b: int, locked_from_free: int = 0) -> bool:
        return self.fits(own, b, locked_from_free)

    def add_pinned(self, own: int, b: int, locked_from_free: int = 0) -> None:
        self.add(own, b, locked_from_free)


class _GuaranteedState(AdmissionState):
    def __init__(self, pairs, free_tokens, ratio=0.0, cap=4096):
        super().__init__(pairs, free_tokens, ratio, cap)
        self.need = sum(o + b for o, b in pairs)        # future total
        self.held = sum(o for o, _ in pairs)

    def fits(self, own, b, locked_from_free=0):
        return self.need - self.held + own + b <= self.free - locked_from_free

    def add(self, own, b, locked_from_free=0):
        super().add(own, b, locked_from_free)
        self.need += own + b
        self.held += own


class _PeakState(AdmissionState):
    def __init__(self, pairs, free_tokens, ratio=0.0, cap=4096, pinned=()):
        super().__init__(pairs, free_tokens, ratio, cap)
        self.held = sum(o for o, _ in pairs) + sum(o for o, _ in pinned)
        self.items = sorted((-b, o) for o, b in pairs)   # by b descending: (-b, own)
        self.pinned_need = sum(o + b for o, b in pinned)
        self.n += len(pinned)

    def _peak(self, extra: Optional[tuple[int, int]]) -> int:
        items = list(self.items)
        if extra is not None:
            insort(items, (-extra[1], extra[0]))
        best = 0
        cum = 0
        for i, (nb, o) in enumerate(items, 1):
            cum += o
            v = cum - i * nb
            if v > best:
                best = v
        return best + self.pinned_need

    def fits(self, own, b, locked_from_free=0):
        return self._peak((own, b)) <= self.free - locked_from_free + self.held

    def add(self, own, b, locked_from_free=0):
        super().add(own, b, locked_from_free)
        self.held += own
        insort(self.items, (-b, own))

    def fits_pinned(self, own, b, locked_from_free=0):
        return self._peak(None) + own + b <= self.free - locked_from_free + self.held

    def add_pinned(self, own, b, locked_from_free=0):
        AdmissionState.add(self, own, b, locked_from_free)
        self.held += own
        self.pinned_need += own + b


class _OptimisticState(AdmissionState):
    def __init__(self, pairs, free_tokens, ratio=0.0, cap=4096):
        super().__init__(pairs, free_tokens, ratio, cap)
        self.reserve = ratio * sum(min(b, cap) for _, b in pairs)

    def fits(self, own, b, locked_from_free=0):
        free = self.free - locked_from_free
        if self.n == 0:
            return own <= free          # progress: an idle server admits anything that fits now
        return own + self.ratio * min(b, self.cap) <= free - self.reserve

    def add(self, own, b, locked_from_free=0):
        super().add(own, b, locked_from_free)
        self.reserve += self.ratio * min(b, self.cap)


class AdmissionMode:
    """What an admission mode implies for the rest of the scheduler."""
    name = ""
    mixes_steps = True        # decodes may ride along in a prefill step (needs mixed_steps on)
    may_preempt = False       # a decode that cannot get KV may preempt (else that is a bug)
    reserves_output = True    # a request must fit prompt + max_tokens to be accepted at all
    # p == 1 horizon shortcut: free and the reserved growth fall by the same amount per
    # decode step, so a candidate that does not fit now never fits while only decodes run
    stable_under_decode = False
    state_class: type = AdmissionState

    lockstep = False          # the estimate assumes every running request grows each decode step

    def state(self, pairs, free_tokens: int, ratio: float, cap: int, pinned=()) -> AdmissionState:
        """pinned: (own, b) of running requests that lag the decoders (lockstep modes only)."""
        if pinned:
            return self.state_class(pairs, free_tokens, ratio, cap, pinned=pinned)
        return self.state_class(pairs, free_tokens, ratio, cap)


class Guaranteed(AdmissionMode):
    name = "guaranteed"
    stable_under_decode = True
    state_class = _GuaranteedState


class Peak(AdmissionMode):
    """Never mixes: its exact estimate assumes every running request grows one token per
    step in lockstep; a request prefilling while others decode falls behind them and can
    then hold its peak after theirs, past the estimate. So a request whose (chunked) prefill
    spans steps is pinned: its own + b counted whole until it decodes with the others."""
    name = "peak"
    mixes_steps = False
    lockstep = True
    state_class = _PeakState


class Optimistic(AdmissionMode):
    name = "optimistic"
    may_preempt = True
    reserves_output = False
    state_class = _OptimisticState


ADMISSION_CLASSES = {m.name: m for m in (Guaranteed, Peak, Optimistic)}


def make_admission(name: str) -> AdmissionMode:
    return ADMISSION_CLASSES[name]()


def peak_usage(pairs: list[tuple[int, int]]) -> int:
    """LightLLM's estimate as a function (for tests and docs)."""
    items = sorted(pairs, key=lambda x: -x[1])
    best = cum = 0
    for i, (o, b) in enumerate(items, 1):
        cum += o
        best = max(best, cum + i * b)
    return best


class GrowthRatio:
    """SGLang's new_token_ratio: the share of its remaining output optimistic admission reserves
    for each running request. It decays by `delta` per decode step down to `floor`, goes back
    to `init` when the scheduler empties, and is re-estimated after a preemption."""

    def __init__(self, init: float, floor: float, decay_steps: int):
        self.init = init
        self.floor = floor
        self.delta = (init - floor) / max(1, decay_steps)
        self.base = init
        self.steps = 0          # decode steps since base was set

    def after(self, steps: int = 0) -> float:
        """The ratio after `steps` more decode steps."""
        return max(self.floor, self.base - self.delta * (self.steps + steps))

    @property
    def value(self) -> float:
        return self.after(0)

    def decay(self, steps: int = 1) -> None:
        self.steps += steps

    def reset(self, base: Optional[float] = None) -> None:
        self.base = self.init if base is None else base
        self.steps = 0


class Admission:
    """The admission mode over the KV manager: what admission sees now, or after `ahead` more
    decode-only steps (the simulator's fast path asks that)."""

    def __init__(self, mode: AdmissionMode, kv: "KVManager", ratio: GrowthRatio, reserve_cap: int):
        self.mode = mode
        self.kv = kv
        self.ratio = ratio
        self.reserve_cap = reserve_cap

    def state(self, running: list["Entry"], ahead: int = 0) -> AdmissionState:
        kv, lock = self.kv, self.mode.lockstep
        spent, pairs, pinned = 0, [], []
        for e in running:
            spent += kv.decode_pages(e, ahead) if ahead else 0
            lag = lock and e.in_prefill()     # a prefill spanning steps lags the decoders: pinned
            p = kv.lockstep_pair(e, ahead) if lock and not lag else \
                kv.pair(e, max(len(e.req.slots), e.req.num_computed + ahead))
            (pinned if lag else pairs).append(p)
        free = (kv.available_pages() - spent) * kv.page_size
        return self.mode.state(pairs, free, self.ratio.after(ahead), self.reserve_cap, pinned)
