"""The simulator (sim/simulator.py): determinism, the decode fast path against
one-by-one stepping, the same schedule as a plain schedule/execute loop,
prefix hits on a Mooncake slice, routing, and the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from shepherd.bench.records import TraceRequest
from shepherd.config import SchedulerConfig
from shepherd.paths import data_path
from shepherd.request import Request, SamplingParams
from shepherd.bench import synthetic as S
from shepherd.bench import traces as T
from shepherd.sim.cost_model import BatchShape, RooflineCostModel
from shepherd.sim.simulator import SimConfig, Simulator, simulate

DATA = Path(__file__).parent / "data"


def synth(n=150, seed=3, rate=6.0, clients=2, **kw):
    spec = S.SyntheticSpec(clients=[S.ClientSpec(f"c{i}", rate=rate / clients, input_len="lognormal:400:0.8",
                                                 output_len="lognormal:120:0.9", **kw) for i in range(clients)],
                           num_requests=n, seed=seed)
    return S.synthetic(spec)


def key(r):
    return (r.req_id, r.client, r.arrival, r.first_token, tuple(r.token_times), r.finish, r.preemptions,
            r.output_tokens, r.ok, r.error_kind, r.replica, r.cached_tokens, tuple(r.intervals))


def run(trace, **kw):
    # round-robin: routing reads no replica state, so replicas run ahead in long fast-forwards
    kw.setdefault("router", "round-robin")
    sched = kw.pop("scheduler", SchedulerConfig())
    return simulate(trace, SimConfig(scheduler=sched, **kw))


def test_deterministic_for_a_seed():
    tr = synth()
    a = run(tr, replicas=2, router="random", seed=5)
    b = run(synth(), replicas=2, router="random", seed=5)
    assert [key(r) for r in a.records] == [key(r) for r in b.records]
    assert all(r.ok and r.finish is not None for r in a.records)
    c = run(synth(seed=4), replicas=2, router="random", seed=5)
    assert [key(r) for r in a.records] != [key(r) for r in c.records]


@pytest.mark.parametrize("sched,preempts", [
    (SchedulerConfig(), False),                                                       # roomy
    (SchedulerConfig(max_total_tokens=3000, admission="optimistic"), True),          # recompute
    (SchedulerConfig(max_total_tokens=3000, admission="optimistic", preemption="swap"), True),
    (SchedulerConfig(max_total_tokens=3000, admission="guaranteed"), False),
    (SchedulerConfig(max_total_tokens=3000, admission="peak", max_batch_size=16), False),
    (SchedulerConfig(max_total_tokens=4000, policy="vtc"), False),
], ids=["roomy", "recompute", "swap", "guaranteed", "peak", "vtc"])
def test_fast_path_equals_step_by_step(sched, preempts):
    tr = synth(n=120, rate=16.0)
    kv = sched.max_total_tokens if sched.max_total_tokens != SchedulerConfig.max_total_tokens else None
    slow = run(tr, replicas=2, scheduler=sched, kv_capacity=kv, fast=False)
    fast = run(tr, replicas=2, scheduler=sched, kv_capacity=kv, fast=True)
    assert fast.fast_steps > 0.5 * fast.steps, (fast.fast_steps, fast.steps)
    assert slow.steps == fast.steps
    assert [key(r) for r in slow.records] == [key(r) for r in fast.records]
    assert slow.preemptions == fast.preemptions
    if preempts:
        assert fast.preemptions > 0
    else:
        assert sched.admission == "optimistic" or fast.preemptions == 0


def test_fast_path_with_eos_before_max_tokens():
    tr = synth(n=80, rate=5.0)
    slow = run(tr, max_tokens=2048, fast=False)
    fast = run(tr, max_tokens=2048, fast=True)
    assert [key(r) for r in slow.records] == [key(r) for r in fast.records]
    assert [r.output_tokens for r in fast.records] == [t.output_tokens for t in sorted(tr, key=lambda x: x.arrival)]


def test_preemption_happens_under_pressure():
    tr = synth(n=120, rate=16.0)
    res = run(tr, scheduler=SchedulerConfig(admission="optimistic"), kv_capacity=3000)
    assert res.preemptions > 0
    assert any(iv[0] == "preempted" for r in res.records for iv in r.intervals)
    g = run(tr, scheduler=SchedulerConfig(admission="guaranteed"), kv_capacity=3000)
    assert g.preemptions == 0


def plain_loop(trace, sched_cfg, cost, kv, vocab):
    """A plain schedule/execute loop with the shared SimExecutor: the reference schedule."""
    from shepherd.scheduler.scheduler import Scheduler
    from shepherd.sim.replica import SimTokens

    ex = SimTokens(kv_capacity=kv, host_kv_capacity=kv if sched_cfg.preemption == "swap" else 0, max_model_len=kv,
            step_time=cost.step_time, swap_time_per_token=0.0, vocab_size=vocab)
    sc = SchedulerConfig(**{**sched_cfg.__dict__, "max_total_tokens": kv})
    sched = Scheduler(sc, host_kv_capacity=ex.host_kv_capacity, max_model_len=kv)
    pending = sorted(trace, key=lambda t: t.arrival)
    batches = []
    clock = 0.0
    i = 0
    while i < len(pending) or sched.has_work:
        if not sched.has_work and clock < pending[i].arrival:
            clock = pending[i].arrival
        while i < len(pending) and pending[i].arrival <= clock:
            tr = pending[i]
            sched.add(Request(req_id=f"r{tr.index}", prompt_ids=T.prompt_token_ids(tr, vocab),
                              params=SamplingParams(max_tokens=tr.output_tokens, temperature=0.0, ignore_eos=True),
                              arrival=tr.arrival, client=tr.client, eos_token_ids=(2,)), tr.arrival)
            i += 1
        batch = sched.schedule(clock)
        if batch.empty:
            if i < len(pending):
                clock = pending[i].arrival
                continue
            break
        batches.append((0, clock, [(s.req_id, s.start_pos, len(s.token_ids)) for s in batch.seqs]))
        res = ex.execute(batch)
        clock += res.step_time
        sched.on_step(batch, res, clock)
    return batches


@pytest.mark.parametrize("admission", ["optimistic", "peak"])
def test_same_batches_as_plain_loop(admission):
    tr = synth(n=100, rate=8.0)
    sched = SchedulerConfig(admission=admission, max_num_tokens=512)
    cost = RooflineCostModel("llama-3-8b", "h100")
    ref = plain_loop(tr, sched, cost, 5000, 128256)
    for fast in (False, True):
        res = simulate(tr, SimConfig(scheduler=sched, kv_capacity=5000, fast=fast, record_batches=True), cost)
        assert len(res.batches) == len(ref)
        assert res.batches == ref


def expected_hits(reqs, vocab=128256):
    """Prompt tokens an unlimited prefix cache serves: the longest common prefix
    of each prompt with any earlier prompt (equal hash ids give equal blocks; a
    prompt's last block may be cut short), capped below the prompt length (at
    least one token is computed)."""
    ids = [T.prompt_token_ids(r, vocab) for r in reqs]
    hits = 0
    for i, a in enumerate(ids):
        best = 0
        for b in ids[:i]:
            n = 0
            for x, y in zip(a, b):
                if x != y:
                    break
                n += 1
            best = max(best, n)
        hits += min(best, len(a) - 1)
    return hits


def test_mooncake_fixture_prefix_hits():
    tr = T.load_trace(DATA / "mooncake_5.jsonl")
    res = run(tr, model="llama-3-8b", gpu="h100")
    exp = expected_hits(tr)
    # blocks [0,1] shared; [0,1,2] shared with a prompt whose block 2 was cut at 1500 tokens; [5]
    assert exp == 1024 + 1500 + 512
    assert res.prefix_hit_tokens == exp
    assert res.prefix_query_tokens == sum(r.prompt_tokens for r in tr)
    assert [r.cached_tokens for r in res.records] == [0, 1024, 1500, 0, 512]
    off = run(tr, scheduler=SchedulerConfig(prefix_cache=False))
    assert off.prefix_hit_tokens == 0


def test_mooncake_real_slice_prefix_hits():
    # arrivals slowed 20x so that every request has finished (and its prompt is in the
    # cache) before the next one; a KV pool larger than the slice so nothing is evicted
    tr = T.load_trace(data_path("mooncake", "synthetic_trace.jsonl"), limit=60, time_scale=20.0)
    res = run(tr, model="llama-3-8b", gpu="h100", kv_capacity=1_200_000, max_model_len=131072)
    exp = expected_hits(tr)
    assert exp > 29_000
    assert res.prefix_hit_tokens == exp
    assert all(r.ok for r in res.records)


def test_routing_policies_and_capacity():
    tr = synth(n=120, rate=10.0)
    for router in ("round-robin", "least-request", "power-of-two"):
        res = run(tr, replicas=3, router=router)
        assert all(r.ok for r in res.records)
        assert {r.replica for r in res.records} == {0, 1, 2}
    sim = Simulator(SimConfig(model="llama-3-8b", gpu="h100"))
    assert sim.kv_capacity == RooflineCostModel("llama-3-8b", "h100").kv_capacity_tokens()


def test_request_that_never_fits_is_a_counted_failure():
    tr = [TraceRequest(arrival=0.0, prompt_tokens=3000, output_tokens=10, index=0),
          TraceRequest(arrival=0.1, prompt_tokens=100, output_tokens=10, index=1)]
    res = run(tr, kv_capacity=2000)
    assert [r.ok for r in res.records] == [False, True]
    assert res.records[0].error_kind == "kv_capacity"
    assert res.rejections == {"kv_capacity": {"count": 1, "reason": (
        "prompt has 3000 tokens; with one output token it exceeds the KV capacity of 2000 tokens")}}


def test_cli_writes_summary(tmp_path):
    from shepherd.cli import main
    out = tmp_path / "o"
    rc = main(["simulate", "--trace", str(DATA / "azure_conv_20.csv"), "--replicas", "2", "--out", str(out),
               "--no-progress", "--slo-ttft", "0.5", "--slo-tpot", "0.05", "--records"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["requests"] == 20 and s["completed"] == 20
    assert s["goodput_req_s"] is not None
    assert (out / "timeline.png").exists() and (out / "kv.png").exists()
    assert len((out / "records.jsonl").read_text().splitlines()) == 20
    rc = main(["simulate", "--rate", "3", "--clients", "a=1,b=2", "--num-requests", "30", "--out",
               str(tmp_path / "s"), "--no-progress", "--no-plots", "--model", "llama-2-7b", "--gpu", "a10g"])
    assert rc == 0
    s = json.loads((tmp_path / "s" / "summary.json").read_text())
    assert set(s["per_client"]) == {"a", "b"}
    assert main(["simulate", "--trace", str(tmp_path / "missing.csv"), "--out", str(tmp_path / "x"),
                 "--format", "azure"]) == 2


def test_simulate_refuses_an_empty_workload_and_a_rate_of_zero(tmp_path, capsys):
    # a trace with only its header simulated 0 requests and wrote a report of nothing (exit 0);
    # --rate 0 read as "no --rate" (exit 1, "give --trace FILE, or --rate R")
    from shepherd.cli import main
    empty = tmp_path / "empty.csv"
    empty.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    assert main(["simulate", "--trace", str(empty), "--out", str(tmp_path / "e"), "--no-progress"]) == 2
    assert "the workload is empty" in capsys.readouterr().err
    assert not (tmp_path / "e" / "summary.json").exists()
    assert main(["simulate", "--rate", "0", "--out", str(tmp_path / "z"), "--no-progress"]) == 2
    assert "rate must be > 0" in capsys.readouterr().err
    assert main(["simulate", "--out", str(tmp_path / "n"), "--no-progress"]) == 2
    assert "give --trace FILE" in capsys.readouterr().err


@pytest.mark.parametrize("flags,msg", [
    (["--page-size", "0"], "--page-size must be >= 1, got 0"),              # was ZeroDivisionError
    (["--mem-fraction", "2"], "--mem-fraction must be > 0 and <= 1"),       # ran
    (["--mem-fraction", "0"], "--mem-fraction must be > 0 and <= 1"),       # "does not fit"
    (["--limit", "-1"], "--limit must be >= 0"),                            # "Stop argument for islice()"
    (["--rate", "nan"], "--rate must be > 0"),
    (["--arrival", "gamma", "--burstiness", "0"], "--burstiness must be > 0"),  # ZeroDivisionError
    (["--gpu-price", "h100=-1"], "--gpu-price 'h100=-1': VALUE must be a number > 0"),  # negative dollars
    (["--input-len", "uniform:5:1"], "bad length distribution 'uniform:5:1'"),  # "empty range for randrange()"
    (["--input-len", "fixed:1000000000000"], "lengths 1..10,000,000"),      # numpy ArrayMemoryError
])
def test_simulate_refuses_bad_flags_with_one_line(tmp_path, capsys, flags, msg):
    from shepherd.cli import main
    argv = ["simulate", "--rate", "5", "--num-requests", "5", "--out", str(tmp_path / "o"), "--no-progress",
            "--no-plots"]
    if "--rate" in flags:
        del argv[1:3]
    assert main(argv + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("shepherd simulate: ") and msg in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("out,msg", [("file", "is a file, not a folder"), ("/proc/x", "cannot be written")])
def test_simulate_checks_out_before_running(tmp_path, capsys, out, msg):
    # were FileExistsError / FileNotFoundError tracebacks
    from shepherd.cli import main
    if out == "file":
        out = tmp_path / "f"
        out.write_text("x")
    assert main(["simulate", "--rate", "5", "--num-requests", "5", "--out", str(out), "--no-progress"]) == 2
    assert f"shepherd simulate: --out {out}: {msg}" in capsys.readouterr().err


def test_outputs_cut_at_the_context_are_counted_in_the_summary(tmp_path, capsys):
    # a trace output past max_model_len - prompt was generated only that far, without a word
    from shepherd.cli import main
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n"
                     "2023-11-16 18:15:47.68,374,9000000\n")
    assert main(["simulate", "--trace", str(trace), "--out", str(tmp_path / "o"), "--no-progress", "--no-plots",
                 "--max-model-len", "4096"]) == 0
    assert "output clipped       1: trace outputs longer than max_model_len=4096" in capsys.readouterr().out
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["output_clipped"]["count"] == 1


def test_request_that_outgrows_the_pool_alone_ends_with_an_error_record():
    # Optimistic admission takes it (the prompt fits); decoding then needs more KV than the
    # whole pool, and the scheduler ends it with an error inside schedule(). The simulator
    # must still hand that terminal output to the record, even though no batch ran.
    tr = [TraceRequest(arrival=0.0, prompt_tokens=1500, output_tokens=1000, index=0)]
    res = run(tr, kv_capacity=2000, max_model_len=4096,
              scheduler=SchedulerConfig(admission="optimistic", max_total_tokens=2000))
    (rec,) = res.records
    assert rec.ok is False and rec.error_kind == "error"
    assert rec.finish is not None and 0 < rec.output_tokens < 1000


@pytest.mark.parametrize("router", ["least-request", "prefix-aware"])
def test_quiet_replicas_skipped_by_count_routers_give_the_same_records(router):
    tr = synth(n=300, rate=12.0, system_prompt_tokens=64)
    a = run(tr, replicas=4, router=router, skip_quiet=True)
    b = run(tr, replicas=4, router=router, skip_quiet=False)
    assert [key(r) for r in a.records] == [key(r) for r in b.records]
    assert a.routing == b.routing


def test_chunk_token_blocks_equal_per_request_blocks():
    """The fast path's one-pass tokens for a chunk are each request's own token_block."""
    from shepherd.request import SamplingParams
    from shepherd.sim.replica import SimTokens
    from shepherd.step import NewRequest, ScheduledBatch

    exe = SimTokens(eos_token_id=2, vocab_size=128256, output_lens={"r0": 41, "r3": 10_000})  # r0: EOS at its 41st
    exe.execute(ScheduledBatch(step=0, new=[NewRequest(f"r{i}", [5 + 977 * i, 128000 - i], SamplingParams(max_tokens=99))
                                            for i in range(5)]))
    running = [(f"r{i}", i) for i in range(5)]     # (request, its output tokens so far)
    for k in (38, 41, 200):
        assert exe.token_blocks(running, k) == {rid: exe.token_block(rid, n, k) for rid, n in running}
    assert exe.token_blocks(running, 41)["r0"][-1] == 2 and 2 not in exe.token_blocks(running, 38)["r0"]


def test_run_leaves_the_process_gc_threshold_as_it_found_it():
    import gc
    old = gc.get_threshold()
    try:
        gc.set_threshold(123, 4, 5)
        run(synth(), replicas=2)
        assert gc.get_threshold() == (123, 4, 5)
    finally:
        gc.set_threshold(*old)


def _two_requests(multi_step):
    """A decodes alone; B arrives 1.5 decode steps after A's prefill, i.e. mid-window."""
    cost = RooflineCostModel("llama-3-8b", "h100").set_overhead(1e-3, 0.0)
    sched = SchedulerConfig(mixed_steps=False, max_consecutive_prefill=0, prefix_cache=False, multi_step=multi_step)
    gpu_step = cost.decode_step_time(1, 100) - 1e-3
    prefill = cost.shape_time(BatchShape.prefill(100))
    tr = [TraceRequest(arrival=0.0, prompt_tokens=100, output_tokens=13, index=0),
          TraceRequest(arrival=prefill + 1.5 * gpu_step, prompt_tokens=100, output_tokens=5, index=1)]
    res = simulate(tr, SimConfig(scheduler=sched, kv_capacity=5000, record_batches=True), cost)
    return res, gpu_step


def test_multi_step_admits_only_at_window_ends_and_pays_the_fixed_overhead_once_per_window():
    one, _ = _two_requests(1)
    win, gpu_step = _two_requests(4)
    a1, b1 = sorted(one.records, key=lambda r: r.arrival)
    a4, b4 = sorted(win.records, key=lambda r: r.arrival)
    # step by step, B's prefill runs right after the decode step in flight when it arrives;
    # with windows of 4 it waits for A's fourth decode step: its first token comes later
    starts = {rid: t for _, t, seqs in win.batches for rid, pos, n in seqs if n > 1}
    a_decodes = [t for _, t, seqs in win.batches if seqs[0][2] == 1 and len(seqs) == 1]
    assert starts[b4.req_id] == pytest.approx(a_decodes[3] + gpu_step, rel=1e-4)
    assert b4.first_token > b1.first_token + gpu_step
    # a window's first step pays the 1 ms fixed overhead, its other three do not
    gaps = [t1 - t0 for t0, t1 in zip(a_decodes, a_decodes[1:4])]
    assert gaps[0] == pytest.approx(gpu_step + 1e-3, rel=1e-3)
    assert gaps[1] == pytest.approx(gpu_step, rel=1e-3) and gaps[2] == pytest.approx(gpu_step, rel=1e-3)
    # A's 12 decode tokens: 3 windows of 4 instead of 12 steps that each pay 1 ms
    assert a1.finish - a4.finish == pytest.approx(12e-3 - 3e-3, rel=0.05)


def test_multi_step_hands_a_window_of_tokens_out_at_its_end():
    res, _ = _two_requests(4)
    a = min(res.records, key=lambda r: r.arrival)
    times = a.token_times
    assert len(times) == 13 and times[0] == a.first_token
    # the prefill's token alone, then A's 12 decode tokens in 3 windows of 4, each window's
    # tokens at one time (its end), as vLLM v0.6's clients receive them
    groups = [times[1 + 4 * w: 5 + 4 * w] for w in range(3)]
    assert all(len(set(g)) == 1 for g in groups)
    assert len({g[0] for g in groups}) == 3 and a.finish == groups[-1][0]


def test_multi_step_runs_a_prefill_as_one_step_then_one_window_over_everyone():
    """vLLM v0.6.0 with chunked prefill off (checked against its source: a prefill batch
    holds no decodes and gets no lookahead slots, so it runs one step and is not cached
    as a window). A and B decode in windows of 4; C arrives 1.5 steps into their first
    window. Hand-computed step sequence: 0 prefill A+B | 1-4 decode A,B | 5 prefill C
    alone | 6-9 decode A,B,C. So A and B lose one step to C's prefill, not a window:
    had the prefill opened a window of C alone, steps 6-8 would decode C only."""
    cost = RooflineCostModel("llama-3-8b", "h100").set_overhead(1e-3, 0.0)
    sched = SchedulerConfig(mixed_steps=False, max_consecutive_prefill=0, prefix_cache=False, multi_step=4)
    prefill = cost.shape_time(BatchShape.prefill(100) + BatchShape.prefill(100))
    mid = prefill + 1.5 * cost.decode_step_time(2, 2 * 101)
    tr = [TraceRequest(arrival=0.0, prompt_tokens=100, output_tokens=20, index=0),
          TraceRequest(arrival=0.0, prompt_tokens=100, output_tokens=20, index=1),
          TraceRequest(arrival=mid, prompt_tokens=100, output_tokens=20, index=2)]
    res = simulate(tr, SimConfig(scheduler=sched, kv_capacity=5000, record_batches=True), cost)
    a, b, c = (r.req_id for r in sorted(res.records, key=lambda r: (r.arrival, r.req_id)))
    steps = [(sorted(rid for rid, _, _ in seqs), all(n > 1 for _, _, n in seqs)) for _, _, seqs in res.batches]
    assert steps[0] == (sorted([a, b]), True)
    assert steps[1:5] == [(sorted([a, b]), False)] * 4
    assert steps[5] == ([c], True)
    assert steps[6:10] == [(sorted([a, b, c]), False)] * 4
    # A's tokens reach its client at the end of step 0 (its prefill's), then at the ends of
    # its windows, steps 4 and 9: C's prefill step sits between them, unpaid by a window
    starts = [t for _, t, _ in res.batches]
    rec_a = next(r for r in res.records if r.req_id == a)
    assert rec_a.token_times[0] == pytest.approx(starts[1])
    assert rec_a.token_times[1:5] == pytest.approx([starts[5]] * 4)
    assert rec_a.token_times[5:9] == pytest.approx([starts[10]] * 4)


def test_overlap_output_hides_a_small_batchs_output_processing_behind_the_forward():
    tr = [TraceRequest(arrival=0.0, prompt_tokens=100, output_tokens=20, index=i) for i in range(4)]
    sched = SchedulerConfig(mixed_steps=False, prefix_cache=False)

    def ends(seq, overlap, fast=True):
        cost = RooflineCostModel("llama-3-8b", "h100").set_overhead(1e-3, seq, overlap=overlap)
        res = simulate(tr, SimConfig(scheduler=sched, kv_capacity=5000, fast=fast), cost)
        return sorted(r.token_times[-1] for r in res.records)

    bare = ends(0.0, False)
    # 4 x 100 us of output processing: added to the prefill step and each of the 19 decode
    # steps, or hidden behind them
    assert ends(100e-6, False) == pytest.approx([t + 20 * 4e-4 for t in bare], abs=1e-9)
    assert ends(100e-6, True) == pytest.approx(bare, abs=1e-9)
    assert ends(100e-6, True, fast=False) == ends(100e-6, True)
    # 4 x 3 ms of CPU outlasts the forward (~7 ms for the prefill, ~6.5 ms a decode): each of
    # the 20 steps takes 1 + 12 ms
    assert ends(3e-3, True) == pytest.approx([20 * 13e-3] * 4, abs=1e-9)
    assert ends(3e-3, True, fast=False) == pytest.approx([20 * 13e-3] * 4, abs=1e-9)


def test_frontend_latency_adds_to_every_ttft_and_moves_the_engine_side_with_it():
    """`--frontend-latency` / calibrate's measured frontend: the engine takes each request in
    that much later, so TTFT and end-to-end latency grow by exactly it and the steps are the
    same ones, shifted."""
    tr = [TraceRequest(arrival=0.05 * i, prompt_tokens=100, output_tokens=20, index=i) for i in range(6)]
    sched = SchedulerConfig(prefix_cache=False)

    def run(frontend):
        cost = RooflineCostModel("llama-3-8b", "h100")
        cost.frontend = frontend
        res = simulate(tr, SimConfig(scheduler=sched, kv_capacity=5000), cost)
        return sorted(res.records, key=lambda r: r.req_id)

    bare, late = run(0.0), run(0.02)
    assert [r.arrival for r in late] == [r.arrival for r in bare]       # the client's clock
    assert [r.ttft for r in late] == pytest.approx([r.ttft + 0.02 for r in bare], abs=1e-9)
    assert [r.e2e for r in late] == pytest.approx([r.e2e + 0.02 for r in bare], abs=1e-9)
    with pytest.raises(ValueError):
        from shepherd.sim.fitted_cost import make_cost_model
        make_cost_model(frontend=-1.0)


def test_cli_flags_of_vllm_v06_serving_reach_the_scheduler():
    # the documented vLLM v0.6 command: prefill-only or decode-only steps, windows of 10
    import argparse
    from shepherd.sim import sim_cli
    p = argparse.ArgumentParser()
    sim_cli.add_arguments(p)
    cfg = sim_cli.scheduler_config(p.parse_args(["--out", "o", "--no-mixed-steps", "--max-consecutive-prefill",
                                                 "0", "--multi-step", "10", "--no-prefix-cache"]))
    assert (cfg.mixed_steps, cfg.max_consecutive_prefill, cfg.multi_step, cfg.prefix_cache) == (False, 0, 10, False)
    assert sim_cli.scheduler_config(p.parse_args(["--out", "o"])).mixed_steps is True


def test_simulate_takes_the_prefill_cap_beside_decodes():
    import argparse
    from shepherd.sim import sim_cli
    p = argparse.ArgumentParser()
    sim_cli.add_arguments(p)
    cfg = sim_cli.scheduler_config(p.parse_args(["--out", "o", "--max-prefill-tokens-with-decodes", "32"]))
    assert cfg.max_prefill_tokens_with_decodes == 32
    assert sim_cli.scheduler_config(p.parse_args(["--out", "o"])).max_prefill_tokens_with_decodes == 0
    cfg = sim_cli.scheduler_config(p.parse_args(["--out", "o", "--max-prefill-ms-with-decodes", "25"]))
    assert cfg.max_prefill_ms_with_decodes == 25.0
    assert sim_cli.scheduler_config(p.parse_args(["--out", "o"])).max_prefill_ms_with_decodes == 0.0
