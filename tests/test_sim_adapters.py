"""LoRA adapters in the simulator: the simulated executor charges each adapter load
(host -> adapter slot) to the step that makes the adapter resident, the per-step adapter limit
is the scheduler's own, and `--adapters N` draws Zipf-popular adapters. Hand-computed times."""
from __future__ import annotations

import collections

import pytest

from shepherd.bench import synthetic as S
from shepherd.bench.records import TraceRequest
from shepherd.config import SchedulerConfig
from shepherd.engine.sim_executor import SimExecutor
from shepherd.request import Request, SamplingParams
from shepherd.scheduler.scheduler import Scheduler
from shepherd.sim import sim_cli
from shepherd.sim.cost_model import LORA_LOAD_S, RooflineCostModel
from shepherd.sim.simulator import SimConfig, simulate
from sim_targets import run_offline

EOS = 2


def mk(rid, adapter, out, arrival=0.0):
    r = Request(rid, [3 + len(rid)] * 16, SamplingParams(max_tokens=out + 8), arrival=arrival,
                eos_token_ids=(EOS,), adapter=adapter)
    r.sim_output_len = out
    return r


def make(load, **kw):
    s = Scheduler(SchedulerConfig(max_total_tokens=4096, **kw), host_kv_capacity=0, max_model_len=4096)
    return s, SimExecutor(kv_capacity=4096, check=True, step_time=lambda b: 1.0, lora_load_time=load)


def test_one_slot_two_adapters_hand_computed():
    """--max-loras 1, steps of 1 s, loads of 0.5 s; A and B (2 tokens each) both at t=0.
    t=0: A's prefill + load A (1.5 s); B waits: no second adapter in a step.
    t=1.5: A's decode (1 s), its 2nd token is EOS: A ends at 2.5.
    t=2.5: B's prefill + load B into A's slot (1.5 s); t=4.0: B's decode: B ends at 5.0."""
    a, b = mk("a", "A", 2), mk("b", "B", 2)
    s, ex = make(0.5, max_loras=1)
    steps = []
    run_offline(s, ex, [a, b], observer=lambda batch, outs, t0, t1: steps.append(
        (t0, t1, [ld.name for ld in batch.lora_loads], sorted(q.req_id for q in batch.seqs))))
    assert steps == [(0.0, 1.5, ["A"], ["a"]), (1.5, 2.5, [], ["a"]),
                     (2.5, 4.0, ["B"], ["b"]), (4.0, 5.0, [], ["b"])]
    assert (a.finished_at, b.finished_at) == (2.5, 5.0)
    assert ex.lora_loads == 2 and ex.lora_load_s == 1.0
    assert ex.take_lora_loads() == [0.5, 0.5] and ex.take_lora_loads() == []


def test_two_slots_load_once_and_share_steps():
    """--max-loras 2: A and B run in one step from t=0, each loaded once (1 s + 2 x 0.5 s);
    the base-model request beside them loads nothing."""
    reqs = [mk("a", "A", 3), mk("b", "B", 3), mk("c", None, 3)]
    s, ex = make(0.5, max_loras=2)
    run_offline(s, ex, reqs)
    assert [r.finished_at for r in reqs] == [4.0, 4.0, 4.0]      # 2.0, then two 1 s decodes
    assert ex.lora_loads == 2


def test_every_step_pays_exactly_its_loads():
    reqs = [mk(f"r{i}", None if i % 5 == 0 else f"ad{i % 7}", 2 + i % 5, arrival=i * 0.7) for i in range(80)]
    s, ex = make(0.25, max_loras=3, max_batch_size=6)
    seen = []

    def obs(batch, outs, t0, t1):
        assert t1 - t0 == pytest.approx(1.0 + 0.25 * len(batch.lora_loads))
        assert len({r.adapter for r in reqs if r.req_id in {q.req_id for q in batch.seqs}} - {None}) <= 3
        seen.append(len(batch.lora_loads))
    run_offline(s, ex, reqs, observer=obs)
    assert sum(seen) == ex.lora_loads >= 7 and ex.lora_load_s == pytest.approx(0.25 * ex.lora_loads)


def test_with_adapters_is_zipf_and_leaves_the_workload_alone():
    base = S.synthetic(S.SyntheticSpec(clients=[S.ClientSpec("c", rate=5.0)], num_requests=20000, seed=3))
    plain = [(r.arrival, r.prompt_tokens, r.output_tokens) for r in base]
    got = list(S.with_adapters(iter(base), S.adapter_names(4), zipf=1.0, seed=3))
    assert [(r.arrival, r.prompt_tokens, r.output_tokens) for r in got] == plain
    freq = collections.Counter(r.adapter for r in got)
    h = 1 + 1 / 2 + 1 / 3 + 1 / 4
    for k in range(4):                  # P(k) = 1 / ((k + 1) H)
        assert freq[f"lora-{k}"] / len(got) == pytest.approx(1 / ((k + 1) * h), abs=0.015)
    uni = collections.Counter(r.adapter for r in S.with_adapters(iter(base), S.adapter_names(4), zipf=0.0))
    assert all(abs(n / len(got) - 0.25) < 0.015 for n in uni.values())
    again = [r.adapter for r in S.with_adapters(iter(base), S.adapter_names(4), zipf=1.0, seed=3)]
    assert again == [r.adapter for r in got]


def test_simulator_charges_the_load_to_every_later_token():
    """One adapter, every request at t=0: the load happens once, in the first step, so every
    request's first token and finish come exactly `load` seconds later than with free loads."""
    cost = RooflineCostModel("smollm2-135m", "cpu")
    tr = [TraceRequest(arrival=0.0, prompt_tokens=40, output_tokens=12, index=i, adapter="lora-0") for i in range(6)]
    sched = SchedulerConfig(max_loras=1)

    def run(load):
        res = simulate([TraceRequest(**vars(t)) for t in tr],
                       SimConfig(model="smollm2-135m", gpu="cpu", scheduler=sched, kv_capacity=4096,
                                 adapter_load_time=load), cost)
        return {r.req_id: (r.first_token, r.finish) for r in res.records}
    free, paid = run(0.0), run(0.75)
    for rid, (f0, e0) in free.items():
        assert paid[rid][0] == pytest.approx(f0 + 0.75) and paid[rid][1] == pytest.approx(e0 + 0.75)
    assert SimConfig().adapter_load_time is None and LORA_LOAD_S > 0     # None: the engine's measured figure


def test_simulator_keeps_the_per_step_adapter_limit():
    cost = RooflineCostModel("smollm2-135m", "cpu")
    base = [TraceRequest(arrival=0.01 * i, prompt_tokens=30, output_tokens=8, index=i) for i in range(60)]
    tr = list(S.with_adapters(iter(base), S.adapter_names(6), zipf=0.5, seed=1))
    adapter = {f"r{t.index}": t.adapter for t in tr}
    for fast in (False, True):
        res = simulate(tr, SimConfig(model="smollm2-135m", gpu="cpu", scheduler=SchedulerConfig(max_loras=2),
                                     kv_capacity=4096, record_batches=True, fast=fast), cost)
        assert len(res.records) == 60 and all(r.ok for r in res.records)
        assert max(len({adapter[rid] for rid, _, _ in seqs}) for _, _, seqs in res.batches) == 2


def test_simulate_cli_adapters(tmp_path):
    import argparse
    p = argparse.ArgumentParser()
    sim_cli.add_arguments(p)
    args = p.parse_args(["--out", str(tmp_path), "--model", "smollm2-135m", "--gpu", "cpu", "--rate", "20",
                         "--num-requests", "60", "--input-len", "fixed:32", "--output-len", "fixed:8",
                         "--adapters", "12", "--max-loras", "3", "--adapter-load-time", "0.01", "--no-plots",
                         "--no-progress"])
    assert sim_cli.scheduler_config(args).max_loras == 3
    reqs, n = sim_cli.build_workload(args)
    names = {r.adapter for r in reqs}
    assert n == 60 and names <= set(S.adapter_names(12)) and "lora-0" in names
    assert sim_cli.main(args) == 0


def test_bench_sends_the_adapter_as_model():
    from shepherd.bench import bench_cli, loadgen
    from shepherd.bench.prompts import BuiltPrompt
    assert bench_cli.adapter_names("sql, chat", "http://x") == ["sql", "chat"]
    cfg = loadgen.LoadConfig(url="http://x")
    tr = TraceRequest(arrival=0.0, prompt_tokens=4, output_tokens=2, adapter="sql")
    br = loadgen.BenchRequest(req_id="b0", trace=tr, prompt=BuiltPrompt(text="hi", prefix="", tokens=1))
    assert loadgen.request_body(cfg, br, "base")["model"] == "sql"
    tr.adapter = None
    assert loadgen.request_body(cfg, br, "base")["model"] == "base"
