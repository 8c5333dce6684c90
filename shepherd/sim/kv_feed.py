"""The simulator's KV events: every replica's prefix cache, exactly, into the router's index.

A policy that reads KV events (precise-prefix, weighted with a precise weight)
exposes a KVBlockIndex as `policy.kv_index`. Here each replica's scheduler
records its cache's changes (the same records the engine core publishes), and
before each routing decision the records so far go through the same tracker the
engine's publisher runs, into the index: what a gateway would know with no
network between it and the replicas, and no delay.
"""
from __future__ import annotations

from shepherd.kv_events.index import KVBlockIndex
from shepherd.kv_events.tracker import BlockTracker


class SimKVFeed:
    def __init__(self, index: KVBlockIndex, replicas: list):
        self.index = index
        self._feeds = [(rep.idx, rep.sched.kv.record_cache_events(), BlockTracker()) for rep in replicas]

    def sync(self) -> None:
        """Apply every replica's cache changes since the last call."""
        for key, log, tracker in self._feeds:
            if log is not None and log.records:
                self.index.apply(key, tracker.apply(log.drain()))


__all__ = ["SimKVFeed"]
