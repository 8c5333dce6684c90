"""Policies, prefix cache, aging, priority preemption, prefill/decode interleave."""
from __future__ import annotations

from shepherd.config import SchedulerConfig
from sim_targets import prefill_chunks, run_offline
from shepherd.request import FinishReason, Request, RequestState, SamplingParams
from shepherd.scheduler.scheduler import Scheduler
from shepherd.engine.sim_executor import SimExecutor

EOS = 2


def mk(rid, ids, max_tokens=8, out=None, arrival=0.0, **kw):
    r = Request(rid, list(ids), SamplingParams(max_tokens=max_tokens), arrival=arrival, eos_token_ids=(EOS,), **kw)
    if out is not None:
        r.sim_output_len = out
    return r


def make(cap=1024, host=0, **kw):
    s = Scheduler(SchedulerConfig(max_total_tokens=cap, **kw), host_kv_capacity=host, max_model_len=8192)
    ex = SimExecutor(kv_capacity=cap, host_kv_capacity=host, check=True, step_time=lambda b: 1.0)
    return s, ex


def test_prefix_cache_second_request_computes_fewer_tokens():
    system = list(range(10, 310))                     # 300-token shared prefix
    s, ex = make(cap=2048)
    a = mk("a", system + [5, 6, 7], max_tokens=4)
    b = mk("b", system + [8, 9], max_tokens=4, arrival=100.0)
    run_offline(s, ex, [a, b])
    assert ex.tokens_by_req["a"] >= 303
    assert ex.tokens_by_req["b"] <= 2 + 4             # only the new suffix and decodes
    assert b.num_cached == 300
    st = s.stats()
    assert st.prefix_hit_tokens == 300
    # same greedy tokens with the cache off
    s2, ex2 = make(cap=2048, prefix_cache=False)
    b2 = mk("b", system + [8, 9], max_tokens=4)
    run_offline(s2, ex2, [b2])
    assert b2.output_ids == b.output_ids
    assert ex2.tokens_by_req["b"] >= 302


def test_prefix_cache_keeps_last_prompt_token_uncached():
    s, ex = make(cap=512)
    a = mk("a", range(10, 60), max_tokens=2)
    b = mk("b", range(10, 60), max_tokens=2, arrival=50.0)   # identical prompt
    run_offline(s, ex, [a, b])
    assert b.num_cached == 49 and ex.tokens_by_req["b"] >= 1
    assert b.output_ids == a.output_ids


def test_prefix_cache_page_aligned():
    s, ex = make(cap=1024, page_size=8)
    a = mk("a", range(10, 47), max_tokens=2)                 # 37 tokens
    b = mk("b", list(range(10, 40)) + [1, 1, 1], max_tokens=2, arrival=50.0)
    run_offline(s, ex, [a, b])
    assert b.num_cached == 24                                # 30 common tokens -> 3 pages
    s.check_integrity()


def test_evictable_counts_as_free_and_is_reclaimed():
    s, ex = make(cap=256, admission="guaranteed")
    reqs = [mk(f"r{i}", [100 + i] * 100, max_tokens=20, arrival=i * 200.0) for i in range(6)]
    run_offline(s, ex, reqs)
    st = s.stats()
    assert st.kv_evictable > 0 and st.kv_used == 0
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)


def test_vtc_bounds_service_difference():
    """Client A sends 4x as many requests as client B, both backlogged from t=0."""
    def run(policy):
        s, ex = make(cap=4096, max_batch_size=4, max_num_tokens=512, policy=policy)
        reqs = []
        for i in range(100):
            client = "B" if i % 5 == 4 else "A"
            reqs.append(mk(f"r{i}", [3 + i % 50] * 20, max_tokens=20, client=client))
        diffs = []

        def svc(c):
            tot = 0
            for r in reqs:
                if r.client == c and r.admitted_at is not None:
                    tot += len(r.prompt_ids) + 2 * len(r.output_ids)
            return tot

        def obs(b, o, t0, t1):
            waiting_b = sum(1 for x in s.waiting if x.client == "B")
            waiting_a = sum(1 for x in s.waiting if x.client == "A")
            if waiting_a and waiting_b:
                diffs.append(abs(svc("A") - svc("B")))
        run_offline(s, ex, reqs, observer=obs)
        return diffs
    vtc = run("vtc")
    fcfs = run("fcfs")
    # one request's charge: 20 in + 2 * 20 out = 60; the paper bounds the gap by 2x the largest
    # charge, plus what a batch admitted in one step adds (4 requests here)
    U = 20 + 2 * 20
    assert max(vtc) <= 2 * U + 4 * 20, max(vtc)
    assert max(fcfs) > 3 * max(vtc)
    assert fcfs[-1] > fcfs[len(fcfs) // 4]          # grows under fcfs


def test_lpm_aging_bounds_cold_request_wait():
    hot = list(range(10, 200))
    aging = 20

    def run(aging_steps):
        s, ex = make(cap=8192, max_batch_size=2, policy="lpm", aging_steps=aging_steps)
        reqs = [mk("warm", hot + [1], max_tokens=2)]
        reqs.append(mk("cold", [7] * 50, max_tokens=2, arrival=8.0))
        for i in range(150):
            reqs.append(mk(f"h{i}", hot + [i % 40 + 3, 5], max_tokens=5, arrival=4.0 + i * 0.5))
        run_offline(s, ex, reqs)
        return reqs[1].admitted_at - reqs[1].arrival
    with_aging = run(aging)
    without = run(10**9)
    assert with_aging <= aging + 10, with_aging
    assert without > 3 * with_aging


def test_lookahead_with_aging_does_not_starve_big_head():
    s, ex = make(cap=256, admission="guaranteed", max_batch_size=8, aging_steps=15, lookahead=4)
    reqs = [mk("small0", [5] * 20, max_tokens=40)]
    reqs.append(mk("big", [6] * 100, max_tokens=100, arrival=0.5))
    for i in range(60):
        reqs.append(mk(f"s{i}", [7 + i % 30] * 20, max_tokens=40, arrival=1.0 + i))
    run_offline(s, ex, reqs)
    big = reqs[1]
    assert big.finish_reason is FinishReason.LENGTH
    assert big.admitted_at < 100          # without aging, smaller ones would keep overtaking it
    # and smaller ones did overtake it before it aged
    assert any(r.admitted_at < big.admitted_at for r in reqs[2:])


def test_priority_preempts_for_batch_slots():
    s, ex = make(cap=4096, max_batch_size=2, policy="priority", admission="optimistic")
    low = [mk(f"low{i}", [5 + i] * 10, max_tokens=200, priority=0) for i in range(2)]
    high = mk("high", [9] * 10, max_tokens=5, priority=5, arrival=10.0)
    run_offline(s, ex, low + [high])
    assert high.admitted_at - high.arrival <= 2
    assert sum(r.preemptions for r in low) == 1
    assert all(len(r.output_ids) == 200 for r in low)


def test_priority_preempts_for_kv():
    s, ex = make(cap=256, max_batch_size=8, policy="priority", admission="optimistic")
    low = [mk(f"low{i}", [5 + i] * 60, max_tokens=150, priority=0) for i in range(3)]
    high = mk("high", [9] * 100, max_tokens=5, priority=5, arrival=20.0)
    run_offline(s, ex, low + [high])
    assert high.admitted_at - high.arrival <= 2
    assert sum(r.preemptions for r in low) >= 1
    assert high.finish_reason is FinishReason.LENGTH


def test_priority_without_preemption_in_guaranteed_mode():
    s, ex = make(cap=4096, max_batch_size=2, policy="priority", admission="guaranteed")
    low = [mk(f"low{i}", [5 + i] * 10, max_tokens=50, priority=0) for i in range(3)]
    high = mk("high", [9] * 10, max_tokens=5, priority=5, arrival=5.0)
    run_offline(s, ex, low + [high])
    assert sum(r.preemptions for r in low) == 0
    assert high.admitted_at <= low[2].admitted_at     # but it jumps the queue
    assert high.finished_at < low[2].finished_at


def test_random_policy_is_seeded():
    def order(seed):
        s, ex = make(cap=4096, max_batch_size=1, policy="random", seed=seed)
        reqs = [mk(f"r{i}", [5 + i] * 5, max_tokens=1) for i in range(8)]
        run_offline(s, ex, reqs)
        return [r.req_id for r in sorted(reqs, key=lambda r: r.admitted_at)]
    assert order(1) == order(1)
    assert order(1) != order(2) or order(1) != order(3)


def test_lof_prefers_long_outputs():
    s, ex = make(cap=4096, max_batch_size=1, policy="lof")
    first = mk("first", [4] * 5, max_tokens=3)
    reqs = [first] + [mk(f"r{m}", [5] * 5, max_tokens=m, arrival=0.5) for m in (5, 50, 20)]
    run_offline(s, ex, reqs)
    started = [r.req_id for r in sorted(reqs[1:], key=lambda r: r.admitted_at)]
    assert started == ["r50", "r20", "r5"]


def test_dfs_weight_groups_shared_prefixes():
    s, ex = make(cap=8192, max_batch_size=1, policy="dfs-weight")
    a_pre, b_pre = [11] * 40, [12] * 40
    seed = [mk("seedA", a_pre + [1], max_tokens=1), mk("seedB", b_pre + [1], max_tokens=1)]
    later = [mk("b1", b_pre + [3], max_tokens=1, arrival=10), mk("a1", a_pre + [3], max_tokens=1, arrival=10),
             mk("b2", b_pre + [4], max_tokens=1, arrival=10), mk("b3", b_pre + [5], max_tokens=1, arrival=10)]
    run_offline(s, ex, seed + later)
    started = [r.req_id for r in sorted(later, key=lambda r: r.admitted_at)]
    assert started[:2] == ["b1", "b2"]      # the heavier subtree first (fcfs would take a1 second)


def test_mixed_steps_never_stall_decodes_behind_prefill():
    s, ex = make(cap=1 << 16, max_batch_size=64, max_num_tokens=32)
    dec = mk("dec", [5] * 4, max_tokens=40)
    reqs = [dec] + [mk(f"p{i}", [6 + i % 20] * 200, max_tokens=2, arrival=2.0 + i) for i in range(30)]
    steps = []

    def obs(b, o, t0, t1):
        assert b.num_tokens <= 32
        steps.append((any(sq.req_id == "dec" for sq in b.seqs), any(sq.is_prefill for sq in b.seqs)))
    run_offline(s, ex, reqs, observer=obs)
    first = next(i for i, (d, _) in enumerate(steps) if d)
    last = max(i for i, (d, _) in enumerate(steps) if d)
    assert all(d for d, _ in steps[first:last + 1])      # a token for `dec` in every step while it runs
    assert any(d and p for d, p in steps)                 # and prefill chunks rode in the same steps


def _burst_beside_a_decode(cap, n=10, prompt=34, arrival=2.0, **kw):
    """One stream decoding, then n prompts arriving together (issue 31's enum row: ten requests
    admitted at once); per step: (dec's token in it, prompt tokens in it)."""
    s, ex = make(cap=1 << 16, max_batch_size=64, max_prefill_tokens_with_decodes=cap, **kw)
    dec = mk("dec", [5] * 4, max_tokens=60)
    burst = [mk(f"p{i}", [6 + i] * prompt, max_tokens=2, arrival=arrival) for i in range(n)]
    steps = []

    def obs(b, o, t0, t1):
        steps.append((any(sq.req_id == "dec" and not sq.is_prefill for sq in b.seqs),
                      sum(sq.num_tokens for sq in b.seqs if sq.is_prefill)))
    run_offline(s, ex, [dec] + burst, observer=obs)
    assert all(len(r.output_ids) == 2 for r in burst) and len(dec.output_ids) == 60
    return steps, burst


def test_prefill_cap_beside_decodes_bounds_each_step_and_the_decode_never_waits():
    C = 16
    steps, _ = _burst_beside_a_decode(C)
    first = next(i for i, (d, _) in enumerate(steps) if d)
    last = max(i for i, (d, _) in enumerate(steps) if d)
    assert all(d for d, _ in steps[first:last + 1])                # dec gets its token every step
    with_dec = [p for d, p in steps if d]
    assert max(with_dec) == C                                      # the cap, and it is used
    assert sum(with_dec) >= 10 * 34                                # every prompt token rode beside dec
    assert sum(1 for p in with_dec if p) == -(-10 * 34 // C)       # in ceil(340 / C) steps: no step wasted


def test_prefill_cap_off_is_todays_step_and_a_step_without_decodes_keeps_the_whole_budget():
    steps, _ = _burst_beside_a_decode(0)
    assert max(p for d, p in steps if d) == 340                    # 0 = off: all ten in one step beside dec
    # nothing decoding when the burst arrives: the step takes max_num_tokens, not the cap
    s, ex = make(cap=1 << 16, max_batch_size=64, max_prefill_tokens_with_decodes=16)
    burst = [mk(f"p{i}", [6 + i] * 34, max_tokens=2) for i in range(10)]
    seen = []
    run_offline(s, ex, burst, observer=lambda b, o, t0, t1: seen.append(b))
    assert sum(sq.num_tokens for sq in seen[0].seqs if sq.is_prefill) == 340


def test_prefill_cap_chunks_a_long_prompt_beside_decodes_without_starving_it():
    C = 16
    s, ex = make(cap=1 << 16, max_batch_size=64, max_prefill_tokens_with_decodes=C)
    dec = mk("dec", [5] * 4, max_tokens=60)
    long_ = mk("long", [7] * 100, max_tokens=2, arrival=2.0)
    chunks = prefill_chunks(s, ex, [dec, long_], "long")
    assert len(long_.output_ids) == 2
    assert [n for n, _ in chunks] == [16] * 6 + [4] and all(d for _, d in chunks)   # ceil(100 / 16) steps


def test_prefill_cap_counts_only_the_tokens_a_prefix_hit_leaves_to_compute():
    system = list(range(10, 310))                                  # 300 tokens, cached by `a`
    s, ex = make(cap=4096, max_batch_size=64, max_prefill_tokens_with_decodes=16)
    dec = mk("dec", [5] * 4, max_tokens=80)
    a = mk("a", system + [5, 6, 7], max_tokens=2, arrival=1.0)
    b = mk("b", system + [8, 9], max_tokens=2, arrival=60.0)
    steps_b = []

    def obs(bt, o, t0, t1):
        n = sum(sq.num_tokens for sq in bt.seqs if sq.req_id == "b" and sq.is_prefill)
        if n:
            steps_b.append(n)
    run_offline(s, ex, [dec, a, b], observer=obs)
    assert b.num_cached == 300 and steps_b == [2]                  # one step: its 2 new tokens


def test_prefill_first_bounds_decode_starvation():
    m = 3
    s, ex = make(cap=1 << 16, max_batch_size=64, max_num_tokens=32, max_consecutive_prefill=m,
                 mixed_steps=False)
    dec = mk("dec", [5] * 4, max_tokens=60)
    reqs = [dec] + [mk(f"p{i}", [6 + i % 20] * 200, max_tokens=2, arrival=2.0 + i) for i in range(30)]
    steps = []

    def obs(b, o, t0, t1):
        steps.append(any(sq.req_id == "dec" for sq in b.seqs))
    run_offline(s, ex, reqs, observer=obs)
    first = steps.index(True)
    gaps, last = [], first
    for i, hit in enumerate(steps[first:], first):
        if hit:
            gaps.append(i - last)
            last = i
        if len(dec.output_ids) and i > first + 300:
            break
    assert max(gaps) <= m + 1


def test_decode_first_prefills_every_n_steps():
    N = 4
    s, ex = make(cap=1 << 16, max_batch_size=64, max_num_tokens=32, decode_first_prefill_every=N)
    dec = mk("dec", [5] * 4, max_tokens=100)
    reqs = [dec] + [mk(f"p{i}", [6 + i] * 100, max_tokens=2, arrival=2.0) for i in range(5)]
    kinds = []

    def obs(b, o, t0, t1):
        kinds.append("P" if s.stats().last_prefill_seqs else "D")
    run_offline(s, ex, reqs, observer=obs)
    seq = "".join(kinds)
    # between two prefill steps there are N decode steps while decodes exist
    body = seq[seq.index("P", 2):seq.rindex("P")]
    runs = [len(x) for x in body.split("P") if x]
    assert runs and max(runs) <= N
    assert "PP" not in seq[2:]                            # a decode never waits more than one prefill step
    assert all(r.state is RequestState.FINISHED for r in reqs)


def test_preemption_is_logged_and_counted(caplog):
    import logging
    caplog.set_level(logging.INFO, logger="shepherd.scheduler")
    s, ex = make(cap=128, admission="optimistic")
    reqs = [mk(f"r{i}", [5 + i] * 20, max_tokens=60) for i in range(4)]
    run_offline(s, ex, reqs)
    st = s.stats()
    assert st.preemptions > 0 and st.preempted_tokens > 0
    lines = [r for r in caplog.records if "preempt" in r.getMessage()]
    assert len(lines) == st.preemptions
    assert all(len(r.output_ids) == 60 for r in reqs)


def test_swap_preemption_round_trip():
    s, ex = make(cap=128, host=128, admission="optimistic", preemption="swap")
    reqs = [mk(f"r{i}", [5 + i] * 20, max_tokens=60) for i in range(4)]
    run_offline(s, ex, reqs)
    st = s.stats()
    assert st.swap_out_tokens > 0 and st.swap_in_tokens == st.swap_out_tokens
    assert ex.swapped_out_tokens == st.swap_out_tokens
    # same tokens as an undisturbed run
    s2, ex2 = make(cap=4096)
    ref = [mk(f"r{i}", [5 + i] * 20, max_tokens=60) for i in range(4)]
    run_offline(s2, ex2, ref)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in ref]


def test_debug_preempt_every_forces_preemptions():
    for mode in ("recompute", "swap"):
        s, ex = make(cap=4096, host=4096, debug_preempt_every=3, preemption=mode)
        reqs = [mk(f"r{i}", [5 + i] * 30, max_tokens=20) for i in range(3)]
        run_offline(s, ex, reqs)
        assert s.stats().preemptions >= 5
        s2, ex2 = make(cap=4096)
        ref = [mk(f"r{i}", [5 + i] * 30, max_tokens=20) for i in range(3)]
        run_offline(s2, ex2, ref)
        assert [r.output_ids for r in reqs] == [r.output_ids for r in ref]


def test_priority_takes_the_step_token_budget_first():
    s, ex = make(cap=8192, max_num_tokens=32, policy="priority")
    low = mk("low", [5] * 1000, max_tokens=2, priority=0)
    high = mk("high", [9] * 20, max_tokens=2, priority=3, arrival=3.0)
    run_offline(s, ex, [low, high])
    assert high.first_token_at - high.arrival <= 2       # not behind ~30 chunks of low's prompt
    assert high.finished_at < low.first_token_at
