"""`shepherd simulate`: the real scheduler and routing policies over a trace, on a virtual clock.

    shepherd simulate --trace FILE [--format azure|mooncake|ragpulse|burstgpt|servegen|vidur|synthetic]
        [--model NAME] [--gpu NAME] [--tp N] [--replicas N] [--router POLICY [--router-knob K=V ...]]
        [--max-total-tokens N] [--max-batch-size N] [--max-num-tokens N] [--admission MODE]
        [--preemption MODE] [--policy NAME] [--no-prefix-cache] [--page-size N]
        [--fleet 2xh100,1xa100-80gb/tp2 | 1xa100-80gb/tp2@prefill,2xa100-80gb@decode [--pd-threshold N]]
        [--gpu-price GPU=$ ...] [--gpu-power GPU=W ...]
        [--time-scale X] [--limit N] [--rate R] [--cost-model FILE|roofline|vidur|splitwise|distserve]
        [--slo-ttft S --slo-tpot S] --out DIR

Without --trace, a synthetic workload from flags: --rate/--clients, --num-requests
or --duration, --input-len/--output-len distributions, --shared-prefix, --turns.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from shepherd.bench.trace_formats import FORMATS
from shepherd.config import (ADAPTER_POLICIES, ADMISSION_MODES, INF, POLICIES, PREEMPTION_MODES, VICTIMS, VTC_UNITS,
                             ConfigError, SchedulerConfig, SpeculativeConfig, check_ranges)


def add_scheduler_arguments(p: argparse.ArgumentParser) -> None:
    s = SchedulerConfig()
    k = p.add_argument_group("scheduler (as in `shepherd serve`)")
    k.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV capacity per replica in tokens (default: GPU memory x --mem-fraction minus weights)")
    k.add_argument("--max-batch-size", type=int, default=s.max_batch_size)
    k.add_argument("--max-num-tokens", type=int, default=s.max_num_tokens)
    k.add_argument("--max-prefill-tokens-with-decodes", type=int, default=s.max_prefill_tokens_with_decodes,
                   help="prompt tokens in a step that carries running decodes, at most (0 = off)")
    k.add_argument("--max-prefill-ms-with-decodes", type=float, default=s.max_prefill_ms_with_decodes,
                   help="the same as a time: prompt tokens beside decodes add about MS ms to a step, the "
                        "count derived from the cost model's step times as serve derives it (0 = off)")
    k.add_argument("--max-concurrency", type=int, default=s.max_concurrency)
    k.add_argument("--max-queue", type=int, default=s.max_queue)
    k.add_argument("--page-size", type=int, default=s.page_size)
    k.add_argument("--host-kv-tokens", type=int, default=0, help="swap pool per replica (0 = device size)")
    k.add_argument("--admission", choices=ADMISSION_MODES, default=s.admission)
    k.add_argument("--preemption", choices=PREEMPTION_MODES, default=s.preemption)
    k.add_argument("--victim", choices=VICTIMS, default=s.victim)
    k.add_argument("--policy", choices=POLICIES, default=s.policy)
    k.add_argument("--no-prefix-cache", action="store_true")
    k.add_argument("--no-mixed-steps", action="store_true",
                   help="a step is prefill-only or decode-only (vLLM v0 without chunked prefill)")
    k.add_argument("--max-consecutive-prefill", type=int, default=s.max_consecutive_prefill)
    k.add_argument("--decode-first-prefill-every", type=int, default=s.decode_first_prefill_every)
    k.add_argument("--multi-step", type=int, default=s.multi_step,
                   help="vLLM v0.6 --num-scheduler-steps: decode windows of N steps, nothing joins inside one, "
                        "the fixed step overhead paid once per window, tokens handed out at its end")
    k.add_argument("--aging-steps", type=int, default=s.aging_steps,
                   help="a request waiting this many steps is served first (lof, random, lpm, dfs-weight, "
                        "priority; vtc and fcfs do not reorder by age) and is never overtaken when it does not fit")
    k.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding as in serve; the simulated drafts are accepted with "
                        "acceptance_rate each, and a verify costs its rows as tokens")
    k.add_argument("--max-loras", type=int, default=s.max_loras,
                   help="LoRA adapters resident at once, so at most this many in one step (with --adapters)")
    k.add_argument("--adapter-policy", choices=ADAPTER_POLICIES, default=s.adapter_policy)
    k.add_argument("--adapter-cycle-time", type=float, default=s.adapter_cycle_time)
    k.add_argument("--vtc-unit", choices=VTC_UNITS, default=s.vtc_unit)


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--adapters", type=int, default=0, metavar="N",
                   help="each request names one of N LoRA adapters (lora-0 .. lora-N-1), Zipf-popular")
    w.add_argument("--adapter-zipf", type=float, default=1.0, metavar="S",
                   help="adapter k (from 0) is asked with probability ~ 1/(k+1)^S (0: uniform)")
    w.add_argument("--trace", default=None, help="trace file (Azure CSV, Mooncake or RAGPulse JSONL, BurstGPT CSV, multi-tenant (servegen) CSV, vidur CSV, synthetic JSON)")
    w.add_argument("--format", choices=FORMATS, default=None,
                   help="trace format (default: from the file)")
    w.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    w.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply arrival times (0.5 = twice as fast)")
    w.add_argument("--rate", type=float, default=None,
                   help="with --trace: rescale arrivals to this mean req/s; without: Poisson rate of one client")
    w.add_argument("--clients", default=None, help="synthetic clients: 'a=1.5,b=3' (req/s each) or 'N@R'")
    w.add_argument("--num-requests", type=int, default=None, help="synthetic: number of requests")
    w.add_argument("--duration", type=float, default=None, help="synthetic: seconds of arrivals")
    w.add_argument("--input-len", default="fixed:256", help="synthetic: N | uniform:A:B | lognormal:MEAN:SIGMA "
                                                            "| normal:M:S | exp:MEAN | zipf:A:MAX | trace:FILE")
    w.add_argument("--output-len", default="fixed:256")
    w.add_argument("--arrival", choices=["poisson", "gamma", "constant"], default="poisson")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma arrivals: CV of inter-arrival times")
    w.add_argument("--shared-prefix", type=int, default=0, help="synthetic: shared system prompt tokens")
    w.add_argument("--turns", type=int, default=1, help="synthetic: turns per session (rates are of sessions)")
    w.add_argument("--think-time", type=float, default=10.0, help="synthetic: mean seconds between turns")
    w.add_argument("--diurnal", type=float, default=0.0,
                   help="synthetic: daily swing of the rate, 0..1 (rate x (1 - A cos(2 pi t / 86400)))")
    w.add_argument("--prefix-groups", type=int, default=1,
                   help="synthetic: distinct shared system prompts (with --shared-prefix)")
    w.add_argument("--repeat", type=int, default=1, help="with --trace: replay the trace N times back to back")
    w.add_argument("--seed", type=int, default=0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    c = p.add_argument_group("cluster")
    c.add_argument("--model", default="llama-3-8b", help="llama-3-8b | llama-2-7b | llama-2-70b | smollm2-135m")
    c.add_argument("--gpu", default="h100", help="h100 | h200 | a100-80gb | a10g | cpu")
    c.add_argument("--tp", type=int, default=1, choices=[1, 2, 4, 8], help="tensor parallel per replica")
    c.add_argument("--replicas", type=int, default=1)
    c.add_argument("--fleet", default=None, metavar="SPEC",
                   help="replica groups instead of --replicas/--gpu/--tp: COUNTxGPU[/tpN][@prefill|@decode],... "
                        "e.g. '2xh100,2xa100-80gb/tp2' (heterogeneous) or '1xa100-80gb/tp2@prefill,2xa100-80gb@decode' "
                        "(prefill/decode disaggregation); every group has its own cost model (--cost-model)")
    c.add_argument("--pd-threshold", type=int, default=0, metavar="N",
                   help="with prefill replicas: disaggregate a request when at least N of its prompt tokens are "
                        "not cached on its decode replica (llm-d / Dynamo's conditional decider; 0: always)")
    c.add_argument("--pd-link-gbs", type=float, default=50.0, metavar="GB/S",
                   help="KV transfer bandwidth between a prefill and a decode replica (default: PCIe 5 x16)")
    c.add_argument("--pd-link-latency", type=float, default=0.5e-3, metavar="S", help="seconds per KV transfer")
    c.add_argument("--gpu-price", action="append", default=[], metavar="GPU=$",
                   help="$ per GPU-hour, over the preset's (cost per million tokens, goodput per dollar)")
    c.add_argument("--gpu-power", action="append", default=[], metavar="GPU=W", help="board power per GPU, W")
    c.add_argument("--router", default="least-request",
                   help="routing policy (shepherd/routing/; default %(default)s, as `shepherd gateway --policy`)")
    c.add_argument("--router-knob", action="append", default=[], metavar="K=V", help="routing policy knob")
    c.add_argument("--cost-model", default=None,
                   help="roofline (default), vidur, splitwise, distserve (OPT-13B on A100-80GB), or a JSON file "
                        "from `shepherd calibrate`")
    c.add_argument("--step-overhead", type=float, default=None, metavar="S",
                   help="per-step CPU/launch overhead, seconds (default: the GPU preset's, e.g. H100 0.00045, "
                        "or what `shepherd calibrate` measured)")
    c.add_argument("--seq-overhead", type=float, default=None, metavar="S",
                   help="per-step overhead per request in the batch, seconds (default: preset / calibrated)")
    c.add_argument("--overlap-output", action="store_true", default=None,
                   help="vLLM v0.6's asynchronous output processing: the per-request overhead runs on the CPU "
                        "while the GPU computes the next step, so a step costs step-overhead + max(GPU time, "
                        "seq-overhead x batch) instead of their sum")
    c.add_argument("--host-path", default=None, metavar="FILE|default",
                   help="price each step's CPU from shepherd's own engine, part by part (schedule, prepare, "
                        "sample, update; the front process beside them): a profile of `shepherd calibrate "
                        "--host-path`, or 'default' for the one shipped (measured once, on the machine its meta names); "
                        "replaces --step-overhead / --seq-overhead and the cost model's own overhead")
    c.add_argument("--frontend-latency", type=float, default=None, metavar="S",
                   help="seconds added to every request's TTFT for the serving frontend (HTTP, tokenising, "
                        "the pipe to the engine and back; default: what `shepherd calibrate --served` measured, "
                        "else 0)")
    c.add_argument("--adapter-load-time", type=float, default=None, metavar="S",
                   help="seconds one LoRA adapter load (host -> adapter slot) adds to its step (default: the "
                        "engine's measured shepherd:lora_load_seconds on this machine, sim/cost_model.LORA_LOAD_S)")
    c.add_argument("--mem-fraction", type=float, default=0.9, help="GPU memory for weights + KV")
    c.add_argument("--max-model-len", type=int, default=None)
    c.add_argument("--max-tokens", type=int, default=None,
                   help="requests ask for this many tokens and stop (EOS) at the trace's length; "
                        "default: max_tokens = the trace's output length")
    add_scheduler_arguments(p)
    q = p.add_argument_group("search (--search: the cheapest configuration that meets --slo-ttft/--slo-tpot)")
    q.add_argument("--search", action="store_true",
                   help="simulate every configuration of the grid below on the workload; print the cheapest that "
                        "meets the SLOs and the Pareto set of $/hour against SLO attainment (search.json)")
    q.add_argument("--slo-attainment", type=float, default=0.9, help="fraction of all requests within both SLOs")
    q.add_argument("--budget", type=float, default=None, metavar="$/H", help="most $/hour a fleet may cost")
    q.add_argument("--search-gpus", default="a100-80gb,h100,h200")
    q.add_argument("--search-tp", default="1,2")
    q.add_argument("--search-replicas", default="1,2,4,8")
    q.add_argument("--search-max-batch", default="256")
    q.add_argument("--search-chunk", default="2048", help="max_num_tokens values")
    q.add_argument("--search-admission", default="optimistic")
    q.add_argument("--search-routers", default="least-request")
    q.add_argument("--search-pd", default="0", help="prefill replicas per fleet (0: no disaggregation)")
    o = p.add_argument_group("output")
    o.add_argument("--out", required=True, help="output folder (summary.json, records, plots)")
    o.add_argument("--slo-ttft", type=float, default=None, help="goodput: TTFT SLO, seconds")
    o.add_argument("--slo-tpot", type=float, default=None, help="goodput: TPOT SLO, seconds")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--records", action="store_true", help="also write records.jsonl (every token time; large)")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--slow", action="store_true", help="step one by one (no decode fast path)")
    o.add_argument("--title", default="")


# (flag, lowest, highest, strict) checked before anything runs (config.check_ranges): --page-size 0
# and --burstiness 0 divided by zero, --mem-fraction 2 ran, --limit -1 spoke of islice()
SIM_RANGES = [("limit", 0, INF, False), ("num_requests", 0, INF, False), ("duration", 0, INF, True),
              ("time_scale", 0, INF, True), ("rate", 0, INF, True), ("burstiness", 0, INF, True),
              ("mem_fraction", 0, 1, True), ("page_size", 1, INF, False), ("replicas", 1, INF, False),
              ("repeat", 1, INF, False), ("turns", 1, INF, False), ("think_time", 0, INF, False),
              ("shared_prefix", 0, 10_000_000, False), ("prefix_groups", 1, INF, False),
              ("max_total_tokens", 1, INF, False), ("max_model_len", 1, INF, False),
              ("max_tokens", 1, INF, False), ("host_kv_tokens", 0, INF, False),
              ("slo_ttft", 0, INF, True), ("slo_tpot", 0, INF, True)]


def scheduler_config(args) -> SchedulerConfig:
    cfg = SchedulerConfig(
        max_total_tokens=args.max_total_tokens or SchedulerConfig.max_total_tokens,
        max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
        max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
        max_prefill_ms_with_decodes=args.max_prefill_ms_with_decodes,
        max_concurrency=args.max_concurrency, max_queue=args.max_queue, page_size=args.page_size,
        admission=args.admission, preemption=args.preemption, victim=args.victim, policy=args.policy,
        prefix_cache=not args.no_prefix_cache, mixed_steps=not args.no_mixed_steps,
        max_consecutive_prefill=args.max_consecutive_prefill,
        decode_first_prefill_every=args.decode_first_prefill_every, multi_step=args.multi_step,
        aging_steps=args.aging_steps, seed=args.seed, max_loras=args.max_loras,
        adapter_policy=args.adapter_policy, adapter_cycle_time=args.adapter_cycle_time, vtc_unit=args.vtc_unit,
        speculative=SpeculativeConfig.from_json(args.speculative_config))
    return cfg


def build_workload(args):
    """(requests, count or None): a lazy iterator in arrival order; memory does not
    grow with the trace's length or with --rate x --num-requests."""
    from shepherd.bench import synthetic as S
    from shepherd.bench import traces as T
    reqs, n = _workload(args, S, T)
    if args.adapters < 0:
        raise ValueError(f"--adapters {args.adapters}: must be >= 0")
    if args.adapters:
        reqs = S.with_adapters(reqs, S.adapter_names(args.adapters), args.adapter_zipf, args.seed)
    return reqs, n


def _workload(args, S, T):
    if args.trace:
        return T.iter_trace(args.trace, args.format, limit=args.limit, time_scale=args.time_scale,
                            rate=args.rate, seed=args.seed, repeat=args.repeat), None
    if args.clients:
        clients = S.parse_clients(args.clients, input_len=args.input_len, output_len=args.output_len,
                                  arrival=args.arrival, cv=args.burstiness,
                                  system_prompt_tokens=args.shared_prefix, turns=args.turns)
    elif args.rate is not None:        # 0 too: ClientSpec refuses it ("rate must be > 0")
        clients = [S.ClientSpec("default", rate=args.rate, input_len=args.input_len, output_len=args.output_len,
                                arrival=args.arrival, cv=args.burstiness, system_prompt_tokens=args.shared_prefix,
                                turns=args.turns)]
    else:
        raise ValueError("give --trace FILE, or --rate R / --clients SPEC for a synthetic workload")
    for c in clients:
        c.think_time = args.think_time
        c.diurnal = args.diurnal
        c.num_system_prompts = args.prefix_groups
    n = args.num_requests if args.num_requests is not None else args.limit
    if n is None and args.duration is None:
        n = 1000
    spec = S.SyntheticSpec(clients=clients, num_requests=n, duration=args.duration, seed=args.seed)
    reqs = S.iter_synthetic(spec)
    if args.time_scale != 1.0:
        reqs = _scaled(reqs, args.time_scale)
    return reqs, n if args.duration is None else None


def _scaled(reqs, k: float):
    if k <= 0:
        raise ValueError("time_scale must be > 0")
    for r in reqs:
        r.arrival *= k
        yield r


def run_title(args) -> str:
    """Every plot's title: the workload, router, replicas and model."""
    name = args.title or (Path(args.trace).stem if args.trace else "synthetic")
    if args.fleet:
        return f"{name}: router {args.router}, fleet {args.fleet}, {args.model}"
    return (f"{name}: router {args.router}, {args.replicas} replica{'s' if args.replicas != 1 else ''}, "
            f"{args.model} on {args.gpu}" + (f" x tp{args.tp}" if args.tp > 1 else ""))


def main(args) -> int:
    from shepherd.bench.report import format_table, out_folder, write_report
    from shepherd.sim.fitted_cost import make_cost_model
    from shepherd.sim.fleet import PDConfig, parse_fleet, parse_prices
    from shepherd.sim.simulator import SimConfig, Simulator
    from shepherd.bench.trace_formats import TraceFormatError

    try:
        check_ranges(args, SIM_RANGES)
        sched = scheduler_config(args)
        workload, total = build_workload(args)
        out = out_folder(args.out)     # before the run: an existing file as --out failed after it
    except (TraceFormatError, ValueError, ConfigError, OSError) as e:
        print(f"shepherd simulate: {e}", file=sys.stderr)
        return 2
    knobs = {}
    for kv in args.router_knob:
        if "=" not in kv:
            print(f"shepherd simulate: --router-knob {kv!r}: expected K=V", file=sys.stderr)
            return 2
        k, v = kv.split("=", 1)
        knobs[k] = v
    cost_knobs = dict(step_overhead=args.step_overhead, seq_overhead=args.seq_overhead,
                      overlap=args.overlap_output, frontend=args.frontend_latency, host_path=args.host_path)
    try:
        cfg = SimConfig(model=args.model, gpu=args.gpu, tp=args.tp, replicas=args.replicas, router=args.router,
                        router_knobs=knobs, scheduler=sched, kv_capacity=args.max_total_tokens,
                        mem_fraction=args.mem_fraction, host_kv_tokens=args.host_kv_tokens,
                        max_model_len=args.max_model_len, max_tokens=args.max_tokens, fast=not args.slow,
                        seed=args.seed, progress=not args.no_progress, keep_records=False,
                        fleet=parse_fleet(args.fleet) if args.fleet else [],
                        pd=PDConfig(threshold=args.pd_threshold, link_bw=args.pd_link_gbs * 1e9,
                                    link_latency=args.pd_link_latency),
                        cost_model=args.cost_model, cost_knobs=cost_knobs,
                        gpu_prices=parse_prices(args.gpu_price, "--gpu-price"),
                        gpu_powers=parse_prices(args.gpu_power, "--gpu-power"),
                        adapter_load_time=args.adapter_load_time)
        # a fleet: each group's cost model of its own GPU type and TP (cfg.cost_model, cfg.cost_knobs)
        cost = None if args.fleet else make_cost_model(args.model, args.gpu, tp=args.tp,
                                                       cost_model=args.cost_model, **cost_knobs)
        sim = Simulator(cfg, cost)     # validates the scheduler's knobs for the capacity it derives
    except (KeyError, ValueError, ConfigError, FileNotFoundError) as e:
        print(f"shepherd simulate: {e}", file=sys.stderr)
        return 2
    if args.search:
        return run_search(args, cfg, workload, out)
    t0 = time.perf_counter()
    try:
        with RecordWriter(out / "records.jsonl" if args.records else None) as writer:
            result = sim.run(workload, total=total, on_record=writer.write if args.records else None)
    except (TraceFormatError, ValueError, OSError) as e:
        print(f"shepherd simulate: {e}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - t0
    if not result.stats.n:             # as bench says: a report of nothing is a mistake's result
        print(f"shepherd simulate: the workload is empty{f' ({args.trace} has no requests)' if args.trace else ''}",
              file=sys.stderr)
        return 2
    summary = result.summary(slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot,
                             extra={"trace": args.trace, "workload_requests": result.stats.n})
    summary["wall_s"] = wall
    write_report(out, summary, result.stats, result.timeseries, plots=not args.no_plots, title=run_title(args))
    print(format_table(summary))
    print(f"simulated {result.stats.n} requests, {result.steps:,} steps ({result.fast_steps:,} fast-forwarded) "
          f"in {wall:.2f} s wall; cost model {result.cost_model}; wrote {out}/")
    return 0


def run_search(args, cfg, workload, out: Path) -> int:
    """--search: every configuration of the grid on the same workload (sim/search.py)."""
    from shepherd.sim.search import SearchSpace, format_search, search, simulate_candidate

    def ints(v):
        return [int(x) for x in v.split(",") if x.strip()]

    def names(v):
        return [x.strip() for x in v.split(",") if x.strip()]

    if args.slo_ttft is None and args.slo_tpot is None:
        print("shepherd simulate --search: give --slo-ttft and/or --slo-tpot", file=sys.stderr)
        return 2
    space = SearchSpace(gpus=names(args.search_gpus), tps=ints(args.search_tp), replicas=ints(args.search_replicas),
                        max_batch=ints(args.search_max_batch), chunk=ints(args.search_chunk),
                        admission=names(args.search_admission), routers=names(args.search_routers),
                        pd_prefill=ints(args.search_pd))
    trace = list(workload)
    evaluate = simulate_candidate(trace, cfg, args.cost_model, args.slo_ttft, args.slo_tpot)

    def show(o):
        if not args.no_progress:
            state = o.error or f"{o.attainment:.1%} within the SLOs"
            print(f"  {o.candidate.label():<34} ${o.dollars_per_hour:7.2f}/h  {state}", file=sys.stderr)

    try:
        res = search(space, evaluate, attainment=args.slo_attainment, budget=args.budget, prices=cfg.gpu_prices,
                     progress=show)
    except (KeyError, ValueError, ConfigError) as e:
        print(f"shepherd simulate --search: {e}", file=sys.stderr)
        return 2
    (out / "search.json").write_text(json.dumps({
        "requests": len(trace), "slo_ttft": args.slo_ttft, "slo_tpot": args.slo_tpot,
        "attainment": args.slo_attainment, "budget": args.budget, "runs": res.runs, "skipped": res.skipped,
        "wall_s": res.wall_s, "best": res.best.row() if res.best else None,
        "pareto": [o.row() for o in res.pareto], "all": [o.row() for o in res.outcomes]}, indent=1))
    print(format_search(res, args.slo_attainment, args.budget))
    print(f"wrote {out}/search.json")
    return 0


class RecordWriter:
    """records.jsonl, one line per request as it ends (every token time; large)."""

    def __init__(self, path):
        self.f = open(path, "w") if path is not None else None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.f is not None:
            self.f.close()

    def write(self, r) -> None:
        if self.f is None:
            return
        from dataclasses import asdict
        d = asdict(r)
        d["intervals"] = [list(iv) for iv in d["intervals"]]
        self.f.write(json.dumps(d, separators=(",", ":")) + "\n")
