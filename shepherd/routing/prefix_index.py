"""Prefix hashing (AIBrix): chained block hashes of a prompt and the LRU index
of which replica each block was last routed to."""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Hashable, Sequence

from shepherd.routing.base import RouteRequest

TOKENIZER_TYPES = ("character", "tokens")


def check_tokenizer_type(tokenizer_type: str) -> str:
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"tokenizer_type must be one of {TOKENIZER_TYPES}, got {tokenizer_type!r}")
    return tokenizer_type


def default_block_size(tokenizer_type: str, block_size: int) -> int:
    """128 characters, or 16 token ids (the AIBrix README's tiktoken value), unless given."""
    return int(block_size) or (128 if tokenizer_type == "character" else 16)


def block_hashes(request: RouteRequest, tokenizer_type: str, block_size: int) -> list[int]:
    """Chain-hashed full blocks of the prompt: h_i = H(h_{i-1}, block_i), so
    equal hashes mean equal prefixes. A partial last block is not hashed.
    Precomputed `hash_ids` (Mooncake traces: already prefix-chained) win;
    `tokens` uses token ids when the request has them, else characters."""
    if request.hash_ids is not None:
        return list(request.hash_ids)
    if tokenizer_type == "tokens" and request.token_ids:
        ids = request.token_ids
        out: list[int] = []
        prev = 0
        for i in range(0, len(ids) - block_size + 1, block_size):
            prev = hash((prev, *ids[i:i + block_size]))    # int tuples hash the same in every process
            out.append(prev)
        return out
    text = request.text
    out = []
    prev_b = b""
    for i in range(0, len(text) - block_size + 1, block_size):
        h = hashlib.blake2b(prev_b + text[i:i + block_size].encode("utf-8", "surrogatepass"),
                            digest_size=8).digest()
        prev_b = h
        out.append(int.from_bytes(h, "little"))
    return out


class BlockPrefixIndex:
    """LRU map block hash -> {replica key: last time it was routed there}.
    At most `capacity` block hashes; the least recently used go first."""

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._map: "OrderedDict[int, dict]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, h: int) -> bool:
        return h in self._map

    def match(self, hashes: Sequence[int], keys: Sequence[Hashable]) -> dict:
        """Number of leading blocks of `hashes` each replica key holds (only
        keys with at least one block appear)."""
        alive = set(keys)
        matched: dict = {}
        for i, h in enumerate(hashes):
            holders = self._map.get(h)
            if not holders:
                break
            alive = {k for k in alive if k in holders}
            if not alive:
                break
            for k in alive:
                matched[k] = i + 1
        return matched

    def record(self, hashes: Sequence[int], key: Hashable, now: float) -> None:
        m = self._map
        for h in hashes:
            holders = m.get(h)
            if holders is None:
                m[h] = {key: now}
            else:
                holders[key] = now
                m.move_to_end(h)
        while len(m) > self.capacity:
            m.popitem(last=False)

    def forget(self, key: Hashable) -> None:
        for h in [h for h, holders in self._map.items() if key in holders]:
            holders = self._map[h]
            del holders[key]
            if not holders:
                del self._map[h]
