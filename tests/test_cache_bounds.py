"""Reference hit rates (sim/cache_bounds.py) on hand-made traces, checked
against values worked out by hand, and the simulator's cache/router counters."""
from __future__ import annotations

import pytest

from shepherd.bench.records import TraceRequest
from shepherd.config import SchedulerConfig
from shepherd.sim.cache_bounds import HitRateBounds
from shepherd.sim.simulator import SimConfig, simulate


def blocks(i, t, ids, n):
    return TraceRequest(arrival=t, prompt_tokens=n, output_tokens=2, hash_ids=ids, index=i)


TRACE = [blocks(0, 0.0, [1, 2], 8), blocks(1, 1.0, [1, 2, 3], 12), blocks(2, 2.0, [5], 4), blocks(3, 3.0, [1, 2], 8)]


def test_infinite_and_lru_bounds_by_hand():
    # blocks of 4 tokens; a hit stops at the prompt minus one token
    # infinite: r1 reuses [1, 2] (8), r3 reuses [1, 2] (8, capped at 7) -> 15 of 32
    # LRU with 8 tokens: after r1 only [1, 2] fit; r2's [5] evicts [1, 2]'s tail, so r3 hits [1] (4)
    b = HitRateBounds(capacity_tokens=8, block_size=4)
    for tr in TRACE:
        b.observe(tr)
    r = b.result()
    assert r["query_tokens"] == 32
    assert r["infinite_hit_tokens"] == 15 and r["infinite"] == pytest.approx(15 / 32)
    assert r["lru_cluster_hit_tokens"] == 12 and r["lru_cluster"] == pytest.approx(12 / 32)
    # with room for everything the LRU bound is the infinite one
    big = HitRateBounds(capacity_tokens=1000, block_size=4)
    for tr in TRACE:
        big.observe(tr)
    assert big.result()["lru_cluster_hit_tokens"] == 15


def test_shared_system_prompt_and_session_history():
    g = dict(prefix_group="g", prefix_tokens=6)
    trace = [TraceRequest(arrival=0.0, prompt_tokens=10, output_tokens=1, index=0, **g),
             TraceRequest(arrival=1.0, prompt_tokens=10, output_tokens=1, index=1, **g),     # hits the 6 shared
             TraceRequest(arrival=2.0, prompt_tokens=10, output_tokens=5, index=2, session="s", **g),
             TraceRequest(arrival=3.0, prompt_tokens=20, output_tokens=1, index=3, session="s", turn=1, **g)]
    # turn 1 extends turn 0: system prompt (6) + turn 0's 4 session tokens + its answer as an
    # engine caches it (5 - 1: the last token is sampled, never computed) = 14
    b = HitRateBounds(capacity_tokens=10_000)
    for tr in trace:
        b.observe(tr)
    assert b.result()["infinite_hit_tokens"] == 0 + 6 + 6 + 14


def test_simulator_reports_bounds_cache_and_routing():
    res = simulate(TRACE * 1, SimConfig(replicas=2, kv_capacity=4096, block_size=4, router="least-request",
                                        scheduler=SchedulerConfig(max_total_tokens=4096)))
    s = res.summary()
    assert s["hit_rate_bounds"]["infinite"] == pytest.approx(15 / 32)
    assert sum(r["requests"] for r in s["replicas"]) == 4
    assert sum(r["prompt_tokens"] for r in s["replicas"]) == 32
    assert sum(r["output_tokens"] for r in s["replicas"]) == 8
    assert s["routing"] == {"least": 4}
    assert s["balance"]["requests"] == pytest.approx(1.0)
    # the achieved rate never beats the infinite cache
    assert s["prefix_hit_rate"] <= s["hit_rate_bounds"]["infinite"] + 1e-9
    assert s["cache"]["cached_peak_tokens"] > 0 and s["cache"]["evicted_tokens"] == 0
