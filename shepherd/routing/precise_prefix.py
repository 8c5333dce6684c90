"""Precise prefix routing: what each replica has cached, read from its KV events.

The approximate policies (prefix-aware, cache-aware) guess a replica's cache
from their own routing history and never see an eviction. This one reads a
KVBlockIndex (shepherd/kv_events/index.py) fed with the replicas' own events:
by the gateway's subscribers (`shepherd gateway --kv-events`), the endpoint
picker's, or the simulator, which knows every replica's cache exactly. The
owner finds the index as `policy.kv_index`.

The request's keys are shepherd's block hashes (16-token blocks, chained) of
its token ids (`RouteRequest.token_ids`; without them every replica scores 0).
A replica's match is the number of leading keys it holds, counting the
prompts of the requests this policy has in flight on it (dispatched, not yet
finished): their KV is being computed there, so a request sharing their prefix
that arrives meanwhile finds it there, as Dynamo's router assumes too.
"""
from __future__ import annotations

from collections import Counter
from typing import Hashable, Optional, Sequence

from shepherd.kv_events.hashing import chain_hashes
from shepherd.kv_events.index import KVBlockIndex
from shepherd.routing.base import ReplicaState, RouteRequest, RoutingPolicy
from shepherd.routing.scorers import Scorer


class PrecisePrefixScorer(Scorer):
    """llm-d's precise prefix-cache scorer: the fraction of the prompt's blocks that the
    replica holds as a leading run, from the index plus the in-flight prompts."""
    name = "precise"

    def __init__(self, index: Optional[KVBlockIndex] = None) -> None:
        self.index = index if index is not None else KVBlockIndex()
        self._inflight: dict[Hashable, Counter] = {}     # replica key -> keys of requests in flight there
        self._dispatched: dict[int, tuple] = {}          # id(request) -> (replica key, keys)
        self._memo: tuple = (None, [])

    def keys(self, request: RouteRequest) -> list[int]:
        ids = request.token_ids
        if not ids:
            return []
        if self._memo[0] is not ids:          # a retry asks again for the same request
            self._memo = (ids, chain_hashes(ids))
        return self._memo[1]

    def matched(self, request: RouteRequest, cands: Sequence[ReplicaState]) -> dict:
        """{replica key: leading blocks held} (only replicas with at least one)."""
        keys = self.keys(request)
        if not keys:
            return {}
        return self.index.match(keys, [r.key for r in cands], extra=self._inflight)

    def score(self, request, cands):
        n = len(self.keys(request))
        m = self.matched(request, cands)
        return {r.key: (m.get(r.key, 0) / n if n else 0.0) for r in cands}

    def on_dispatch(self, request: RouteRequest, replica: ReplicaState) -> None:
        keys = self.keys(request)
        if keys:
            self._inflight.setdefault(replica.key, Counter()).update(keys)
            self._dispatched[id(request)] = (replica.key, keys)

    def on_finish(self, request: RouteRequest, replica: ReplicaState) -> None:
        got = self._dispatched.pop(id(request), None)
        if got is None:
            return
        key, keys = got
        c = self._inflight.get(key)
        if c is not None:
            c.subtract(keys)
            for k in keys:
                if c[k] <= 0:
                    del c[k]
            if not c:
                del self._inflight[key]

    def forget(self, key: Hashable) -> None:
        self.index.remove(key)
        self._inflight.pop(key, None)


class PrecisePrefixPolicy(RoutingPolicy):
    """The replica where the request adds the least work to the cluster's caches.

    cost(r) = blocks of the prompt r does not hold (from its KV events and the prompts in
              flight there)  +  pressure_weight x (pressure(r) - the lowest pressure), in blocks

    pressure(r) counts the tokens this policy has sent r to compute and cache (uncached
    prompt tokens at dispatch, output tokens at finish), decayed by 1 - 1/pressure_window
    at every decision. An LRU cache keeps a block for about its capacity over the rate
    new tokens enter it, so sending new prefixes where fewer tokens have been entering
    keeps the replicas' caches about as long-lived as one cluster-wide LRU cache would
    be. With a weight below 1 a request still goes where its prefix is cached, even to
    the replica that has just computed that prefix (its pressure grew by exactly that
    much), unless that replica has taken 1/weight times the prefix more than the
    emptiest. The minimum cost wins ("hit" when the chosen replica holds a block of the
    prompt, else "miss"); among equal costs the lower pressure, then the least loaded,
    round robin. First, a load
    gap over both thresholds (max - min > balance_abs_threshold and max > min x
    balance_rel_threshold) sends the request to the least loaded replica ("imbalance"),
    as SGLang's cache-aware router does.

    Knobs: pressure_weight (0.01; 0: pressure only breaks ties between equal matches),
    pressure_window (256 decisions), balance_abs_threshold (32), balance_rel_threshold
    (1.5). docs/ROUTING.md has the simulated comparison behind the defaults."""
    name = "precise-prefix"

    def __init__(self, pressure_weight: float = 0.01, pressure_window: int = 256,
                 balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.5) -> None:
        super().__init__()
        if pressure_window < 1:
            raise ValueError("pressure_window must be >= 1")
        self.pressure_weight = pressure_weight
        self.pressure_window = pressure_window
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.scorer = PrecisePrefixScorer()
        self.kv_index = self.scorer.index
        self.pressure: dict[Hashable, float] = {}
        self.last_match = 0.0

    def _choose(self, request, cands):
        loads = [r.load for r in cands]
        lo, hi = min(loads), max(loads)
        self.last_match = 0.0
        length = len(request.token_ids or ())
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            self.last_reason = "imbalance"
            chosen = self._least_loaded(cands)
            held = 0
        else:
            bs = self.kv_index.block_size
            n = len(self.scorer.keys(request))
            m = self.scorer.matched(request, cands)
            p = self.pressure
            floor = min(p.get(r.key, 0.0) for r in cands)
            w = self.pressure_weight
            cost = {r.key: n - m.get(r.key, 0) + int(w * (p.get(r.key, 0.0) - floor) / bs) for r in cands}
            chosen = self._pick_min(cands, lambda r: (cost[r.key], int((p.get(r.key, 0.0) - floor) // bs), r.load))
            held = bs * m.get(chosen.key, 0)
            self.last_reason = "hit" if held else "miss"
            self.last_match = held / length if length else 0.0
        self._add_pressure(chosen.key, length - held)
        return chosen

    def _add_pressure(self, key: Hashable, tokens: float) -> None:
        keep = 1.0 - 1.0 / self.pressure_window
        p = self.pressure
        for k in p:
            p[k] *= keep
        p[key] = p.get(key, 0.0) + tokens

    def on_dispatch(self, request, replica):
        self.scorer.on_dispatch(request, replica)

    def on_finish(self, request, replica, output_tokens):
        self.scorer.on_finish(request, replica)
        if output_tokens:
            self.pressure[replica.key] = self.pressure.get(replica.key, 0.0) + output_tokens

    def forget(self, key):
        self.scorer.forget(key)
        self.pressure.pop(key, None)


__all__ = ["PrecisePrefixPolicy", "PrecisePrefixScorer"]
