"""Routing policies in the simulator on the Mooncake trace.

    python benchmarks/routing_sim.py                       # all policies, 8 replicas, full trace
    python benchmarks/routing_sim.py --limit 1000 --jobs 2 --policies prefix-aware,round-robin
    python benchmarks/routing_sim.py --variants            # also prefix-aware knob variants

For each policy: the simulator (shepherd.sim.simulator: the real Scheduler
per replica, a roofline cost model of Llama-3-8B on H100) replays the trace
on N replicas routed by that policy; we report the prefix-cache hit rate
(prompt tokens served from the replicas' radix caches / prompt tokens), TTFT
p50/p99, throughput, max/mean requests per replica, and the policy's
decisions by reason. The ideal hit rate is that of one unlimited cache that
sees every request (Mooncake's figure: 64.0% of blocks).

Writes OUT/results.json and OUT/table.md (default out/routing_sim); the
table is what docs/ROUTING.md quotes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from shepherd.paths import data_path  # noqa: E402

DEFAULT_TRACE = str(data_path("mooncake", "synthetic_trace.jsonl"))

POLICIES = ["random", "round-robin", "least-request", "shortest-queue", "power-of-two", "least-kv",
            "prefix-aware", "cache-aware", "weighted", "session-affinity", "vtc-basic"]
# AIBrix's README vs code defaults, and ours
VARIANTS = [
    ("prefix-aware", {"imbalance_abs_count": 16, "standard_deviation_factor": 2}, "README: 16, k=2"),
    ("prefix-aware", {"imbalance_abs_count": 8, "standard_deviation_factor": 1}, "code: 8, k=1"),
    ("prefix-aware", {"imbalance_abs_count": 8, "standard_deviation_factor": 2}, "8, k=2"),
    ("prefix-aware", {"imbalance_abs_count": 8, "standard_deviation_factor": 3}, "8, k=3"),
]


def ideal_hit_rate(trace) -> float:
    seen, hit, total = set(), 0, 0
    for tr in sorted(trace, key=lambda t: t.arrival):
        for h in tr.hash_ids or ():
            total += 1
            if h in seen:
                hit += 1
            else:
                seen.add(h)
    return hit / total if total else 0.0


def run_one(job):
    name, knobs, label, args = job
    from shepherd.sim.simulator import SimConfig, Simulator
    from shepherd.bench.traces import load_trace
    trace = load_trace(args["trace"], "mooncake", limit=args["limit"], time_scale=args.get("time_scale", 1.0))
    cfg = SimConfig(replicas=args["replicas"], router=name, router_knobs=dict(knobs), progress=False,
                    keep_records=False,
                    timeseries=False, model=args["model"], gpu=args["gpu"], kv_capacity=args.get("kv_capacity"))
    t0 = time.perf_counter()
    sim = Simulator(cfg)
    res = sim.run(trace)
    wall = time.perf_counter() - t0
    s = res.summary()
    b = s["hit_rate_bounds"]
    return {"policy": name, "knobs": knobs, "label": label, "prefix_hit_rate": s.get("prefix_hit_rate"),
            "bound_infinite": b.get("infinite"), "bound_lru": b.get("lru_cluster"),
            "ttft_p50": s["ttft_p50"], "ttft_p99": s["ttft_p99"], "e2e_p50": s["e2e_p50"],
            "throughput_req_s": s["throughput_req_s"], "output_tok_s": s["output_tok_s"],
            "total_tok_s": s["total_tok_s"], "completed": s["completed"], "requests": s["requests"],
            "per_replica": [r["requests"] for r in s["replicas"]], "max_over_mean": s["balance"]["requests"],
            "evicted_tokens": s["cache"]["evicted_tokens"], "reasons": s["routing"], "wall_s": wall}


def fmt_ms(x):
    return "-" if x is None else f"{x * 1000:.0f}"


def table(rows, ideal, args) -> str:
    out = [f"Mooncake synthetic trace ({rows[0]['requests']} requests), {args['replicas']} replicas, "
           f"{args['model']} on {args['gpu']} (roofline cost model)"
           + (f", KV {args['kv_capacity']:,} tokens per replica" if args.get("kv_capacity") else "")
           + (f", arrivals x{args['time_scale']:g} (time scale)" if args.get("time_scale", 1.0) != 1.0 else "")
           + ". Bounds from the trace, over prompt tokens: one unlimited cache "
           f"{rows[0]['bound_infinite'] * 100:.1f}%, one LRU cache with the cluster's KV "
           f"{rows[0]['bound_lru'] * 100:.1f}% ({ideal * 100:.1f}% of blocks recur).", "",
           "| policy | knobs | prefix hit | TTFT p50 ms | TTFT p99 ms | req/s | total tok/s | max/mean req per replica "
           "| evicted tokens | decisions |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        reasons = ", ".join(f"{k or '-'} {v}" for k, v in sorted(r["reasons"].items(), key=lambda kv: -kv[1]))
        hit = "-" if r["prefix_hit_rate"] is None else f"{r['prefix_hit_rate'] * 100:.1f}%"
        out.append(f"| {r['policy']} | {r['label']} | {hit} | {fmt_ms(r['ttft_p50'])} | {fmt_ms(r['ttft_p99'])} "
                   f"| {r['throughput_req_s']:.2f} | {r['total_tok_s']:.0f} | {r['max_over_mean']:.2f} "
                   f"| {r['evicted_tokens']:,} | {reasons} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=DEFAULT_TRACE)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--variants", action="store_true", help="also run prefix-aware knob variants")
    # Llama-3.1-8B (Llama-3-8B's shapes, 131,072 positions): half of Mooncake's prompts exceed
    # Llama-3-8B's 8,192, which the simulator rejects as the engine would
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply arrival times (0.25 = four times the trace's rate)")
    p.add_argument("--kv-capacity", type=int, default=None,
                   help="KV tokens per replica (default: from GPU memory); large = routing-only hit rate")
    p.add_argument("--out", default=os.path.join(ROOT, "out", "routing_sim"))
    p.add_argument("--docs", action="store_true", help="replace the first table in docs/ROUTING.md")
    a = p.parse_args(argv)
    args = {"trace": a.trace, "limit": a.limit, "replicas": a.replicas, "model": a.model, "gpu": a.gpu,
            "kv_capacity": a.kv_capacity, "time_scale": a.time_scale}
    jobs = []
    for n in a.policies.split(","):
        if not n:
            continue
        if n == "session-affinity":
            # the trace has one client and no sessions: keyed on the user, every request
            # would go to one replica (see docs/ROUTING.md); without, it is its fallback
            jobs.append((n, {"use_user": False}, "use_user=false", args))
        else:
            jobs.append((n, {}, "defaults", args))
    if a.variants:
        jobs += [(n, k, lbl, args) for n, k, lbl in VARIANTS]
    from shepherd.bench.traces import load_trace
    ideal = ideal_hit_rate(load_trace(a.trace, "mooncake", limit=a.limit))
    os.makedirs(a.out, exist_ok=True)
    rows = []
    if a.jobs > 1:
        with ProcessPoolExecutor(a.jobs) as ex:
            for r in ex.map(run_one, jobs):
                rows.append(r)
                print(f"{r['policy']:>16} {r['label']:<16} hit {r['prefix_hit_rate']:.3f} "
                      f"ttft p50 {r['ttft_p50']:.3f} p99 {r['ttft_p99']:.3f} ({r['wall_s']:.0f}s)", flush=True)
    else:
        for j in jobs:
            r = run_one(j)
            rows.append(r)
            print(f"{r['policy']:>16} {r['label']:<16} hit {r['prefix_hit_rate']:.3f} "
                  f"ttft p50 {r['ttft_p50']:.3f} p99 {r['ttft_p99']:.3f} ({r['wall_s']:.0f}s)", flush=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"ideal_hit_rate": ideal, "args": args, "rows": rows}, f, indent=1)
    t = table(rows, ideal, args)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(t)
    print(t)
    if a.docs:
        write_docs(t)
    return 0


def write_docs(table_md: str, mark: str = "routing-sim") -> None:
    import re
    path = os.path.join(ROOT, "docs", "ROUTING.md")
    text = open(path).read()
    block = f"<!-- {mark} -->\n{table_md}<!-- /{mark} -->"
    pat = re.compile(rf"<!-- {mark} -->.*?<!-- /{mark} -->", re.S)
    if not pat.search(text):
        raise SystemExit(f"docs/ROUTING.md has no <!-- {mark} --> block")
    open(path, "w").write(pat.sub(lambda m: block, text))


if __name__ == "__main__":
    sys.exit(main())
