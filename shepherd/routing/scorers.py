"""llm-d's plugin pieces: filters drop replicas, scorers grade the rest in
[0, 1] (higher is better), a picker takes the best. The weighted policy
composes them; prefix-aware reuses the prefix scorer's hashing and index.

Each scorer: score(request, cands) -> {replica key: score}; after the pick the
policy calls on_pick(request, chosen) (the prefix scorer records the prompt
there), on_dispatch / on_finish as the owner reports the request's life (the
precise scorer counts in-flight prompts), and forget(key) when a replica leaves
for good.
"""
from __future__ import annotations

from typing import Hashable, Sequence

from shepherd.routing.base import ReplicaState, RouteRequest
from shepherd.routing.prefix_index import (BlockPrefixIndex, block_hashes, check_tokenizer_type,
                                           default_block_size)


def inverse_minmax(values: dict) -> dict:
    """Lower is better -> score in [0, 1]: (max - v) / (max - min); all 1 when equal."""
    lo, hi = min(values.values()), max(values.values())
    if hi == lo:
        return {k: 1.0 for k in values}
    return {k: (hi - v) / (hi - lo) for k, v in values.items()}


def saturation_filter(cands: Sequence[ReplicaState], kv_filter: float, queue_filter: int) -> list[ReplicaState]:
    """Drop replicas with kv_usage >= kv_filter or waiting >= queue_filter (0 = off),
    unless that drops them all."""
    out = [r for r in cands if r.kv_usage < kv_filter and (queue_filter <= 0 or r.waiting < queue_filter)]
    return out or list(cands)


class Scorer:
    name = ""

    def score(self, request: RouteRequest, cands: Sequence[ReplicaState]) -> dict:
        raise NotImplementedError

    def on_pick(self, request: RouteRequest, chosen: ReplicaState) -> None:
        """The policy picked `chosen` for `request`."""

    def on_dispatch(self, request: RouteRequest, replica: ReplicaState) -> None:
        """The owner sent `request` to `replica`."""

    def on_finish(self, request: RouteRequest, replica: ReplicaState) -> None:
        """The request ended on `replica` (any way)."""

    def forget(self, key: Hashable) -> None:
        """A replica was removed for good."""


class PrefixScorer(Scorer):
    """Fraction of the prompt's chained blocks last routed to the replica."""
    name = "prefix"

    def __init__(self, tokenizer_type: str = "character", block_size: int = 0, block_number: int = 200_000):
        self.tokenizer_type = check_tokenizer_type(tokenizer_type)
        self.block_size = default_block_size(tokenizer_type, block_size)
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.index = BlockPrefixIndex(block_number)
        self._hashes: list[int] = []

    def hashes(self, request: RouteRequest) -> list[int]:
        self._hashes = block_hashes(request, self.tokenizer_type, self.block_size)
        return self._hashes

    def matched(self, hashes: Sequence[int], cands: Sequence[ReplicaState]) -> dict:
        """Leading blocks each replica holds (only replicas with at least one)."""
        return self.index.match(hashes, [r.key for r in cands]) if hashes else {}

    def score(self, request, cands):
        hashes = self.hashes(request)
        matched = self.matched(hashes, cands)
        return {r.key: (matched.get(r.key, 0) / len(hashes) if hashes else 0.0) for r in cands}

    def on_pick(self, request, chosen):
        if self._hashes:
            self.index.record(self._hashes, chosen.key, request.now)

    def forget(self, key):
        self.index.forget(key)


class QueueScorer(Scorer):
    """(max waiting - waiting) / (max - min) over the candidates."""
    name = "queue"

    def score(self, request, cands):
        return inverse_minmax({r.key: r.waiting for r in cands})


class KVScorer(Scorer):
    """1 - kv_usage."""
    name = "kv"

    def score(self, request, cands):
        return {r.key: 1.0 - min(max(r.kv_usage, 0.0), 1.0) for r in cands}


class LoadScorer(Scorer):
    """(max load - load) / (max - min) over the candidates."""
    name = "load"

    def score(self, request, cands):
        return inverse_minmax({r.key: r.load for r in cands})
