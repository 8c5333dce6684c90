"""Issue 30's physics and defaults: a fitted cost model never prices a step past its
profiled range below the roofline, a request longer than the model's context is
rejected (and shown with its reason), and vtc stays fair under the default knobs."""
from __future__ import annotations

import pytest

from shepherd.bench.records import TraceRequest
from shepherd.bench.report import format_table
from shepherd.config import SchedulerConfig
from shepherd.sim.cost_model import BatchShape, RooflineCostModel
from shepherd.sim.fitted_cost import FittedCostModel, from_vidur
from shepherd.sim.simulator import SimConfig, simulate


def test_fitted_model_past_its_profiled_range_never_falls_below_the_roofline():
    roof = RooflineCostModel("llama-3-8b", "h100")
    fl = roof.linear_floor()
    # a table whose last two points slope down (as vidur's transferred H100 profile does at 4k)
    fit = FittedCostModel(grid_tokens=[1, 2048, 4096], grid_s=[0.006, 0.050, 0.040], floor=fl)
    assert fit.profiled_tokens == (1, 4096)
    # inside the range: the table, untouched
    assert fit.shape_time(BatchShape(num_tokens=2048, num_seqs=1)) == pytest.approx(0.050)
    assert (fit.beyond_steps, fit.floored_steps) == (0, 0)
    # 8,192 tokens: not 0.040 + slope x 4096 (a negative slope, 0.030 s), not even 0.040: the roofline's
    # linear layers, max(weights + activations / bandwidth, FLOPs / peak), by hand
    x = 8192
    floor = max(fl["mem_a"] + fl["mem_tok"] * x, fl["c_tok"] * x)
    assert floor == pytest.approx(2 * 6.98e9 * x / (989e12 * 0.6), rel=0.01)   # compute-bound: ~193 ms
    assert fit.shape_time(BatchShape(num_tokens=x, num_seqs=1)) == pytest.approx(floor)
    assert (fit.beyond_steps, fit.floored_steps) == (1, 1)
    # a rising tail is extrapolated where that is above the floor (counted beyond, not floored)
    up = FittedCostModel(grid_tokens=[1, 4096], grid_s=[0.5, 1.0], floor=fl)
    assert up.shape_time(BatchShape(num_tokens=8192, num_seqs=1)) == pytest.approx(1.0 + 4096 * 0.5 / 4095)
    assert (up.beyond_steps, up.floored_steps) == (1, 0)
    # no floor known (an old calibrated file): extrapolated, never downwards
    flat = FittedCostModel(grid_tokens=[1, 2048, 4096], grid_s=[0.006, 0.050, 0.040])
    assert flat.shape_time(BatchShape(num_tokens=8192, num_seqs=1)) == pytest.approx(0.040)
    # the JSON round trip keeps the floor
    assert FittedCostModel.from_json(fit.to_json()).floor == fl


def test_vidur_h100_8k_prefill_costs_at_least_the_roofline_and_the_run_says_how_many_steps():
    cm = from_vidur("llama-3-8b", "h100")
    lo, hi = cm.profiled_tokens
    assert hi == 4096
    t4, t8 = (cm.shape_time(BatchShape.prefill(n)) for n in (4096, 8192))
    assert t8 > 2 * t4 * 0.95           # before the clamp, 8k tokens cost less than 4k (a falling last pair)
    tr = [TraceRequest(arrival=0.0, prompt_tokens=6000, output_tokens=4, index=0),
          TraceRequest(arrival=0.0, prompt_tokens=100, output_tokens=4, index=1)]
    res = simulate(tr, SimConfig(model="llama-3-8b", gpu="h100", router="round-robin",
                                 scheduler=SchedulerConfig(max_num_tokens=8192)), cost_model=cm)
    s = res.summary()
    cr = s["sim"]["cost_model_range"]
    assert cr["profiled_tokens"] == [1, 4096]
    assert cr["steps_beyond"] == 1 and cr["steps_at_roofline_floor"] == 1   # the one 6,100-token step
    assert "1 steps beyond the profiled 4,096 tokens" in format_table(s)


def test_requests_longer_than_the_models_context_are_rejected_and_reported_with_their_reason():
    tr = [TraceRequest(arrival=0.0, prompt_tokens=8191, output_tokens=10, index=0),    # fits: 8,191 + 1
          TraceRequest(arrival=0.1, prompt_tokens=8192, output_tokens=10, index=1),    # one too many
          TraceRequest(arrival=0.2, prompt_tokens=12000, output_tokens=10, index=2),
          TraceRequest(arrival=0.3, prompt_tokens=100, output_tokens=10, index=3)]
    res = simulate(tr, SimConfig(model="llama-3-8b", gpu="h100", router="round-robin"))
    assert res.max_model_len == 8192
    assert [r.ok for r in res.records] == [True, False, False, True]
    assert [r.error_kind for r in res.records] == [None, "context_length", "context_length", None]
    # the first one ran to the context's end: 8,191 + 1 output token, then LENGTH (as the engine caps it)
    assert res.records[0].output_tokens == 1
    s = res.summary()
    assert s["rejections"]["context_length"]["count"] == 2
    assert "max_model_len=8192" in s["rejections"]["context_length"]["reason"]
    table = format_table(s)
    assert "4 (2 completed, 2 rejected)" in table
    assert "rejected: context_length  2: prompt has 8192 tokens" in table
    # the same trace on Llama-3.1-8B (131,072 positions) is served whole
    long = simulate(tr, SimConfig(model="llama-3.1-8b", gpu="h100", router="round-robin"))
    assert all(r.ok for r in long.records) and long.summary()["rejections"] == {}


def test_concurrency_rejections_are_shown_beside_completions():
    tr = [TraceRequest(arrival=0.0, prompt_tokens=50, output_tokens=50, index=i) for i in range(6)]
    res = simulate(tr, SimConfig(router="round-robin", scheduler=SchedulerConfig(max_concurrency=4)))
    s = res.summary()
    assert s["rejections"] == {"concurrency_full": {"count": 2, "reason": "too many requests in flight (4)"}}
    table = format_table(s)
    assert "6 (4 completed, 2 rejected)" in table
    assert "raise --max-concurrency" in table


@pytest.mark.parametrize("aging", [None, 200])
def test_vtc_with_the_default_knobs_serves_two_backlogged_clients_in_turn(aging):
    """Hand-computed: one request runs at a time (max_batch_size 1); 30 requests of client B
    then 30 of A arrive at t=0, each 10 tokens in and 10 out, so each takes 10 steps (a
    prefill step that samples the first token, 9 decodes) and charges 10 + 2 x 10 = 30. VTC
    alternates: B (tie at 0, B arrived first), A (0 < 30), B (tie at 30, B's next is older),
    A, ... so finishes alternate B, A, B, A and the gap between the clients' service never
    exceeds one request's charge. With aging reordering vtc's queue (the old default, 200
    steps), after 20 requests (200 steps) every waiting request has aged and the rest run in
    arrival order: B's 20 left, then A's."""
    tr = [TraceRequest(arrival=0.0, prompt_tokens=10, output_tokens=10, client=c, index=i)
          for i, c in enumerate(["B"] * 30 + ["A"] * 30)]
    knobs = dict(policy="vtc", max_batch_size=1, max_total_tokens=4096)
    if aging is not None:
        knobs["aging_steps"] = aging
    res = simulate(tr, SimConfig(router="round-robin", kv_capacity=4096, scheduler=SchedulerConfig(**knobs)))
    order = [r.client for r in sorted(res.records, key=lambda r: r.finish)]
    assert order == ["B", "A"] * 30
    served = {"A": 0, "B": 0}
    gap = 0
    for c in order:
        served[c] += 30
        gap = max(gap, abs(served["A"] - served["B"]))
    assert gap == 30
    # what aging made of it: arrival order, as fcfs serves it
    old = simulate(tr, SimConfig(router="round-robin", kv_capacity=4096,
                                 scheduler=SchedulerConfig(policy="fcfs", max_batch_size=1, max_total_tokens=4096)))
    assert [r.client for r in sorted(old.records, key=lambda r: r.finish)] == ["B"] * 30 + ["A"] * 30
