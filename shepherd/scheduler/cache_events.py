"""What the prefix cache did, as plain records, for whoever publishes it.

When a CacheEventLog is attached (`Scheduler.record_cache_events()`), the
radix cache appends one record per change to what it holds: a node added, a
node cut in two, a node evicted, the whole cache reset. Nothing else happens on the scheduler's side:
no hashing, no encoding, no I/O. The engine core drains the log once per step
and hands the records to the KV-event publisher (shepherd/kv_events), which
turns them into vLLM's BlockStored / BlockRemoved events on its own thread.

Node ids are the radix cache's own (never reused); the root is 0.
"""
from __future__ import annotations

from dataclasses import dataclass

# A running request's decoded tokens go into the prefix cache each time its computed length
# crosses a whole block of this many tokens (KVManager.cache_decoded): the KV events' block
# (shepherd/kv_events/hashing.py BLOCK_SIZE, checked equal by tests), so every insert announces
# at least one new block and a page size of 1 does not insert token by token.
DECODE_CACHE_BLOCK = 16


@dataclass(slots=True)
class NodeAdded:
    node: int
    parent: int              # 0: the root
    tokens: list[int]        # the node's key; the cache never changes a key list in place


@dataclass(slots=True)
class NodeSplit:
    node: int                # the node that was cut: it keeps its tokens from `at` on
    upper: int               # the new node holding its first `at` tokens (the node's new parent)
    at: int


@dataclass(slots=True)
class NodeEvicted:
    node: int                # a leaf; its tokens are no longer cached


@dataclass(slots=True)
class CacheCleared:
    """The cache was reset (RadixCache.reset): forget every node; the nodes that stayed (in use by
    running requests) follow as NodeAdded records, parents first."""


class CacheEventLog:
    """Records in the order they happened, until drained."""

    def __init__(self) -> None:
        self.records: list = []

    def drain(self) -> list:
        out, self.records = self.records, []
        return out


__all__ = ["DECODE_CACHE_BLOCK", "CacheCleared", "CacheEventLog", "NodeAdded", "NodeEvicted", "NodeSplit"]
