"""KV events over ZMQ: shepherd's publisher (fed by the real scheduler) to shepherd's subscriber,
with replay, gaps, an overflowed replay buffer and a restarted publisher; and the subscriber
against a scripted publisher of either encoding."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import zmq

from shepherd.config import KVEventsConfig, SchedulerConfig
from shepherd.engine.offline import run_offline
from shepherd.kv_events.codec import seq_bytes
from shepherd.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored
from shepherd.kv_events.hashing import chain_hashes
from shepherd.kv_events.index import KVBlockIndex
from shepherd.kv_events.publisher import KVEventPublisher
from shepherd.kv_events.subscriber import KVEventSubscriber, Source, parse_source
from shepherd.request import Request, SamplingParams
from shepherd.scheduler.scheduler import Scheduler
from shepherd.engine.sim_executor import SimExecutor

try:
    from kv_fakes import FakePublisher, cached_hashes, loopback, wait_until
except ImportError:  # pragma: no cover - when tests/ is a package
    from tests.kv_fakes import FakePublisher, cached_hashes, loopback, wait_until

GOLDEN = json.loads((Path(__file__).parent / "data" / "kv_events_golden.json").read_text())


def _cfg(**kw) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0", **kw)


def _index_holds_exactly(index: KVBlockIndex, replica, truth: set) -> bool:
    return index.blocks(replica) == len(truth) and all(index.holds(replica, h) for h in truth)


def _serve(sched: Scheduler, pub: KVEventPublisher, prompts: list, out: int = 4) -> None:
    """Run prompts through the real scheduler on the simulated executor; one submit per step."""
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=out, ignore_eos=True), arrival=0.0, eos_token_ids=(2,))
            for i, p in enumerate(prompts)]
    ex = SimExecutor(kv_capacity=sched.capacity)
    run_offline(sched, ex, reqs, observer=lambda *a: pub.submit(1.0))
    pub.submit(1.0)


def _prompts(n: int, length: int, shared: int = 0, seed: int = 0) -> list:
    import random
    rng = random.Random(seed)
    stem = [rng.randrange(3, 40_000) for _ in range(shared)]
    return [stem + [rng.randrange(3, 40_000) for _ in range(length - shared)] for _ in range(n)]


# ---------------------------------------------------------------- the publisher speaks vLLM's replay
class _Scripted:
    """A tracker standing in for the real one: the golden batch for any records."""

    def clear(self):
        return AllBlocksCleared()

    def apply(self, records):
        return [type(e)(**e.__dict__) for e in _golden_events()]


def _golden_events():
    from shepherd.kv_events.codec import EVENT_TYPES
    return [EVENT_TYPES[e["type"]](**{k: v for k, v in e.items() if k != "type"}) for e in GOLDEN["batches"][1]]


def test_publisher_replay_frames_are_the_ones_vllm_sends():
    from shepherd.scheduler.cache_events import CacheEventLog, NodeEvicted
    log = CacheEventLog()
    pub = KVEventPublisher(_cfg(topic=GOLDEN["topic"]), log, tracker=_Scripted())
    try:
        log.records.append(NodeEvicted(1))
        pub.submit(GOLDEN["ts"][1])
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(loopback(pub.replay_endpoint))
        frames = []
        for _ in range(50):             # the thread publishes asynchronously: ask until seq 1 exists
            dealer.send_multipart([b"", seq_bytes(1)])
            frames = []
            while True:
                assert dealer.poll(5000)
                f = dealer.recv_multipart()
                frames.append([x.hex() for x in f])
                if f[2] == b"\xff" * 8:
                    break
            if len(frames) == 2:
                break
        assert frames == GOLDEN["replay_from_1_frames"]
        dealer.send_multipart([b"", seq_bytes(0)])       # seq 0 is the AllBlocksCleared sent at start
        first = dealer.recv_multipart()
        assert first[2] == seq_bytes(0) and first[3].startswith(b"\x93\xcb") and b"AllBlocksCleared" in first[3]
        dealer.close()
    finally:
        pub.close()


# ---------------------------------------------------------------- scheduler -> publisher -> subscriber
def test_round_trip_from_the_scheduler_with_eviction_and_a_late_subscriber():
    sched = Scheduler(SchedulerConfig(max_total_tokens=512, max_num_tokens=256, max_batch_size=4))
    pub = KVEventPublisher(_cfg(), sched.kv.record_cache_events())
    index = KVBlockIndex()
    sub = KVEventSubscriber(index, replay_timeout=5.0)
    try:
        _serve(sched, pub, _prompts(6, 100, shared=40))           # before the subscriber exists
        sub.add(Source("A", loopback(pub.endpoint), loopback(pub.replay_endpoint)))
        sub.start()
        _serve(sched, pub, _prompts(12, 120, shared=20, seed=1))  # 12 x 120 tokens through 512: evictions
        assert sched.kv.evicted_tokens > 0
        truth = cached_hashes(sched.kv.tree)
        wait_until(lambda: _index_holds_exactly(index, "A", truth), what="index == cache")
        st = sub.status()["A"]
        assert st["state"] == "complete" and st["replays"] >= 1
        # what a router asks: every cached prompt matches in full, an evicted one does not
        for p in _prompts(12, 120, shared=20, seed=1):
            want = sum(1 for _ in chain_hashes(p)) if set(chain_hashes(p)) <= truth else None
            if want is not None:
                assert index.match(chain_hashes(p), ["A"]) == {"A": want}
    finally:
        sub.close()
        pub.close()


def test_overflowed_replay_buffer_gives_a_partial_index_without_stale_blocks():
    sched = Scheduler(SchedulerConfig(max_total_tokens=4096, max_num_tokens=256))
    pub = KVEventPublisher(_cfg(buffer_steps=2), sched.kv.record_cache_events())
    index = KVBlockIndex()
    sub = KVEventSubscriber(index, replay_timeout=5.0)
    try:
        early = _prompts(3, 64, seed=2)
        for p in early:                                   # one batch each, then the buffer moves on
            _serve(sched, pub, [p], out=1)
        wait_until(lambda: pub.buffered()[0] >= 2, what="the buffer to drop seq 0 and 1")
        sub.add(Source("A", loopback(pub.endpoint), loopback(pub.replay_endpoint)))
        sub.start()
        wait_until(lambda: sub.status().get("A", {}).get("state") == "partial", what="partial state")
        late = _prompts(1, 64, seed=3)[0]
        _serve(sched, pub, [late], out=1)
        wait_until(lambda: index.match(chain_hashes(late), ["A"]).get("A") == 4, what="the late prompt indexed")
        assert index.match(chain_hashes(early[0]), ["A"]) == {}     # unknown, though cached: never wrong
        assert set(chain_hashes(early[0])) <= cached_hashes(sched.kv.tree)
    finally:
        sub.close()
        pub.close()


def test_a_restarted_publisher_leaves_no_stale_blocks():
    sched = Scheduler(SchedulerConfig(max_total_tokens=4096, max_num_tokens=256))
    pub = KVEventPublisher(_cfg(), sched.kv.record_cache_events())
    ports = (pub.endpoint.rsplit(":", 1)[1], pub.replay_endpoint.rsplit(":", 1)[1])
    index = KVBlockIndex()
    sub = KVEventSubscriber(index, [Source("A", loopback(pub.endpoint), loopback(pub.replay_endpoint))],
                            replay_timeout=5.0)
    sub.start()
    old = _prompts(2, 80, seed=4)
    try:
        _serve(sched, pub, old)
        wait_until(lambda: index.blocks("A") == len(cached_hashes(sched.kv.tree)), what="first life indexed")
        pub.close()
        sched2 = Scheduler(SchedulerConfig(max_total_tokens=4096, max_num_tokens=256))   # a new process
        cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{ports[0]}",
                             replay_endpoint=f"tcp://*:{ports[1]}")
        pub = None
        deadline = time.monotonic() + 10
        while pub is None:                      # zmq releases the old ports on its I/O thread
            try:
                pub = KVEventPublisher(cfg, sched2.kv.record_cache_events())
            except ValueError:
                assert time.monotonic() < deadline, "the old publisher's ports were never released"
                time.sleep(0.01)
        new = _prompts(1, 50, seed=5)
        _serve(sched2, pub, new)
        truth = cached_hashes(sched2.kv.tree)
        wait_until(lambda: _index_holds_exactly(index, "A", truth), what="index == the new cache")
        assert index.match(chain_hashes(old[0]), ["A"]) == {}
        assert sub.status()["A"]["state"] == "complete"
    finally:
        sub.close()
        pub.close()


# ---------------------------------------------------------------- subscriber against a scripted publisher
def _stored(tokens, parent=None):
    return BlockStored(chain_hashes(tokens, parent), parent, list(tokens), 16, None, "GPU", None)


@pytest.mark.parametrize("positional", [False, True])
def test_gap_is_replayed_and_an_uncoverable_gap_drops_the_index(positional):
    fake = FakePublisher(positional=positional)
    index = KVBlockIndex()
    sub = KVEventSubscriber(index, [Source("A", loopback(fake.endpoint), loopback(fake.replay_endpoint))],
                            replay_timeout=5.0)
    a, b, c, d = (list(range(k, k + 32)) for k in (100, 200, 300, 400))
    try:
        fake.publish([AllBlocksCleared(), _stored(a)])
        sub.start()
        wait_until(lambda: index.blocks("A") == 2, what="seq 0")
        fake.publish([_stored(b)])
        fake.publish([_stored(c)], send=False)              # lost on the way: only the replay has it
        fake.publish([_stored(d)])
        wait_until(lambda: index.blocks("A") == 8, what="the gap replayed")
        st = sub.status()["A"]
        assert st["gaps"] >= 1 and st["drops"] == 0 and st["state"] == "complete"
        # now a gap the replay buffer no longer covers: the index is dropped, rebuilt from there
        fake.forget(fake.publish([BlockRemoved(chain_hashes(a), "GPU")], send=False))
        fake.publish([_stored(list(range(500, 516)))])
        wait_until(lambda: sub.status()["A"]["drops"] == 1, what="the drop")
        wait_until(lambda: index.blocks("A") == 1, what="rebuilt from the next batch")
        assert index.match(chain_hashes(a), ["A"]) == {}           # a was removed in the lost batch
        assert index.match(chain_hashes(b), ["A"]) == {}           # b is unknown now, not stale
        assert sub.status()["A"]["state"] == "partial"
        # the publisher restarts (seq 0 again): the index follows the new stream from its start
        fake.seq = 0
        fake.buffer.clear()
        fake.publish([AllBlocksCleared(), _stored(c)])
        wait_until(lambda: sub.status()["A"]["restarts"] == 1 and index.blocks("A") == 2, what="restart")
        assert index.match(chain_hashes(c), ["A"]) == {"A": 2} and sub.status()["A"]["state"] == "complete"
    finally:
        sub.close()
        fake.close()


def test_no_replay_endpoint_joins_partial_and_drops_on_a_gap():
    fake = FakePublisher()
    index = KVBlockIndex()
    sub = KVEventSubscriber(index, [Source("A", loopback(fake.endpoint))])
    a, b = list(range(10, 42)), list(range(50, 82))
    try:
        fake.publish([_stored(a)], send=False)               # before the subscriber: never seen
        sub.start()
        for _ in range(400):                                  # until the subscription is in place
            fake.publish([_stored(b)])
            try:
                wait_until(lambda: index.blocks("A") > 0, timeout=0.05)
                break
            except AssertionError:
                continue
        assert sub.status()["A"]["state"] == "partial" and index.match(chain_hashes(a), ["A"]) == {}
        fake.publish([BlockRemoved(chain_hashes(b), "GPU")], send=False)      # a gap, no replay
        fake.publish([_stored(list(range(90, 106)))])
        wait_until(lambda: sub.status()["A"]["drops"] == 1, what="the drop")
        assert index.match(chain_hashes(b), ["A"]) == {}
    finally:
        sub.close()
        fake.close()


def test_parse_source():
    s = parse_source("http://10.0.0.5:8000/=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,topic=kv")
    assert s == Source("http://10.0.0.5:8000", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "kv")
    for bad in ("http://x", "http://x=http://y", "http://x=tcp://y:1,foo=1"):
        with pytest.raises(ValueError):
            parse_source(bad)


def test_reset_clears_the_index_but_for_the_blocks_a_running_request_uses():
    """vLLM's reset_prefix_cache: AllBlocksCleared, then the blocks still in use announced again;
    the subscriber's index equals the cache after the reset and after the request ends."""
    from shepherd.engine.core import EngineCore, VirtualClock
    sched = Scheduler(SchedulerConfig(max_total_tokens=1024, max_num_tokens=256, max_batch_size=4))
    pub = KVEventPublisher(_cfg(), sched.kv.record_cache_events())
    index = KVBlockIndex()
    sub = KVEventSubscriber(index, [Source("A", loopback(pub.endpoint), loopback(pub.replay_endpoint))],
                            replay_timeout=5.0)
    sub.start()
    try:
        _serve(sched, pub, _prompts(4, 100, shared=40))
        wait_until(lambda: index.blocks("A") == len(cached_hashes(sched.kv.tree)) > 0, what="index == cache")
        long = _prompts(1, 90, seed=7)[0]
        core = EngineCore(sched, SimExecutor(kv_capacity=sched.capacity), VirtualClock())
        sched.add(Request("long", long, SamplingParams(max_tokens=40, ignore_eos=True), arrival=0.0,
                          eos_token_ids=(2,)), 0.0)
        now = 0.0
        for _ in range(3):                    # its prompt is computed and cached (locked); it still runs
            now = core.step(now).end
        assert sched.has_work
        freed, kept = sched.kv.reset_prefix_cache()
        pub.submit(1.0)
        truth = cached_hashes(sched.kv.tree)
        assert freed > 0 and kept >= 80 and truth == set(chain_hashes(long[:kept]))
        wait_until(lambda: _index_holds_exactly(index, "A", truth), what="the index after the reset")
        assert index.match(chain_hashes(_prompts(4, 100, shared=40)[0]), ["A"]) == {}
        while sched.has_work:                 # it ends: prompt + output cached and announced
            now = core.step(now).end
        pub.submit(1.0)
        truth = cached_hashes(sched.kv.tree)
        assert len(truth) > len(set(chain_hashes(long)))
        wait_until(lambda: _index_holds_exactly(index, "A", truth), what="the index after the request ended")
        assert sub.status()["A"]["drops"] == 0
    finally:
        sub.close()
        pub.close()
