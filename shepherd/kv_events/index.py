"""Which replica caches which blocks, from the replicas' KV events; pure, thread-safe.

    index = KVBlockIndex()
    index.apply(replica_key, events)          # BlockStored / BlockRemoved / AllBlocksCleared, in stream order
    index.match(chain_hashes(token_ids), [keys]) -> {replica key: leading blocks it holds}
    index.drop(replica_key)                   # forget everything about a replica (a gap, a removal)

Keys are shepherd's own block hashes (hashing.py) of the events' `token_ids`,
16 tokens a block from position 0, so the index never depends on an engine's
hash algorithm or block size: an engine hash is only a name, mapped per
replica to the keys its block completed and to the chain state at its end (the
last key and the tokens of a partial block), so the next BlockStored that names
it as parent continues the chain. A BlockRemoved drops the keys its blocks
completed. The same engine hash stored twice counts once (vLLM re-announces
cached blocks); a key stays held while any engine block of the replica holds it.

An engine block size that is not 16 works: blocks are re-cut into 16-token
keys (a key is attributed to the engine block that holds its last token). A
BlockStored whose parent the index has not seen (it joined late, or after a
drop) is skipped: its position is unknown. Blocks of a LoRA adapter are keyed
on a chain salted with the adapter's name, so they never match a base-model
prompt. Media ("GPU", "CPU" offload...) are kept apart: removing a block from
one tier leaves the other's copy.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Callable, Hashable, Iterable, Optional

from shepherd.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored
from shepherd.kv_events.hashing import BLOCK_SIZE, block_hash


class _EngineBlock:
    __slots__ = ("keys", "last", "tail")

    def __init__(self, keys: tuple, last: Optional[int], tail: tuple):
        self.keys = keys      # own keys this engine block completed
        self.last = last      # own key of the last full 16-token block at its end (chain state)
        self.tail = tail      # tokens after that block (fewer than 16)


class _Replica:
    __slots__ = ("engine", "by_hash", "counts", "orphans", "unknown", "usable")

    def __init__(self) -> None:
        self.usable = True                # False: its stream is being resynchronised; match() skips it
        self.engine: dict = {}            # (medium, engine hash) -> _EngineBlock
        self.by_hash: dict = {}           # engine hash -> _EngineBlock in some tier (parent lookups)
        self.counts: Counter = Counter()  # own key -> engine blocks holding it
        self.orphans = 0                  # BlockStored events skipped: parent never seen
        self.unknown = 0                  # events of other types


class KVBlockIndex:
    def __init__(self, block_size: int = BLOCK_SIZE, hasher: Callable = block_hash):
        self.block_size = block_size
        self.hasher = hasher
        self._lock = threading.Lock()
        self._replicas: dict[Hashable, _Replica] = {}
        self._holders: dict[int, set] = {}      # own key -> replica keys that hold it

    # ------------------------------------------------------------------ writes
    def apply(self, replica: Hashable, events: Iterable) -> None:
        with self._lock:
            rep = self._replicas.get(replica)
            if rep is None:
                rep = self._replicas[replica] = _Replica()
            for ev in events:
                if isinstance(ev, BlockStored):
                    self._stored(replica, rep, ev)
                elif isinstance(ev, BlockRemoved):
                    self._removed(replica, rep, ev)
                elif isinstance(ev, AllBlocksCleared):
                    self._clear(replica, rep)
                else:
                    rep.unknown += 1

    def drop(self, replica: Hashable) -> None:
        """Forget every block of the replica (its stream had a gap that could not be replayed)."""
        with self._lock:
            rep = self._replicas.get(replica)
            if rep is not None:
                self._clear(replica, rep)

    def set_usable(self, replica: Hashable, usable: bool) -> None:
        """While False (a stream that may have missed events is being checked), match() leaves
        the replica out: never route on an index that may be stale."""
        with self._lock:
            rep = self._replicas.get(replica)
            if rep is None:
                rep = self._replicas[replica] = _Replica()
            rep.usable = usable

    def remove(self, replica: Hashable) -> None:
        """The replica left for good."""
        with self._lock:
            rep = self._replicas.pop(replica, None)
            if rep is not None:
                self._clear(replica, rep)

    # ------------------------------------------------------------------ reads
    def match(self, keys: list[int], replicas: Optional[Iterable[Hashable]] = None,
              extra: Optional[dict] = None) -> dict:
        """{replica: number of leading keys it holds} for replicas holding at least the first.
        A replica whose stream is being checked (set_usable False) holds nothing here. `extra`:
        {replica: keys it holds besides its events (a router's in-flight prompts)}."""
        out: dict = {}
        extra = extra or {}
        with self._lock:
            usable = {r for r, rep in self._replicas.items() if rep.usable}
            alive = set(replicas) if replicas is not None else usable | set(extra)
            for i, k in enumerate(keys):
                held = self._holders.get(k, ())
                alive = {r for r in alive if (r in held and r in usable) or k in extra.get(r, ())}
                if not alive:
                    break
                for r in alive:
                    out[r] = i + 1
        return out

    def blocks(self, replica: Hashable) -> int:
        """Distinct own keys the replica holds."""
        with self._lock:
            rep = self._replicas.get(replica)
            return len(rep.counts) if rep is not None else 0

    def holds(self, replica: Hashable, key: int) -> bool:
        with self._lock:
            return replica in self._holders.get(key, ())

    def stats(self, replica: Hashable) -> dict:
        with self._lock:
            rep = self._replicas.get(replica)
            if rep is None:
                return {"blocks": 0, "engine_blocks": 0, "orphans": 0, "unknown_events": 0, "usable": False}
            return {"blocks": len(rep.counts), "engine_blocks": len(rep.engine), "orphans": rep.orphans,
                    "unknown_events": rep.unknown, "usable": rep.usable}

    # ------------------------------------------------------------------ events
    def _start(self, ev: BlockStored) -> tuple[Optional[int], tuple]:
        """Chain state before position 0: plain, or salted by the LoRA adapter."""
        name = ev.lora_name if ev.lora_name is not None else ev.lora_id
        if name is None:
            return None, ()
        return self.hasher(None, [b for b in str(name).encode("utf-8")]), ()

    @staticmethod
    def _parent(rep: _Replica, ev: BlockStored) -> Optional[_EngineBlock]:
        blk = rep.engine.get((ev.medium, ev.parent_block_hash))
        return blk if blk is not None else rep.by_hash.get(ev.parent_block_hash)   # another tier's copy

    def _stored(self, replica, rep: _Replica, ev: BlockStored) -> None:
        hashes = list(ev.block_hashes or ())
        toks = list(ev.token_ids or ())
        if not hashes:
            return
        size = ev.block_size if ev.block_size and ev.block_size * len(hashes) == len(toks) else 0
        if not size:
            if len(toks) % len(hashes):
                rep.unknown += 1           # malformed: tokens do not split into the blocks
                return
            size = len(toks) // len(hashes)
        if ev.parent_block_hash is None:
            last, tail = self._start(ev)
        else:
            parent = self._parent(rep, ev)
            if parent is None:
                rep.orphans += 1
                return
            last, tail = parent.last, parent.tail
        bs = self.block_size
        for i, h in enumerate(hashes):
            buf = tail + tuple(toks[i * size:(i + 1) * size])
            keys = []
            while len(buf) >= bs:
                last = self.hasher(last, buf[:bs])
                keys.append(last)
                buf = buf[bs:]
            tail = buf
            name = (ev.medium, h)
            if name in rep.engine:
                continue
            blk = rep.engine[name] = _EngineBlock(tuple(keys), last, tail)
            rep.by_hash[h] = blk
            for k in keys:
                rep.counts[k] += 1
                if rep.counts[k] == 1:
                    self._holders.setdefault(k, set()).add(replica)

    def _removed(self, replica, rep: _Replica, ev: BlockRemoved) -> None:
        for h in ev.block_hashes or ():
            blk = rep.engine.pop((ev.medium, h), None)
            if blk is None:
                continue
            if rep.by_hash.get(h) is blk:
                del rep.by_hash[h]
            for k in blk.keys:
                rep.counts[k] -= 1
                if rep.counts[k] <= 0:
                    del rep.counts[k]
                    held = self._holders.get(k)
                    if held is not None:
                        held.discard(replica)
                        if not held:
                            del self._holders[k]

    def _clear(self, replica, rep: _Replica) -> None:
        for k in rep.counts:
            held = self._holders.get(k)
            if held is not None:
                held.discard(replica)
                if not held:
                    del self._holders[k]
        rep.engine.clear()
        rep.by_hash.clear()
        rep.counts.clear()


__all__ = ["KVBlockIndex"]
