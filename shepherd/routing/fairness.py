"""AIBrix `vtc-basic`: route by the user's token count for fairness."""
from __future__ import annotations

from collections import deque
from typing import Optional

from shepherd.routing.base import RoutingPolicy


class VTCBasicPolicy(RoutingPolicy):
    """AIBrix `vtc-basic`: fairness score from the user's weighted token count
    in a sliding window, utilization score from the replica's load; the
    lowest weighted sum wins.

    user_tokens = sum over the window of input_token_weight * input tokens
    (charged at dispatch) + output_token_weight * output tokens (charged at
    finish). It is normalised to [0, 1] between the smallest and largest
    counts of the users in the window, widened to at least
    [min_tokens, max_tokens] (AIBrix's adaptive bounds), and mapped to a
    target replica position t = norm * (n - 1): light users go to the low
    positions, heavy users to the high ones, so a heavy user's load piles up
    on its own replicas. fairness = |i - t| / (n - 1); utilization =
    min(load / max_pod_load, 1); score = fairness_weight * fairness +
    utilization_weight * utilization. Ties: fewer requests, then round robin.
    Requests without a user go to the least loaded replica (AIBrix: random).
    While only one user has tokens in the window the fairness term is left
    out (nothing to be fair between; it would pin that user's every request
    to the top replica), so a single-tenant trace is routed on load.

    Knobs: window_size (s), min_tokens, max_tokens, input_token_weight,
    output_token_weight, max_pod_load, fairness_weight, utilization_weight.
    """
    name = "vtc-basic"

    def __init__(self, window_size: float = 300.0, min_tokens: float = 1000.0,
                 max_tokens: float = 8000.0, input_token_weight: float = 1.0,
                 output_token_weight: float = 2.0, max_pod_load: float = 100.0,
                 fairness_weight: float = 1.0, utilization_weight: float = 1.0) -> None:
        super().__init__()
        self.window_size = window_size
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self.input_token_weight = input_token_weight
        self.output_token_weight = output_token_weight
        self.max_pod_load = max_pod_load
        self.fairness_weight = fairness_weight
        self.utilization_weight = utilization_weight
        self._events: dict = {}        # user -> deque[(time, tokens)]
        self._totals: dict = {}
        self._now = 0.0

    def _expire(self, now: float) -> None:
        self._now = max(self._now, now)
        cutoff = self._now - self.window_size
        for user in list(self._events):
            ev = self._events[user]
            while ev and ev[0][0] < cutoff:
                _, tok = ev.popleft()
                self._totals[user] -= tok
            if not ev:
                del self._events[user]
                del self._totals[user]

    def _charge(self, user: str, tokens: float, now: float) -> None:
        if tokens <= 0:
            return
        self._events.setdefault(user, deque()).append((now, tokens))
        self._totals[user] = self._totals.get(user, 0.0) + tokens

    def token_count(self, user: str, now: Optional[float] = None) -> float:
        if now is not None:
            self._expire(now)
        return self._totals.get(user, 0.0)

    def _choose(self, request, cands):
        self._expire(request.now)
        if not request.user:
            self.last_reason = "no-user"
            return self._least_loaded(cands)
        u = self._totals.get(request.user, 0.0)
        counts = list(self._totals.values()) or [0.0]
        lo = min(min(counts), self.min_tokens)
        hi = max(max(counts), self.max_tokens)
        norm = min(max((u - lo) / (hi - lo), 0.0), 1.0) if hi > lo else 0.0
        n = len(cands)
        target = norm * (n - 1)
        # one user in the window: nothing to be fair between, and the clamped target would
        # send every request to one replica; route on utilization alone
        spread = n > 1 and len(self._totals) > 1
        ordered = sorted(cands, key=lambda r: r.index)
        scores = {}
        for pos, r in enumerate(ordered):
            fairness = abs(pos - target) / (n - 1) if spread else 0.0
            util = min(r.load / self.max_pod_load, 1.0) if self.max_pod_load > 0 else 0.0
            scores[r.key] = round(self.fairness_weight * fairness + self.utilization_weight * util, 9)
        self.last_reason = "vtc"
        return self._pick_min(ordered, lambda r: (scores[r.key], r.load))

    def on_dispatch(self, request, replica):
        if request.user:
            self._charge(request.user, self.input_token_weight * request.input_tokens, request.now)

    def on_finish(self, request, replica, output_tokens):
        if request.user:
            self._charge(request.user, self.output_token_weight * output_tokens,
                         max(request.now, self._now))
