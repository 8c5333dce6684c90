"""shepherd's block hash: the one definition every replica, the gateway and the simulator share.

A prompt is cut into blocks of BLOCK_SIZE (16) tokens at absolute positions
0, 16, 32, ...; a partial last block has no hash. Block i's hash is

    h_i = low 64 bits of SHA-256( h_{i-1} as uint64  ||  its token ids as uint32 )    (little-endian)

with h_{-1} = 0, where "low 64 bits" reads the digest's last 8 bytes as a
big-endian unsigned integer (the way vLLM turns its SHA-256 block hashes into
the ints of its events). Equal hashes therefore mean equal token prefixes, on
every replica and across restarts (no per-process seed, unlike Python's
`hash`). Token ids are at most 2**32 - 1 (every tokenizer shepherd loads).

Replicas publish these as their engine block hashes; the gateway's index keys
its own blocks with the same function over the events' token ids, so it never
depends on another engine's hash algorithm.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Optional, Sequence

BLOCK_SIZE = 16
_FULL = struct.Struct(f"<Q{BLOCK_SIZE}I")     # one full block: parent then tokens
_MASK = (1 << 64) - 1


def block_hash(parent: Optional[int], tokens: Sequence[int]) -> int:
    """The hash of one block given the previous block's hash (None: the first block)."""
    p = (parent or 0) & _MASK
    if len(tokens) == BLOCK_SIZE:
        data = _FULL.pack(p, *tokens)
    else:
        data = struct.pack(f"<Q{len(tokens)}I", p, *tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[24:], "big")


def chain_hashes(tokens: Sequence[int], parent: Optional[int] = None, block_size: int = BLOCK_SIZE) -> list[int]:
    """Hashes of the full blocks of `tokens` (the partial tail is left out), chained from `parent`."""
    out: list[int] = []
    h = parent
    for i in range(0, len(tokens) - block_size + 1, block_size):
        h = block_hash(h, tokens[i:i + block_size])
        out.append(h)
    return out


__all__ = ["BLOCK_SIZE", "block_hash", "chain_hashes"]
