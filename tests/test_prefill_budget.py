"""--max-prefill-ms-with-decodes: a time budget for the prompt tokens of a step that carries
decodes, turned into a token count from measured step times (engine/prefill_budget.py), and the
scheduler and simulator stepping with it. Step times come from fixed cost models on a virtual
clock: no sleeps, no wall clock."""
from __future__ import annotations

import math

import pytest

from shepherd.config import ConfigError, SchedulerConfig
from shepherd.engine.prefill_budget import FLOOR_TOKENS, PROBE_TOKENS, PrefillBudget
from shepherd.engine.sim_executor import SimExecutor
from shepherd.request import Request, SamplingParams
from shepherd.scheduler.scheduler import Scheduler
from sim_targets import prefill_chunks, run_offline

EOS = 2


def cpu_like(a=0.010, b=0.0011, c=0.0012):
    """A step on a 2-core CPU: a fixed part, each decode token b, each prompt token c."""
    return lambda d, p: a + b * d + c * p


def flat(a=0.020):
    """A GPU at small batches: the step costs the same whatever the tokens."""
    return lambda d, p: a + 1e-7 * d + 1e-7 * p


def feed(budget, model, d, p):
    return budget.observe(d, p, model(d, p))


def test_budget_converges_to_ms_over_the_prompt_token_cost():
    m = cpu_like()
    b = PrefillBudget(ms=30.0, max_tokens=2048)
    assert b.tokens == PROBE_TOKENS                        # nothing seen: a probe's worth
    for d in (1, 2, 3, 1, 2, 3, 4):
        feed(b, m, d, 0)
    assert b.tokens == PROBE_TOKENS                        # decodes only: still the probe
    feed(b, m, 2, 3)
    assert b.tokens == PROBE_TOKENS                        # 3 prompt tokens: too few to time
    for i in range(30):
        feed(b, m, 1 + i % 3, (5, 40, 120, 16)[i % 4])
        feed(b, m, 1 + i % 4, 0)
    assert b.per_token_s == pytest.approx(0.0012, rel=1e-3)
    assert b.tokens == int(0.030 / 0.0012)                 # 25 tokens: MS / c


def test_one_row_count_only_still_gives_the_budget():
    # one stream decoding (b not identified), then its neighbours' prompts
    m = cpu_like()
    b = PrefillBudget(ms=40.0, max_tokens=2048)
    for _ in range(50):
        feed(b, m, 1, 0)
    feed(b, m, 1, 13)                                      # one prompt beside it is enough to start,
    assert b.tokens == 2 * PROBE_TOKENS                    # up to twice the probe at first
    feed(b, m, 1, 13)
    assert b.tokens == int(0.040 / 0.0012)


def test_one_cheap_looking_step_does_not_open_the_budget_wide():
    """Issue 31's stall table at serve's defaults: the decode-only time was raised by the steps
    the earlier attacks slowed, the 16-token probe then looked cheap, and the next step took 94
    prompt tokens (a 0.12 s gap, 3.7x). The count at most doubles a prompt step, falls at once."""
    m = cpu_like()
    b = PrefillBudget(ms=30.0, max_tokens=2048)
    for _ in range(20):
        b.observe(1, 0, m(1, 0) + 0.015)                   # decode steps slowed by a busy spell
    b.observe(1, PROBE_TOKENS, m(1, PROBE_TOKENS))          # the probe: ~5 ms more than predicted
    assert b.per_token_s < 0.0005                          # it looks like 60+ tokens would fit in 30 ms
    assert b.tokens == 2 * PROBE_TOKENS
    last = b.tokens
    for i in range(60):                                    # the busy spell over: back to MS / c
        feed(b, m, 1, 0)
        feed(b, m, 1, min(b.tokens, 40))
        assert b.tokens <= 2 * last
        last = b.tokens
    assert b.tokens == int(0.030 / 0.0012)


def test_a_flat_machine_gets_the_whole_step_budget():
    m = flat()
    b = PrefillBudget(ms=20.0, max_tokens=2048)
    for i in range(40):
        feed(b, m, 1 + i % 8, 0)
        feed(b, m, 1 + i % 8, (32, 512, 2048)[i % 3])
    assert b.tokens == 2048


def test_one_slow_step_does_not_collapse_the_budget_and_a_lasting_change_is_followed():
    m = cpu_like()
    b = PrefillBudget(ms=30.0, max_tokens=2048)
    for i in range(40):
        feed(b, m, 1 + i % 3, 0)
        feed(b, m, 1 + i % 3, 25)
    steady = b.tokens
    assert steady == 25
    b.observe(2, 25, m(2, 25) + 0.100)                     # a 100 ms outlier
    assert b.tokens >= 0.6 * steady
    b.observe(2, 0, m(2, 0) + 0.100)                       # and one in a decode step
    for i in range(30):
        feed(b, m, 1 + i % 3, 0)
        feed(b, m, 1 + i % 3, 25)
    assert b.tokens == steady                              # gone again
    slow = cpu_like(a=0.020, b=0.0022, c=0.0024)           # one thread instead of two: every cost doubles
    for i in range(60):
        feed(b, slow, 1 + i % 3, 0)
        feed(b, slow, 1 + i % 3, 12)
    assert b.tokens == int(0.030 / 0.0024)


def test_the_budget_never_falls_under_the_floor():
    b = PrefillBudget(ms=1.0, max_tokens=2048)
    m = cpu_like(c=0.010)
    for i in range(20):
        feed(b, m, 1, 0)
        feed(b, m, 1, 20)
    assert b.tokens == FLOOR_TOKENS


def test_the_config_refuses_a_bad_time():
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ConfigError, match="max_prefill_ms_with_decodes"):
            SchedulerConfig(max_prefill_ms_with_decodes=bad).validate()
    SchedulerConfig(max_prefill_ms_with_decodes=0).validate()


# ---------------------------------------------------------------- scheduled steps on a virtual clock

def mk(rid, ids, max_tokens=8, arrival=0.0):
    return Request(rid, list(ids), SamplingParams(max_tokens=max_tokens), arrival=arrival, eos_token_ids=(EOS,))


def step_model(model):
    """SimExecutor's step_time from a (decode tokens, prompt tokens) cost model."""
    def t(batch):
        p = sum(sq.num_tokens for sq in batch.seqs if sq.is_prefill)
        d = sum(sq.num_tokens for sq in batch.seqs if not sq.is_prefill)
        return model(d, p)
    return t


def burst_beside_a_decode(model, n=10, prompt=34, **kw):
    """One stream decoding; its neighbours' prompts (9 to 60 tokens) arrive one at a time, then n
    prompts at once (issue 31's enum row). Per step: (dec decodes in it, prompt tokens, seconds)."""
    s = Scheduler(SchedulerConfig(max_total_tokens=1 << 16, max_batch_size=64, **kw), max_model_len=8192)
    ex = SimExecutor(kv_capacity=1 << 16, check=True, step_time=step_model(model))
    dec = mk("dec", [5] * 4, max_tokens=400)
    singles = [mk(f"s{i}", [30 + i] * (9 + 7 * i), max_tokens=3, arrival=0.3 + 0.2 * i) for i in range(8)]
    burst = [mk(f"p{i}", [6 + i] * prompt, max_tokens=2, arrival=2.5) for i in range(n)]
    steps = []

    def obs(b, o, t0, t1):
        steps.append((t0, any(sq.req_id == "dec" and not sq.is_prefill for sq in b.seqs),
                      s.last_work[1], t1 - t0, s.prefill_budget))
    run_offline(s, ex, [dec, *singles, *burst], observer=obs)
    assert all(len(r.output_ids) == 2 for r in burst) and len(dec.output_ids) == 400
    return steps


def test_steps_beside_decodes_keep_their_prompt_tokens_under_the_time_budget():
    m = cpu_like()
    steps = burst_beside_a_decode(m, max_prefill_ms_with_decodes=30.0)
    burst = [st for st in steps if st[0] >= 2.5 and st[1] and st[2]]
    # by the burst the budget is MS / c = 30 / 1.2 = 25 (24 once the burst's own decode rows, a row
    # count never seen in a decode-only step, are read as prompt cost: an error toward the cap)
    assert burst and all(24 <= st[4] <= 25 for st in burst)
    assert all(st[2] <= st[4] for st in burst)             # each step within the count it was handed
    # every prompt token rode beside dec (a chunk that stops one short leaves the last to a decode row)
    assert sum(st[2] for st in burst) >= 10 * (34 - 1)
    assert max(st[3] for st in burst) <= m(1, 0) + 0.030 + 10 * 0.0011 + 1e-9
    off = burst_beside_a_decode(m)
    assert max(st[2] for st in off if st[1]) == 340        # off: today's one step of all ten


def test_off_is_todays_steps():
    m = cpu_like()
    a = burst_beside_a_decode(m)
    b = burst_beside_a_decode(m, max_prefill_ms_with_decodes=0.0)
    assert a == b


def test_a_flat_machine_is_not_throttled():
    steps = burst_beside_a_decode(flat(), max_prefill_ms_with_decodes=5.0)
    assert max(st[2] for st in steps if st[1]) == 340      # all ten in one step, as with the budget off
    assert steps[-1][4] == 2048


def test_the_token_cap_and_the_time_budget_take_the_smaller():
    m = cpu_like()
    steps = burst_beside_a_decode(m, max_prefill_ms_with_decodes=30.0, max_prefill_tokens_with_decodes=16)
    assert max(st[2] for st in steps if st[1] and st[0] >= 2.5) == 16
    steps = burst_beside_a_decode(m, max_prefill_ms_with_decodes=30.0, max_prefill_tokens_with_decodes=64)
    assert max(st[2] for st in steps if st[1] and st[0] >= 2.5) == 25


def test_a_long_prompt_beside_decodes_still_finishes():
    m = cpu_like()
    s = Scheduler(SchedulerConfig(max_total_tokens=1 << 16, max_batch_size=64, max_prefill_ms_with_decodes=12.0),
                  max_model_len=8192)
    ex = SimExecutor(kv_capacity=1 << 16, check=True, step_time=step_model(m))
    dec = mk("dec", [5] * 4, max_tokens=200)
    warm = mk("w", [9] * 20, max_tokens=2, arrival=0.2)
    long_ = mk("long", [7] * 1000, max_tokens=2, arrival=0.6)
    chunks = prefill_chunks(s, ex, [dec, warm, long_], "long")
    assert len(long_.output_ids) == 2 and sum(n for n, _ in chunks) == 1000
    assert all(d for _, d in chunks) and max(n for n, _ in chunks) == 10   # 12 ms / 1.2 ms beside dec


def test_the_simulator_honours_the_time_budget_on_a_burst_of_admissions():
    """Roofline H100 steps (the simulator's own cost model): a stream decodes, prompts of growing
    length are admitted one by one, then ten 2,000-token prompts at once. The budget learned from
    the earlier prompts bounds the burst's steps, so the stream's longest gap shrinks; the budget
    the replica ended with is in its summary."""
    from shepherd.bench.records import TraceRequest
    from shepherd.sim.cost_model import RooflineCostModel
    from shepherd.sim.simulator import SimConfig, simulate

    def run(ms):
        tr = [TraceRequest(arrival=0.0, prompt_tokens=50, output_tokens=600, index=0)]
        tr += [TraceRequest(arrival=0.5 + 0.1 * i, prompt_tokens=100 + 300 * i, output_tokens=2, index=1 + i)
               for i in range(6)]
        tr += [TraceRequest(arrival=2.0, prompt_tokens=2000, output_tokens=4, index=10 + i) for i in range(10)]
        res = simulate(tr, SimConfig(scheduler=SchedulerConfig(max_prefill_ms_with_decodes=ms), kv_capacity=200_000),
                       RooflineCostModel("llama-3-8b", "h100"))
        assert all(r.ok for r in res.records)
        t = min(res.records, key=lambda r: r.arrival).token_times
        return max(b - a for a, b in zip(t, t[1:]) if a >= 2.0), res.replicas[0]

    off, rep_off = run(0.0)
    on, rep_on = run(10.0)
    assert "prefill_budget_tokens" not in rep_off
    assert FLOOR_TOKENS < rep_on["prefill_budget_tokens"] < 2048
    assert on < 0.5 * off


def test_a_first_burst_before_any_prompt_was_timed_is_probed_then_bounded():
    """Issue 31's enum row: the stream's own prompt ran before any decode (nothing to compare it
    with), so the ten arrive before a prompt token was ever timed. The first step beside the decode
    takes PROBE_TOKENS, and the ones after it the measured budget: no 340-token step."""
    m = cpu_like()
    s = Scheduler(SchedulerConfig(max_total_tokens=1 << 16, max_batch_size=64, max_prefill_ms_with_decodes=30.0),
                  max_model_len=8192)
    ex = SimExecutor(kv_capacity=1 << 16, check=True, step_time=step_model(m))
    dec = mk("dec", [5] * 12, max_tokens=200)
    burst = [mk(f"p{i}", [6 + i] * 34, max_tokens=2, arrival=1.0) for i in range(10)]
    steps = []
    run_offline(s, ex, [dec, *burst],
                observer=lambda b, o, t0, t1: steps.append((t0, s.last_work[0], s.last_work[1], s.prefill_budget)))
    beside = [st for st in steps if st[0] >= 1.0 and st[1] and st[2]]
    assert beside[0][2] == PROBE_TOKENS and beside[0][3] == PROBE_TOKENS
    assert all(24 <= st[3] <= 25 and st[2] <= st[3] for st in beside[1:])


def test_the_simulators_fast_path_feeds_the_budget_as_stepping_does():
    """The fast path takes most decode steps without EngineCore.step; it hands their times to the
    budget, so a run with it gives the same records as stepping one by one. (Before, the budget
    never saw a decode-only step there and stayed at its probe: H100 TTFT p99 3.3x off's.)"""
    from shepherd.bench import traces as T
    from shepherd.paths import data_path
    from shepherd.sim.simulator import SimConfig, simulate
    tr = T.load_trace(data_path("azure_llm_2023", "AzureLLMInferenceTrace_conv.csv"), limit=300)

    def run(fast):
        res = simulate(tr, SimConfig(scheduler=SchedulerConfig(max_prefill_ms_with_decodes=30.0), fast=fast,
                                     replicas=2, router="round-robin"))
        return ([(r.req_id, r.first_token, tuple(r.token_times), r.finish) for r in res.records],
                [r["prefill_budget_tokens"] for r in res.replicas], res)

    fast, budgets, res = run(True)
    slow, budgets_slow, _ = run(False)
    assert res.fast_steps > 0                             # the fast path did run
    assert fast == slow and budgets == budgets_slow
    assert all(PROBE_TOKENS < b for b in budgets)          # measured, not stuck at the probe


def test_serve_defaults_to_the_time_budget_and_zero_turns_it_off():
    import argparse
    from shepherd.config import SERVE_PREFILL_MS
    from shepherd.server import serve_cli
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    eng, _ = serve_cli.build_configs(p.parse_args([]))
    assert SERVE_PREFILL_MS == 30.0 and eng.scheduler.max_prefill_ms_with_decodes == SERVE_PREFILL_MS
    eng, _ = serve_cli.build_configs(p.parse_args(["--max-prefill-ms-with-decodes", "0"]))
    assert eng.scheduler.max_prefill_ms_with_decodes == 0.0
    assert SchedulerConfig().max_prefill_ms_with_decodes == 0.0          # the library and simulate: off


def test_a_decode_line_extrapolated_to_no_rows_never_predicts_negative_time():
    # decode steps of 10 and 20 rows on a line through -10 ms at 0 rows; a prefill-only step
    b = PrefillBudget(ms=30.0, max_tokens=2048)
    for i in range(10):
        b.observe(10 + 10 * (i % 2), 0, 0.010 + 0.020 * (i % 2))
    assert b.decode_time(0) == 0.0
    b.observe(0, 100, 0.120)                               # 100 prompt tokens alone: 1.2 ms each
    assert b.per_token_s == pytest.approx(0.0012)
