"""decode_horizon / fast_forward give exactly the state of stepping one by one."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shepherd.config import SchedulerConfig
from shepherd.request import Request, SamplingParams
from shepherd.scheduler.scheduler import Scheduler
from shepherd.engine.sim_executor import SimExecutor
from shepherd.step import StepResult
from sim_targets import targets


def workload(seed, n, shared):
    rng = random.Random(seed)
    out = []
    t = 0.0
    for i in range(n):
        t += rng.choice([0, 0, 1, 3, 10, 40])
        pre = [7] * rng.choice([0, shared])
        r = Request(f"r{i}", pre + [rng.randint(3, 90) for _ in range(rng.randint(1, 60))],
                    SamplingParams(max_tokens=rng.randint(1, 120)), arrival=float(t), eos_token_ids=(2,),
                    client=f"c{i % 3}", priority=i % 2)
        if rng.random() < 0.7:
            r.sim_output_len = rng.randint(1, 100)
        out.append(r)
    return out


def snapshot(s: Scheduler):
    st = s.stats().__dict__.copy()
    reqs = {}
    for e in s.queues.all():
        r = e.req
        reqs[r.req_id] = (r.state, list(r.output_ids), list(r.slots), r.num_computed, e.cached_len)
    return st, reqs, s.kv.pool.free_list(), s.new_token_ratio


def tokens_upto(ex, r, k):
    """The next k tokens the executor samples for r; only the last may be EOS."""
    st = ex.seqs[r.req_id]
    n = len(r.output_ids)
    prev = r.all_ids[-1]
    out = []
    for j in range(k):
        prev = ex.next_token(st, n + j, prev)
        out.append(prev)
    return out


def tokens_ahead(ex, r, k):
    """The next k tokens, or None if one of them would stop r (EOS)."""
    toks = tokens_upto(ex, r, k)
    if not r.params.ignore_eos and any(t in ex.eos_token_ids or t == ex.eos_token_id for t in toks):
        return None
    return toks


def drive(cfg, reqs, fast: bool, check_every=True, finishing=False):
    s = Scheduler(cfg, host_kv_capacity=cfg.max_total_tokens // 2, max_model_len=512)
    ex = SimExecutor(kv_capacity=cfg.max_total_tokens, host_kv_capacity=cfg.max_total_tokens // 2,
                     step_time=lambda b: 1.0, check=not fast, output_lens=targets(reqs))
    reqs = sorted(reqs, key=lambda r: r.arrival)
    now, i, steps, ff_steps = 0.0, 0, 0, 0
    trace = []
    while i < len(reqs) or s.has_work:
        while i < len(reqs) and reqs[i].arrival <= now:
            s.add(reqs[i], now)
            i += 1
        if not s.has_work:
            now = reqs[i].arrival
            continue
        if fast:
            h = s.decode_horizon(now, finishing=finishing)
            k = h
            for r in s.running:
                t = ex.target_len(ex.seqs[r.req_id])
                if t is not None:
                    k = min(k, t - len(r.output_ids) - (0 if finishing else 1))
            if i < len(reqs):
                k = min(k, int(reqs[i].arrival - now + 0.999999))
            if k >= 1:
                if finishing:   # the k-th step may end requests (EOS or max_tokens)
                    toks = {r.req_id: tokens_upto(ex, r, k) for r in s.running}
                else:
                    toks = {r.req_id: tokens_ahead(ex, r, k) for r in s.running}
                now += k
                s.fast_forward(k, toks, now)
                steps += k
                ff_steps += k
                trace.append((steps, snapshot(s)))
                continue
        b = s.schedule(now)
        res = ex.execute(b) if not b.empty else None
        if res is not None:
            now += res.step_time
        s.on_step(b, res or StepResult(), now)
        steps += 1
        trace.append((steps, snapshot(s)))
    s.check_integrity()
    return s, trace, ff_steps


CONFIGS = [
    dict(admission="optimistic"),
    dict(admission="optimistic", page_size=4),
    dict(admission="guaranteed"),
    dict(admission="peak"),
    dict(admission="peak", page_size=4),
    dict(admission="optimistic", policy="lpm"),
    dict(admission="optimistic", policy="vtc"),
    dict(admission="optimistic", preemption="swap"),
    dict(admission="optimistic", decode_first_prefill_every=3),
    dict(admission="optimistic", debug_preempt_every=7),
    dict(admission="optimistic", policy="lof", n=90),
    dict(admission="optimistic", n=90),
    dict(admission="peak", policy="priority", n=90),
    dict(admission="optimistic", policy="vtc", n=90),
    dict(admission="optimistic", mixed_steps=False),
    dict(admission="peak", mixed_steps=False, n=90),
    dict(admission="optimistic", decode_first_prefill_every=3, mixed_steps=False),
    dict(admission="optimistic", multi_step=3, mixed_steps=False),
    dict(admission="optimistic", max_prefill_tokens_with_decodes=8),
    dict(admission="optimistic", max_prefill_tokens_with_decodes=8, multi_step=3, n=90),
    dict(admission="optimistic", max_prefill_tokens_with_decodes=8, decode_first_prefill_every=3),
]


@pytest.mark.parametrize("extra", CONFIGS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
@settings(max_examples=int(__import__("os").environ.get("FF_EXAMPLES", "6")), deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), cap=st.sampled_from([256, 512, 2048]), finishing=st.booleans())
def test_fast_forward_equals_stepping(extra, seed, cap, finishing):
    extra = dict(extra)
    n = extra.pop("n", 25)
    cfg = SchedulerConfig(max_total_tokens=cap, max_batch_size=8, max_num_tokens=64,
                          new_token_ratio_decay_steps=50, aging_steps=60, **extra)
    a_reqs = workload(seed, n, 24)
    b_reqs = workload(seed, n, 24)
    _, slow, _ = drive(cfg, a_reqs, fast=False)
    _, fast, ff = drive(cfg, b_reqs, fast=True, finishing=finishing)
    slow_at = dict(slow)
    for steps, snap in fast:
        assert steps in slow_at
        assert snap == slow_at[steps], f"diverged at step {steps}"
    assert [r.output_ids for r in a_reqs] == [r.output_ids for r in b_reqs]
    assert [r.finished_at for r in a_reqs] == [r.finished_at for r in b_reqs]
    assert [r.finish_reason for r in a_reqs] == [r.finish_reason for r in b_reqs]


def test_fast_forward_actually_skips():
    cfg = SchedulerConfig(max_total_tokens=4096, max_batch_size=16, max_num_tokens=256)
    reqs = []
    for i in range(8):
        r = Request(f"r{i}", [5 + i] * 20, SamplingParams(max_tokens=200), eos_token_ids=(2,))
        reqs.append(r)
    s, trace, ff = drive(cfg, reqs, fast=True)
    assert ff >= 150 * 1     # most decode steps went through fast_forward
    assert all(len(r.output_ids) == 200 for r in reqs)


def test_fast_forward_refuses_beyond_horizon():
    s = Scheduler(SchedulerConfig(max_total_tokens=1024), max_model_len=512)
    r = Request("a", [5] * 10, SamplingParams(max_tokens=5), eos_token_ids=(2,))
    s.add(r, 0.0)
    ex = SimExecutor(kv_capacity=1024)
    b = s.schedule(0.0)
    s.on_step(b, ex.execute(b), 1.0)
    assert s.decode_horizon(1.0) == 3                    # 4 tokens left; the one that ends it excluded
    h = s.decode_horizon(1.0, finishing=True)
    assert h == 4                                         # ... or included, as the last step
    with pytest.raises(ValueError):
        s.fast_forward(h + 1, {"a": [5] * (h + 1)}, 2.0)
    with pytest.raises(ValueError):
        s.fast_forward(2, {"a": [2, 5]}, 2.0)     # EOS before the last token
    assert r.output_ids == [r.output_ids[0]] and s.stats().finished == 0


@pytest.mark.parametrize("last", [5, 2])
def test_fast_forward_ends_requests_at_its_last_step(last):
    """max_tokens reached (LENGTH) or EOS (STOP) at the k-th step: the request ends there, its KV is
    released as on_step would, and the others keep running."""
    from shepherd.request import FinishReason
    s = Scheduler(SchedulerConfig(max_total_tokens=1024), max_model_len=512)
    a = Request("a", [5] * 10, SamplingParams(max_tokens=4 if last == 5 else 50), eos_token_ids=(2,))
    b = Request("b", [6] * 10, SamplingParams(max_tokens=50), eos_token_ids=(2,))
    for r in (a, b):
        s.add(r, 0.0)
    ex = SimExecutor(kv_capacity=1024)
    batch = s.schedule(0.0)
    s.on_step(batch, ex.execute(batch), 1.0)
    outs = s.fast_forward(3, {"a": [7, 7, last], "b": [8, 8, 8]}, 4.0)
    assert [(o.req_id, o.finished) for o in outs] == [("a", True), ("b", False)]
    assert outs[0].finish_reason is (FinishReason.LENGTH if last == 5 else FinishReason.STOP)
    assert a.finished_at == 4.0 and s.running == [b]
    assert s.stats().finished == 1 and a.slots == []      # its KV went back (to the prefix cache)
    assert s.schedule(4.0).finished == ["a"]   # the executor hears of it with the next batch
