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


def test_bounds_count_the_served_requests_as_the_achieved_rate_does():
    # two of four requests too long for the context: their prompts were in the bounds' query
    # tokens but not in the achieved rate's, so the "bound" (7 of 32+) read below what was achieved
    g = dict(prefix_group="g", prefix_tokens=8)
    trace = [TraceRequest(arrival=float(i), prompt_tokens=n, output_tokens=2, index=i, **g)
             for i, n in enumerate([12, 100, 12, 100])]
    res = simulate(trace, SimConfig(kv_capacity=4096, block_size=4, max_model_len=50,
                                    scheduler=SchedulerConfig(max_total_tokens=4096)))
    s = res.summary()
    assert s["rejections"]["context_length"]["count"] == 2
    assert s["hit_rate_bounds"]["query_tokens"] == 24 == s["sim"]["prefix_query_tokens"]
    assert s["prefix_hit_rate"] == pytest.approx(8 / 24) == s["hit_rate_bounds"]["infinite"]


def two_turns(second_at: float, out0: int = 5):
    g = dict(prefix_group="g", prefix_tokens=6, session="s")
    return [TraceRequest(arrival=0.0, prompt_tokens=10, output_tokens=out0, index=0, **g),
            TraceRequest(arrival=second_at, prompt_tokens=20, output_tokens=1, index=1, turn=1, **g)]


@pytest.mark.parametrize("finish0, causal", [(2.0, 6 + 4),         # turn 1 arrives (1.0) while turn 0 runs
                                             (0.5, 6 + 4 + 4)])    # turn 1 arrives after turn 0 finished
def test_causal_bound_takes_the_answer_at_its_finish(finish0, causal):
    # turn 0: system prompt 6 + 4 session tokens, answer 5 (4 cached); turn 1 (20 tokens) extends it.
    # The old bound caches turn 0's answer at its arrival: 14 hit whatever the finish.
    b = HitRateBounds(capacity_tokens=10_000)
    t0, t1 = two_turns(1.0)
    b.observe(t0, "r0", at=0.0)
    b.finished("r0", finish0)          # reported before turn 1 is observed, but it is the time that counts
    b.observe(t1, "r1", at=1.0)
    r = b.result()
    assert r["lru_cluster_hit_tokens"] == 14
    assert r["lru_cluster_causal_hit_tokens"] == causal
    assert r["lru_cluster_causal"] == pytest.approx(causal / 30)


def test_causal_bound_answer_that_never_finishes_never_enters():
    b = HitRateBounds(capacity_tokens=10_000)
    t0, t1 = two_turns(1.0)
    b.observe(t0, "r0")
    b.forget("r0")
    b.finished("r0", 0.5)              # too late: forgotten (refused, failed)
    b.observe(t1, "r1")
    assert b.result()["lru_cluster_causal_hit_tokens"] == 10


def test_causal_bound_waits_for_settle():
    # an arrival is looked up only once every finish before it is known
    seen = []
    b = HitRateBounds(capacity_tokens=10_000, on_causal_hit=lambda tr, h: seen.append((tr.index, h)))
    t0, t1 = two_turns(1.0)
    b.observe(t0, "r0", at=0.0)
    b.observe(t1, "r1", at=1.0)
    b.settle(0.5)
    assert seen == [(0, 0)]
    b.finished("r0", 0.8)              # a finish reported late, before the time it belongs to was settled
    b.settle(1.0)
    assert seen == [(0, 0), (1, 14)]


@pytest.mark.parametrize("second_at, answer_counted", [(0.001, False), (60.0, True)])
def test_simulator_causal_bound_on_a_two_turn_session(second_at, answer_counted):
    trace = two_turns(second_at, out0=50)
    res = simulate(trace, SimConfig(replicas=2, kv_capacity=4096, block_size=4, router="least-request",
                                    scheduler=SchedulerConfig(max_total_tokens=4096)))
    finish0 = next(r.finish for r in res.records if r.req_id == "r0")
    assert (finish0 < second_at) == answer_counted
    b = res.hit_rate_bounds
    # turn 0's answer (49 cached tokens) covers turn 1's whole history: a hit of the prompt - 1 = 19
    assert b["lru_cluster_hit_tokens"] == 19
    assert b["lru_cluster_causal_hit_tokens"] == (19 if answer_counted else 6 + 4)
    assert sum(res.timeseries["prefix_hit_lru_cluster_causal"]) == b["lru_cluster_causal_hit_tokens"]


def replayed_causal(trace, records, capacity, block_size) -> int:
    """The causal bound with every finish known from the start (the run's records)."""
    from shepherd.sim.simulator import request_id
    fin = {r.req_id: r.finish for r in records if r.ok and r.finish is not None}
    b = HitRateBounds(capacity, block_size)
    for i, tr in enumerate(sorted(trace, key=lambda t: t.arrival)):
        rid = request_id(tr, i)
        b.observe(tr, rid)
        if rid in fin:
            b.finished(rid, fin[rid])
    return b.result()["lru_cluster_causal_hit_tokens"]


@pytest.mark.parametrize("router", ["round-robin", "least-request", "precise-prefix"])
def test_simulator_causal_bound_equals_a_replay_with_every_finish_known(router):
    # replicas run lazily (round-robin advances only the chosen one; least-request settles early), so
    # finishes reach the bound late and out of order: the bound must still see them in time order
    from shepherd.bench.synthetic import ClientSpec, SyntheticSpec, synthetic
    trace = synthetic(SyntheticSpec(clients=[ClientSpec(name="chat", rate=2.0, input_len="lognormal:60:0.5",
                                                        output_len="lognormal:40:0.5", system_prompt_tokens=50,
                                                        num_system_prompts=2, turns=4, think_time=1.0)],
                                    num_requests=120, seed=3))
    cap = 1024
    res = simulate(trace, SimConfig(replicas=3, kv_capacity=cap, block_size=16, router=router,
                                    scheduler=SchedulerConfig(max_total_tokens=cap)))
    b = res.hit_rate_bounds
    running = sum(1 for tr in trace if tr.turn > 0)
    assert running and b["lru_cluster_causal_hit_tokens"] < b["lru_cluster_hit_tokens"]
    assert b["lru_cluster_causal_hit_tokens"] == replayed_causal(trace, res.records, 3 * cap, 16)


def test_causal_bound_evicts_only_the_overflowing_tail():
    # 10 tokens, blocks of 4: [1, 2] then [5] overflow by 2. lru_cluster drops block 2 whole (a hit of
    # 4 on the next [1, 2]); the causal bound trims 2 tokens off block 2's tail (a hit of 4 + 2)
    b = HitRateBounds(capacity_tokens=10, block_size=4)
    for tr in (blocks(0, 0.0, [1, 2], 8), blocks(1, 1.0, [5], 4), blocks(2, 2.0, [1, 2], 8)):
        b.observe(tr)
    r = b.result()
    assert r["lru_cluster_hit_tokens"] == 4 and r["lru_cluster_causal_hit_tokens"] == 6
