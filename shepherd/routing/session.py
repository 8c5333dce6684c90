"""Session affinity: rendezvous (highest random weight) hashing."""
from __future__ import annotations

from typing import Optional

from shepherd.routing.base import RouteRequest, RoutingPolicy, stable_hash
from shepherd.routing.load import LeastRequestPolicy


class SessionAffinityPolicy(RoutingPolicy):
    """Requests of one session go to one replica: the replica with the
    highest H(session, replica key) among the healthy ones (rendezvous
    hashing): removing a replica moves only the sessions that were on it,
    adding one moves only ~1/n of them. The session comes from the header
    `header` (default x-session-id), else RouteRequest.session, else the
    user. Without any, or when the chosen replica's load exceeds the least
    loaded by more than `max_imbalance` (0 = never spill), the `fallback`
    policy decides.

    Knobs: header, fallback (a policy name: registry.make_policy builds it; default
    least-request), max_imbalance, use_user."""
    name = "session-affinity"

    def __init__(self, header: str = "x-session-id", fallback: Optional[RoutingPolicy] = None,
                 max_imbalance: int = 0, use_user: bool = True) -> None:
        super().__init__()
        self.header = header.lower()
        self.max_imbalance = max_imbalance
        self.use_user = use_user
        self.fallback = fallback if fallback is not None else LeastRequestPolicy()

    def session_of(self, request: RouteRequest) -> Optional[str]:
        s = request.headers.get(self.header) if request.headers else None
        if not s:
            s = request.session
        if not s and self.use_user:
            s = request.user
        return s or None

    def _choose(self, request, cands):
        s = self.session_of(request)
        if s is None:
            r = self.fallback.choose(request, cands)
            self.last_reason = "no-session"
            return r
        best = max(cands, key=lambda r: (stable_hash(s, r.key), str(r.key)))
        if self.max_imbalance > 0 and best.load - min(r.load for r in cands) > self.max_imbalance:
            self.last_reason = "spill"
            return self.fallback.choose(request, cands)
        self.last_reason = "affinity"
        return best

    def on_dispatch(self, request, replica):
        self.fallback.on_dispatch(request, replica)

    def on_finish(self, request, replica, output_tokens):
        self.fallback.on_finish(request, replica, output_tokens)

    def forget(self, key):
        self.fallback.forget(key)
