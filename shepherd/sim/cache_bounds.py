"""Reference prefix-cache hit rates, read from the trace in one streaming pass.

    b = HitRateBounds(capacity_tokens=cluster_kv)
    for tr in trace:                        # in arrival order
        b.observe(tr, rid, at=engine_arrival)
        ...  b.finished(rid, t) when rid's answer is whole; b.settle(t) when no answer
             can still finish at or before t
    b.result() -> {"infinite": .., "lru_cluster": .., "lru_cluster_causal": .., "query_tokens": .., ...}

- infinite: every prompt served from one cache that never forgets: a request
  hits the longest prefix any earlier request had. No router or replica
  count can beat it.
- lru_cluster: one LRU cache as large as the whole cluster's KV (every
  replica's capacity together), fed every prompt in arrival order. A cluster
  of separate caches, each also holding running requests, does no better in
  practice; a router that reaches it is doing its job. A session turn's answer
  enters with its prompt, at the turn's arrival (kept as it was, for
  comparison with earlier figures): a next turn that arrives while that answer
  is still being generated hits it here, which no engine can.
- lru_cluster_causal: the same LRU cache, with the answer entering when it
  exists. A prompt is looked up and inserted at its arrival; a session turn's
  answer (with its prompt's shared pieces, touched again, as an engine caching a
  finished sequence touches its path) enters at the request's finish *in this
  run* (`finished`). That finish is router-dependent, but it is when the
  engines of this run could first have held the whole answer, and it is the
  same instant fleet_sim.py --explain uses for "previous turn still running".
  A router-independent finish is not available: neither the synthetic sessions
  nor the Mooncake traces carry a latency, and an invented one (the cost
  model's fastest possible decode) would count turns no engine of the run
  could serve. Mind the consequence: a router that delays answers lowers its
  own causal bound, so read this ratio beside load balance and TTFT. The
  engines cache a running request's decoded blocks as they go
  (KVManager.cache_decoded), which this bound does not: on a turn that arrives
  while its previous answer runs, a replica can hold more than the bound.
  A request that never finishes (refused, failed, stuck) adds no answer.
  Without a request id (observe(tr)) no answer ever enters this cache.
  It also evicts only what it must: of the least recently used piece, the
  tail that overflows (a block LRU frees a sequence's last blocks first, and
  so does the engine's radix cache, scheduler/radix_cache.py); lru_cluster
  drops the piece whole (a session's whole history), leaving room empty.

  Finishes come out of the simulator late and out of order (a replica runs
  only when a routing decision needs it), so arrivals and answers wait in a
  time-ordered queue until `settle(t)`: the caller's promise that every finish
  at or before t has been reported. Equal times put the answer first.

Prompts are seen as the pieces that bench/traces.prompt_segments makes them of
(Mooncake blocks, shared system prompt, session history, the request's own
tokens), chained so that a piece only matches after the same pieces before
it. A session's piece is kept with the turn's answer too (output - 1 tokens: the
last one is sampled, never computed), as an engine caches it and as the next
turn's prompt begins with it (the simulator's answers continue the session's
stream: bench/traces.py session_stream). Memory is one entry per distinct shared piece (infinite), at most the
pieces that fit the capacity (each LRU), and the pieces of the requests queued
or awaiting their answer (causal): never per token. A hit is capped at the
prompt minus one token, as the scheduler's lookup is. Rates are over prompt
tokens (the scheduler also counts recomputed tokens after a preemption, so
its own rate can sit a little off these).
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Callable, Optional

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


class _LRU:
    """One LRU cache of whole pieces (chain key -> cached length), `capacity` tokens."""

    def __init__(self, capacity: int, trim: bool = False):
        self.capacity = capacity
        self.trim = trim
        self._table: OrderedDict = OrderedDict()
        self._tokens = 0
        self._uniq = 0

    def match(self, pieces) -> int:
        return _match(pieces, self._table)

    def insert(self, pieces, unshared: bool = True) -> None:
        """Touch (and extend) every piece; unshared=False leaves the request's own pieces out
        (a finished answer re-touches a prompt whose own tokens already took their room)."""
        lru = self._table
        # the first piece is touched last, so that a prefix outlives the tails that hang off it
        # (a radix cache evicts leaves first)
        for key, n, shared in reversed(pieces):
            if not shared:
                if not unshared:
                    continue
                self._uniq += 1
                key = ("u", self._uniq)    # never matched again, but takes room
            old = lru.pop(key, 0)
            lru[key] = max(old, n)
            self._tokens += max(old, n) - old
        while self._tokens > self.capacity and lru:
            over = self._tokens - self.capacity
            key, n = next(iter(lru.items()))
            if self.trim and n > over:
                lru[key] = n - over      # only the oldest piece's tail goes; it keeps its place
                self._tokens -= over
            else:
                lru.popitem(last=False)
                self._tokens -= n


def _match(pieces, table) -> int:
    hit = 0
    for key, n, shared in pieces:
        have = table.get(key, 0) if shared else 0
        hit += min(n, have)
        if have < n:
            break
    return hit


_ANSWER, _ARRIVAL = 0, 1         # at equal times an answer is in before a prompt looks


class HitRateBounds:
    def __init__(self, capacity_tokens: int, block_size: int = 512,
                 on_causal_hit: Optional[Callable[[TraceRequest, int], None]] = None):
        """on_causal_hit(tr, hit tokens): told of each prompt's causal-LRU hit once it is
        settled (late, in time order)."""
        self.capacity = capacity_tokens
        self.block_size = block_size
        self.query = 0
        self.hit_inf = 0
        self.hit_lru = 0
        self.hit_causal = 0
        self._seen: dict[int, int] = {}                 # chain key -> longest length seen
        self._lru = _LRU(capacity_tokens)
        self._causal = _LRU(capacity_tokens, trim=True)
        self._queue: list = []          # (time, _ANSWER | _ARRIVAL, seq, pieces, cap, tr or None)
        self._seq = 0
        self._answers: dict = {}        # request id -> its prompt's pieces with the answer, until it finishes
        self._on_causal_hit = on_causal_hit

    def observe(self, tr: TraceRequest, rid: Optional[str] = None, at: Optional[float] = None) -> None:
        """A request arrives (at `at`, the engine's time; default tr.arrival). rid names it to
        `finished` later; without one its answer never enters the causal LRU."""
        if tr.prompt_ids is not None:
            self.query += tr.prompt_tokens     # explicit ids: treated as unshared
            return
        pieces = chained(tr, self.block_size)
        cap = max(0, tr.prompt_tokens - 1)
        self.query += tr.prompt_tokens
        self.hit_inf += min(cap, _match(pieces, self._seen))
        self.hit_lru += min(cap, self._lru.match(pieces))
        self._push(tr.arrival if at is None else at, _ARRIVAL, list(pieces), cap, tr)
        if tr.session and pieces and pieces[-1][2]:      # the session piece ends the prompt: the answer joins it
            key, n, shared = pieces[-1]
            pieces[-1] = (key, n + max(0, tr.output_tokens - 1), shared)
            if rid is not None:
                self._answers[rid] = pieces
        for key, n, shared in pieces:
            if shared and self._seen.get(key, 0) < n:
                self._seen[key] = n
        self._lru.insert(pieces)

    def finished(self, rid: str, t: float) -> None:
        """rid's answer is whole in its engine's cache at t (a request that never finishes,
        or fails: `forget` it)."""
        pieces = self._answers.pop(rid, None)
        if pieces is not None:
            self._push(t, _ANSWER, pieces, 0, None)

    def forget(self, rid: str) -> None:
        self._answers.pop(rid, None)

    def settle(self, t: float) -> None:
        """Every finish at or before t has been reported: play the causal LRU up to t."""
        q = self._queue
        while q and q[0][0] <= t:
            _, kind, _, pieces, cap, tr = heapq.heappop(q)
            if kind == _ARRIVAL:
                hit = min(cap, self._causal.match(pieces))
                self.hit_causal += hit
                if self._on_causal_hit is not None:
                    self._on_causal_hit(tr, hit)
                self._causal.insert(pieces)
            else:
                self._causal.insert(pieces, unshared=False)

    def _push(self, t: float, kind: int, pieces, cap: int, tr: Optional[TraceRequest]) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (t, kind, self._seq, pieces, cap, tr))

    def result(self) -> dict:
        """The rates, once every queued arrival is played (answers not reported never enter)."""
        self.settle(math.inf)
        self._answers.clear()
        q = self.query

        def rate(h) -> Optional[float]:
            return h / q if q else None
        return {"infinite": rate(self.hit_inf), "lru_cluster": rate(self.hit_lru),
                "lru_cluster_causal": rate(self.hit_causal), "query_tokens": q,
                "infinite_hit_tokens": self.hit_inf, "lru_cluster_hit_tokens": self.hit_lru,
                "lru_cluster_causal_hit_tokens": self.hit_causal, "lru_capacity_tokens": self.capacity}


__all__ = ["HitRateBounds", "chained"]
