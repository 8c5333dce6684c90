"""The radix cache's records (scheduler/cache_events.py) -> vLLM KV events.

Blocks are BLOCK_SIZE (16) tokens at absolute positions 0, 16, 32, ... of a
cached sequence, whatever the cache's page size: the radix tree holds runs of
tokens of any length (page_size 1 by default), the events speak of full
16-token blocks. A block belongs to the tree node that holds its last token:
it is cached exactly while that node is (a node's ancestors always are).

- node added: BlockStored for the blocks that end in it, chained from the last
  block that ends at or before its start (the parent block hash; None at
  position 0); the first block's leading tokens come from the ancestors;
- node split: nothing changes in the cache, the blocks are shared out between
  the two halves by where they end;
- node evicted (always a leaf): BlockRemoved for its blocks. A leaf that holds
  the end of a block whose start lies in its parent (a "partial node") removes
  that block too: the block is no longer whole in the cache;
- cache cleared (a reset): AllBlocksCleared; the nodes the reset kept (in use by
  running requests) come next as nodes added, and are announced again.

A node whose parent the tracker does not know (records lost after `forget`)
is left out, with everything under it: it is never announced, so it can never
be announced wrongly. The tracker keeps, per node, its span, the token list
the cache gave it (shared, not copied) and its blocks' hashes.
"""
from __future__ import annotations

from typing import Callable, Optional

from shepherd.kv_events.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from shepherd.kv_events.hashing import BLOCK_SIZE, block_hash
from shepherd.scheduler.cache_events import CacheCleared, NodeAdded, NodeEvicted, NodeSplit


class _Node:
    __slots__ = ("parent", "start", "end", "tokens", "off", "hashes")

    def __init__(self, parent: int, start: int, end: int, tokens: list, off: int, hashes: list):
        self.parent = parent
        self.start = start
        self.end = end
        self.tokens = tokens        # this node's tokens are tokens[off:off + end - start]
        self.off = off
        self.hashes = hashes        # blocks whose last token is in (start, end], in order


class BlockTracker:
    def __init__(self, block_size: int = BLOCK_SIZE, medium: Optional[str] = MEDIUM_GPU,
                 hasher: Callable[[Optional[int], list], int] = block_hash):
        self.block_size = block_size
        self.medium = medium
        self.hasher = hasher
        self._nodes: dict[int, _Node] = {}

    @property
    def num_blocks(self) -> int:
        return sum(len(n.hashes) for n in self._nodes.values())

    def apply(self, records: list) -> list:
        """The events these records amount to, in order."""
        out: list = []
        for rec in records:
            if isinstance(rec, NodeAdded):
                ev = self._added(rec)
            elif isinstance(rec, NodeSplit):
                ev = self._split(rec)
            elif isinstance(rec, NodeEvicted):
                ev = self._evicted(rec)
            elif isinstance(rec, CacheCleared):
                ev = self.clear()
            else:
                raise TypeError(f"unknown cache record {rec!r}")
            if ev is not None:
                out.append(ev)
        return out

    def clear(self) -> AllBlocksCleared:
        """The cache is empty (a new cache, or a reset)."""
        self._nodes.clear()
        return AllBlocksCleared()

    def forget(self) -> AllBlocksCleared:
        """Stop vouching for anything cached so far (records were lost): consumers drop what they
        have; nodes added later under the forgotten ones stay unannounced."""
        return self.clear()

    # ------------------------------------------------------------------ records
    def _added(self, rec: NodeAdded) -> Optional[BlockStored]:
        parent = self._nodes.get(rec.parent) if rec.parent else None
        if rec.parent and parent is None:
            return None                        # under a node we do not know: stays dark
        start = parent.end if parent is not None else 0
        bs = self.block_size
        lead = self._tail(parent, start % bs)
        seq = lead + rec.tokens if lead else rec.tokens
        nb = len(seq) // bs
        prev = self._last_hash(parent)
        hashes = []
        h = prev
        for i in range(nb):
            h = self.hasher(h, seq[i * bs:(i + 1) * bs])
            hashes.append(h)
        self._nodes[rec.node] = _Node(rec.parent, start, start + len(rec.tokens), rec.tokens, 0, hashes)
        if not hashes:
            return None
        return BlockStored(block_hashes=hashes, parent_block_hash=prev, token_ids=list(seq[:nb * bs]),
                           block_size=bs, lora_id=None, medium=self.medium, lora_name=None)

    def _split(self, rec: NodeSplit) -> None:
        n = self._nodes.get(rec.node)
        if n is None:
            return None
        cut = n.start + rec.at
        bs = self.block_size
        first_end = (n.start // bs + 1) * bs
        k = (cut - first_end) // bs + 1 if cut >= first_end else 0
        self._nodes[rec.upper] = _Node(n.parent, n.start, cut, n.tokens, n.off, n.hashes[:k])
        n.parent = rec.upper
        n.start = cut
        n.off += rec.at
        n.hashes = n.hashes[k:]
        return None

    def _evicted(self, rec: NodeEvicted) -> Optional[BlockRemoved]:
        n = self._nodes.pop(rec.node, None)
        if n is None or not n.hashes:
            return None
        return BlockRemoved(block_hashes=list(n.hashes), medium=self.medium)

    # ------------------------------------------------------------------ walks up
    def _tail(self, node: Optional[_Node], need: int) -> list:
        """The last `need` tokens of the sequence that ends at node (fewer than a block)."""
        parts = []
        while need > 0 and node is not None:
            length = node.end - node.start
            take = min(need, length)
            end = node.off + length
            parts.append(node.tokens[end - take:end])
            need -= take
            node = self._nodes.get(node.parent) if node.parent else None
        out: list = []
        for p in reversed(parts):
            out.extend(p)
        return out

    def _last_hash(self, node: Optional[_Node]) -> Optional[int]:
        while node is not None:
            if node.hashes:
                return node.hashes[-1]
            node = self._nodes.get(node.parent) if node.parent else None
        return None


__all__ = ["BlockTracker"]
