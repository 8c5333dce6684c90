"""Reference prefix-cache hit rates, read from the trace in one streaming pass.

    b = HitRateBounds(capacity_tokens=cluster_kv)
    for tr in trace: b.observe(tr)          # in arrival order
    b.result() -> {"infinite": .., "lru_cluster": .., "query_tokens": .., ...}

- infinite: every prompt served from one cache that never forgets: a request
  hits the longest prefix any earlier request had. No router or replica
  count can beat it.
- lru_cluster: one LRU cache as large as the whole cluster's KV (every
  replica's capacity together), fed every prompt in arrival order. A cluster
  of separate caches, each also holding running requests, does no better in
  practice; a router that reaches it is doing its job.

Prompts are seen as the pieces that bench/traces.prompt_segments makes them of
(Mooncake blocks, shared system prompt, session history, the request's own
tokens), chained so that a piece only matches after the same pieces before
it. A session's piece is kept with the turn's answer too (output - 1 tokens: the
last one is sampled, never computed), as an engine caches it and as the next
turn's prompt begins with it (the simulator's answers continue the session's
stream: bench/traces.py session_stream). Memory is one entry per distinct shared piece (infinite) and at most the
pieces that fit the capacity (LRU): never per token. A hit is capped at the
prompt minus one token, as the scheduler's lookup is. Rates are over prompt
tokens (the scheduler also counts recomputed tokens after a preemption, so
its own rate can sit a little off these).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from shepherd.bench.records import TraceRequest
from shepherd.bench.traces import prompt_segments


def chained(tr: TraceRequest, block_size: int) -> list[tuple[object, int, bool]]:
    """(chain key, length, shareable) per piece; the key names the piece and all before it."""
    out = []
    prev: object = None
    for key, _start, n in prompt_segments(tr, block_size):
        prev = (prev, key)
        out.append((hash(prev), n, not key.startswith("req/")))
    return out


class HitRateBounds:
    def __init__(self, capacity_tokens: int, block_size: int = 512):
        self.capacity = capacity_tokens
        self.block_size = block_size
        self.query = 0
        self.hit_inf = 0
        self.hit_lru = 0
        self._seen: dict[int, int] = {}                 # chain key -> longest length seen
        self._lru: OrderedDict[int, int] = OrderedDict()  # chain key -> cached length
        self._lru_tokens = 0
        self._uniq = 0

    def observe(self, tr: TraceRequest) -> None:
        if tr.prompt_ids is not None:
            self.query += tr.prompt_tokens     # explicit ids: treated as unshared
            return
        pieces = chained(tr, self.block_size)
        cap = max(0, tr.prompt_tokens - 1)
        self.query += tr.prompt_tokens
        self.hit_inf += min(cap, self._match(pieces, self._seen))
        self.hit_lru += min(cap, self._match(pieces, self._lru))
        if tr.session and pieces and pieces[-1][2]:      # the session piece ends the prompt: the answer joins it
            key, n, shared = pieces[-1]
            pieces[-1] = (key, n + max(0, tr.output_tokens - 1), shared)
        for key, n, shared in pieces:
            if shared and self._seen.get(key, 0) < n:
                self._seen[key] = n
        self._insert_lru(pieces)

    @staticmethod
    def _match(pieces, table) -> int:
        hit = 0
        for key, n, shared in pieces:
            have = table.get(key, 0) if shared else 0
            hit += min(n, have)
            if have < n:
                break
        return hit

    def _insert_lru(self, pieces) -> None:
        lru = self._lru
        # the first piece is touched last, so that a prefix outlives the tails that hang off it
        # (a radix cache evicts leaves first)
        for key, n, shared in reversed(pieces):
            if not shared:
                self._uniq += 1
                key = ("u", self._uniq)    # never matched again, but takes room
            old = lru.pop(key, 0)
            lru[key] = max(old, n)
            self._lru_tokens += max(old, n) - old
        while self._lru_tokens > self.capacity and lru:
            _, n = lru.popitem(last=False)
            self._lru_tokens -= n

    def result(self) -> dict:
        q = self.query

        def rate(h) -> Optional[float]:
            return h / q if q else None
        return {"infinite": rate(self.hit_inf), "lru_cluster": rate(self.hit_lru), "query_tokens": q,
                "infinite_hit_tokens": self.hit_inf, "lru_cluster_hit_tokens": self.hit_lru,
                "lru_capacity_tokens": self.capacity}


__all__ = ["HitRateBounds", "chained"]
