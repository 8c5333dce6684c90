"""Precise prefix routing in the simulator, on a long multi-turn conversation trace.

    python benchmarks/fleet_sim.py [--requests 3000] [--jobs 2] [--docs]

The workload is synthetic (bench/synthetic.py; no multi-turn trace with token
sharing ships in ../shared/data): chat sessions arriving at --session-rate per
second, each of --turns turns separated by exponential think times; turn 1 starts
with one of --system-prompts shared system prompts; every later turn's prompt is
the previous prompt, its answer and a new user message, so prompts grow past
10k tokens. The simulator's answers continue each session's token stream
(bench/traces.py session_stream), so a replica that served turn k holds turn k+1's prefix,
answer included, until it evicts it. 8 replicas of Llama-3.1-8B (the prompts outgrow
Llama-3-8B's 8,192-token context, which the simulator enforces) on H100 (roofline
cost model), each with --kv-capacity tokens of KV so that the caches are under
pressure.

For each router: the prefix hit rate (prompt tokens served from the replicas'
radix caches), the two bounds read from the trace (one unlimited cache; one LRU
cache with the whole cluster's KV), the ratio to the LRU bound, max/mean requests
per replica, TTFT, evicted tokens and the decisions. precise-prefix reads every
replica's cache exactly (the simulator feeds its index from the caches'
own records, as the engine's KV events would). Writes OUT/results.json and, with
--docs, the table into docs/ROUTING.md (<!-- fleet-sim -->).
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TOK = {"tokenizer_type": "tokens"}
ROUTERS = [("least-request", {}, "defaults"),
           ("prefix-aware", TOK, "tokens, 16-token blocks"),
           ("cache-aware", TOK, "tokens"),
           ("weighted", TOK, "tokens, prefix=2,queue=1,kv=1,load=1"),
           ("weighted", {"weights": "precise=2,queue=1,kv=1,load=1"}, "precise=2,queue=1,kv=1,load=1"),
           ("precise-prefix", {}, "defaults")]


def workload(a):
    from shepherd.bench.synthetic import ClientSpec, SyntheticSpec
    return SyntheticSpec(clients=[ClientSpec(name="chat", rate=a.session_rate, input_len=a.input_len,
                                             output_len=a.output_len, system_prompt_tokens=a.system_tokens,
                                             num_system_prompts=a.system_prompts, turns=a.turns,
                                             think_time=a.think_time)],
                         num_requests=a.requests, seed=a.seed)


def run_one(job):
    name, knobs, label, a = job
    from shepherd.bench.synthetic import synthetic
    from shepherd.config import SchedulerConfig
    from shepherd.sim.simulator import SimConfig, Simulator
    trace = synthetic(workload(a))
    cfg = SimConfig(replicas=a.replicas, router=name, router_knobs=dict(knobs), kv_capacity=a.kv_capacity,
                    scheduler=SchedulerConfig(max_total_tokens=a.kv_capacity), keep_records=False,
                    timeseries=False, model="llama-3.1-8b", gpu="h100")
    t0 = time.perf_counter()
    res = Simulator(cfg).run(trace)
    s = res.summary()
    b = s["hit_rate_bounds"]
    return {"policy": name, "knobs": knobs, "label": label, "hit": s["prefix_hit_rate"], "lru": b["lru_cluster"],
            "infinite": b["infinite"], "max_over_mean": s["balance"]["requests"], "ttft_p50": s["ttft_p50"],
            "ttft_p99": s["ttft_p99"], "evicted": s["cache"]["evicted_tokens"], "reasons": s["routing"],
            "requests": s["requests"], "completed": s["completed"], "wall_s": time.perf_counter() - t0,
            "mean_prompt": sum(t.prompt_tokens for t in trace) / len(trace)}


def table(rows, a) -> str:
    r0 = rows[0]
    head = (f"Synthetic chat sessions ({r0['requests']} requests, {a.turns} turns, {a.system_prompts} shared system "
            f"prompts of {a.system_tokens} tokens, mean prompt {r0['mean_prompt']:,.0f} tokens), {a.replicas} replicas "
            f"of llama-3.1-8b on h100 with {a.kv_capacity:,} KV tokens each. Bounds from the trace: one unlimited "
            f"cache {r0['infinite']:.1%}, one LRU cache with the cluster's KV {r0['lru']:.1%}.\n\n")
    lines = ["| router | knobs | prefix hit | of the LRU bound | max/mean req | TTFT p50 ms | TTFT p99 ms | "
             "evicted tokens | decisions |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        dec = ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {r['policy']} | {r['label']} | {r['hit']:.1%} | {r['hit'] / r['lru']:.3f} | "
                     f"{r['max_over_mean']:.2f} | {r['ttft_p50'] * 1e3:.0f} | {r['ttft_p99'] * 1e3:.0f} | "
                     f"{r['evicted']:,} | {dec} |")
    return head + "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--kv-capacity", type=int, default=65536, help="KV tokens per replica")
    ap.add_argument("--session-rate", type=float, default=0.5, help="new sessions per second")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--think-time", type=float, default=30.0)
    ap.add_argument("--input-len", default="lognormal:600:0.8", help="user message tokens per turn")
    ap.add_argument("--output-len", default="lognormal:300:0.8")
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--system-prompts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--routers", default=None, help="comma-separated names (default: all rows)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "fleet_sim"))
    ap.add_argument("--docs", action="store_true", help="write the table into docs/ROUTING.md")
    a = ap.parse_args()
    routers = [r for r in ROUTERS if a.routers is None or r[0] in a.routers.split(",")]
    jobs = [(n, k, lbl, a) for n, k, lbl in routers]
    if a.jobs > 1:
        with ProcessPoolExecutor(a.jobs) as ex:
            rows = list(ex.map(run_one, jobs))
    else:
        rows = [run_one(j) for j in jobs]
    for r in rows:
        print(f"{r['policy']:15s} {r['label']:34s} hit {r['hit']:.4f} / lru {r['lru']:.4f} = {r['hit'] / r['lru']:.3f}"
              f"  max/mean {r['max_over_mean']:.2f}  ttft p50 {r['ttft_p50'] * 1e3:.0f} ms  wall {r['wall_s']:.0f}s",
              flush=True)
    md = table(rows, a)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(a).items()}, "rows": rows}, f, indent=1)
    print(md)
    if a.docs:
        from routing_sim import write_docs
        write_docs(md, mark="fleet-sim")


if __name__ == "__main__":
    main()
