"""KV events: vLLM's wire format (golden bytes from vLLM itself), the block hashes, the
radix cache -> events tracker, and the index a consumer builds from them."""
from __future__ import annotations

import hashlib
import json
import random
import struct
from pathlib import Path

import pytest

from shepherd.kv_events import codec
from shepherd.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from shepherd.kv_events.hashing import BLOCK_SIZE, block_hash, chain_hashes
from shepherd.kv_events.index import KVBlockIndex
from shepherd.kv_events.tracker import BlockTracker
from shepherd.scheduler.cache_events import CacheEventLog
from shepherd.scheduler.kv_pool import KVPool
from shepherd.scheduler.radix_cache import RadixCache

try:
    from kv_fakes import cached_hashes
    from test_radix_cache import _ins
except ImportError:  # pragma: no cover - when tests/ is a package
    from tests.kv_fakes import cached_hashes
    from tests.test_radix_cache import _ins

GOLDEN = json.loads((Path(__file__).parent / "data" / "kv_events_golden.json").read_text())


def _golden_batch(i: int) -> EventBatch:
    evs = [codec.EVENT_TYPES[e["type"]](**{k: v for k, v in e.items() if k != "type"}) for e in GOLDEN["batches"][i]]
    return EventBatch(GOLDEN["ts"][i], evs, GOLDEN["data_parallel_rank"])


# ---------------------------------------------------------------- golden bytes
@pytest.mark.parametrize("i", [0, 1])
def test_encoder_writes_vllm_bytes(i):
    """shepherd's payload is byte-for-byte what vLLM 0.32's msgspec encoder wrote."""
    topic, seq, payload = (bytes.fromhex(f) for f in GOLDEN["live_frames"][i])
    assert codec.encode_batch(_golden_batch(i)) == payload
    assert topic == GOLDEN["topic"].encode() and codec.seq_of(seq) == i and codec.seq_bytes(i) == seq


@pytest.mark.parametrize("i", [0, 1])
def test_decoder_reads_vllm_bytes(i):
    payload = bytes.fromhex(GOLDEN["live_frames"][i][2])
    got = codec.decode_batch(payload)
    assert got.batch == _golden_batch(i) and got.unknown == 0


def test_decoder_reads_positional_events_and_ignores_unknowns():
    """The older encoding (SGLang, vLLM before maps): events as [type, fields...]; extra fields,
    unknown fields and unknown event types are skipped, not errors."""
    import msgpack
    payload = msgpack.packb([2.5, [
        ["BlockStored", [7, 8], None, list(range(32)), 16, None],              # SGLang: no medium
        ["BlockRemoved", [7], "GPU", "future-field"],
        ["AllBlocksCleared"],
        {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": 8, "token_ids": list(range(16)),
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0, "new": 1},
        {"type": "BlockUpdated", "block_hashes": [1]},
    ]], use_bin_type=True)
    got = codec.decode_batch(payload)
    assert got.unknown == 1 and got.batch.data_parallel_rank is None
    stored, removed, cleared, tagged = got.batch.events
    assert stored == BlockStored([7, 8], None, list(range(32)), 16, None, "GPU", None)
    assert removed == BlockRemoved([7], "GPU") and cleared == AllBlocksCleared()
    assert tagged.block_hashes == [9] and tagged.parent_block_hash == 8


@pytest.mark.parametrize("payload", [b"\xc1", b"\x92\x01", b"\x93\xa1x\x90\x00",
                                     b"\x92\xcb" + b"\0" * 8 + b"\x91\x81\xa4type\xabBlockStored"])
def test_decoder_rejects_garbage_with_decode_error(payload):
    with pytest.raises(codec.DecodeError):
        codec.decode_batch(payload)


# ---------------------------------------------------------------- hashes
def test_block_hash_is_the_documented_function():
    toks = [random.Random(1).randrange(50_000) for _ in range(40)]
    want, parent = [], 0
    for i in range(0, 32, 16):
        d = hashlib.sha256(struct.pack("<Q16I", parent, *toks[i:i + 16])).digest()
        parent = int.from_bytes(d[-8:], "big")
        want.append(parent)
    assert chain_hashes(toks) == want                 # the partial third block has no hash
    assert block_hash(None, toks[:16]) == want[0] and block_hash(want[0], toks[16:32]) == want[1]


# ---------------------------------------------------------------- the tracker
def _tree(capacity=4096, page=1):
    pool = KVPool(capacity, page)
    log = CacheEventLog()
    return RadixCache(pool, events=log), pool, log


class _Consumer:
    """The set of blocks a consumer believes cached, from the events."""

    def __init__(self):
        self.held = set()

    def apply(self, events):
        for ev in events:
            if isinstance(ev, BlockStored):
                assert not (set(ev.block_hashes) & self.held), "a block announced twice"
                assert len(ev.token_ids) == BLOCK_SIZE * len(ev.block_hashes) and ev.block_size == BLOCK_SIZE
                assert ev.parent_block_hash is None or ev.parent_block_hash in self.held
                assert chain_hashes(ev.token_ids, ev.parent_block_hash) == ev.block_hashes
                self.held.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert set(ev.block_hashes) <= self.held
                self.held.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.held.clear()


def test_insert_split_and_evict_of_a_partial_node():
    tree, pool, log = _tree()
    tr = BlockTracker()
    a = list(range(100, 140))                       # 40 tokens: blocks 0, 1 and a partial one
    _ins(tree, pool, a)
    (stored,) = tr.apply(log.drain())
    assert stored.parent_block_hash is None and stored.block_hashes == chain_hashes(a)
    assert stored.token_ids == a[:32]
    b = a[:20] + list(range(900, 912))              # 32 tokens: splits a's node at 20
    _ins(tree, pool, b)
    (stored_b,) = tr.apply(log.drain())
    # b's new node starts at 20, inside block 1: the block's first 4 tokens come from the shared part
    assert stored_b.parent_block_hash == chain_hashes(a)[0]
    assert stored_b.token_ids == b[16:32] and stored_b.block_hashes == chain_hashes(b)[1:]
    # least recently used leaf first: a's tokens 20..39, which end a's block 1 (16..31). The block
    # starts in the shared parent, yet it is no longer whole: removed
    tree.evict(1)
    (removed,) = tr.apply(log.drain())
    assert removed.block_hashes == [chain_hashes(a)[1]]
    tree.evict(1)                                   # b's leaf: b's block 1
    (removed,) = tr.apply(log.drain())
    assert removed.block_hashes == [chain_hashes(b)[1]]
    tree.evict(1)                                   # the shared 20 tokens: block 0
    (removed,) = tr.apply(log.drain())
    assert removed.block_hashes == [chain_hashes(a)[0]] and tr.num_blocks == 0


@pytest.mark.parametrize("page", [1, 4, 16])
def test_tracker_matches_the_cache_under_random_work(page):
    """After any mix of inserts (shared prefixes, splits), lookups and evictions, the blocks a
    consumer of the events holds are exactly the full blocks the cache holds."""
    rng = random.Random(page)
    tree, pool, log = _tree(capacity=2048, page=page)
    tr, cons = BlockTracker(), _Consumer()
    stems = [[rng.randrange(1000) for _ in range(rng.randrange(1, 60))] for _ in range(6)]
    for step in range(400):
        op = rng.random()
        if op < 0.6:
            ids = list(rng.choice(stems)) + [rng.randrange(1000) for _ in range(rng.randrange(0, 50))]
            ids = ids[:len(ids) - len(ids) % page]
            need = pool.pages_needed(0, len(ids))
            if need > pool.free_pages:
                tree.evict((need - pool.free_pages) * page)
            if ids and need <= pool.free_pages:
                _ins(tree, pool, ids)
        elif op < 0.8:
            tree.match_prefix(list(rng.choice(stems)) + [rng.randrange(1000)])     # may split
        else:
            tree.evict(rng.randrange(1, 200))
        cons.apply(tr.apply(log.drain()))
        assert cons.held == cached_hashes(tree), f"step {step}"
    tree.check()


def test_index_matches_what_the_cache_holds():
    tree, pool, log = _tree()
    tr, index = BlockTracker(), KVBlockIndex()
    a = list(range(1, 101))                          # 100 tokens: 6 full blocks
    _ins(tree, pool, a)
    index.apply("A", tr.apply(log.drain()))
    assert index.match(chain_hashes(a), ["A", "B"]) == {"A": 6}
    assert index.match(chain_hashes(a[:40] + [7] * 60), ["A"]) == {"A": 2}
    tree.evict(4 + 16)                               # the leaf holds all 100: evicting it drops 6 blocks
    index.apply("A", tr.apply(log.drain()))
    assert index.match(chain_hashes(a), ["A"]) == {} and index.blocks("A") == 0



def test_index_rekeys_other_engines_block_sizes_and_hashes():
    """vLLM-CPU's 32-token blocks (and any size, 24 here) with the engine's own opaque hashes are
    re-cut into 16-token keys of shepherd's hash; removals name the engine's hashes."""
    toks = list(range(1, 97))                        # 96 tokens: 6 keys
    keys = chain_hashes(toks)
    index = KVBlockIndex()
    index.apply("V", [BlockStored([501, 502], None, toks[:64], 32, None, "GPU", None),
                      BlockStored([503], 502, toks[64:], 32, None, "GPU", None)])
    assert index.match(keys, ["V"]) == {"V": 6} and index.blocks("V") == 6
    index.apply("V", [BlockRemoved([503], "GPU")])   # one 32-token block: two keys
    assert index.match(keys, ["V"]) == {"V": 4}
    index.apply("W", [BlockStored([7, 8], None, toks[:48], 24, None, "GPU", None),
                      BlockStored([9, 10], 8, toks[48:], 24, None, "GPU", None)])
    assert index.match(keys, ["W"]) == {"W": 6}
    index.apply("W", [BlockRemoved([9], "GPU")])     # tokens 48-72: the key of 48-64 goes
    assert index.match(keys, ["W"]) == {"W": 3} and index.blocks("W") == 5


# ---------------------------------------------------------------- --kv-events-config
def test_kv_events_config_takes_vllms_fields_and_rejects_the_rest():
    from shepherd.config import ConfigError, KVEventsConfig
    cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",'
                                   ' "replay_endpoint": "tcp://*:5558", "topic": "kv", "buffer_steps": 100,'
                                   ' "hwm": 1000, "max_queue_size": 10}')
    assert cfg.enabled and cfg.replay_endpoint == "tcp://*:5558" and cfg.buffer_steps == 100
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    assert not KVEventsConfig.from_json('{}').enabled
    for bad, why in [("{", "not JSON"), ("[]", "object"), ('{"endpoint": 5}', "endpoint"),
                     ('{"publisher": "kafka"}', "publisher"), ('{"buffer_steps": 0}', "buffer_steps"),
                     ('{"enable_kv_cache_events": "yes"}', "true or false"), ('{"port": 1}', "unknown field")]:
        with pytest.raises(ConfigError, match=why):
            KVEventsConfig.from_json(bad)
