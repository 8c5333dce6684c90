"""Precise prefix routing in the simulator, on a long multi-turn conversation trace.

    python benchmarks/fleet_sim.py [--requests 3000] [--jobs 2] [--explain] [--docs]
    python benchmarks/fleet_sim.py --trace mooncake --routers cache-aware,prefix-aware,precise-prefix [--docs]
    python benchmarks/fleet_sim.py --routers precise-prefix --knobs '{"pressure_weight": 0}'
    python benchmarks/fleet_sim.py --trace FILE --routers cache-aware,prefix-aware,precise-prefix [--docs]

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
radix caches), the bounds read from the trace (one unlimited cache; one LRU
cache with the whole cluster's KV; the same LRU cache with each session answer
entering at its finish in the run, "causal": sim/cache_bounds.py), the ratios to
both LRU bounds, max/mean requests
per replica, TTFT, evicted tokens and the decisions. precise-prefix reads every
replica's cache exactly (the simulator feeds its index from the caches'
own records, as the engine's KV events would). Writes OUT/results.json and, with
--docs, the table into docs/ROUTING.md (<!-- fleet-sim -->).

--explain splits each router's distance to the LRU bound request by request: the
bound's hit tokens minus the router's, for the requests where the bound hit more
(lost) and where the replicas hit more (gained: a radix cache evicts a history
leaf first and keeps its front, the bound drops a session's piece whole), by what
happened to the session's previous turn: still running when this turn arrived
(its answer is not cached yet; the bound caches it at arrival), on the same
replica (evicted there), on another replica (moved); against the causal bound
too (fed this run's finishes). Table in <!-- fleet-sim-explain -->.

--trace mooncake replays shepherd/data/mooncake/synthetic_trace.jsonl (no sessions:
Mooncake's shared 512-token blocks; KV from the GPU unless --kv-capacity), the
second workload the precise router is checked on (<!-- fleet-sim-mooncake -->).

--trace FILE replays any trace file shepherd reads (bench/trace_formats.py, format from the
file), whole unless --requests; Mooncake's real multi-turn traces (FAST25-release/traces/
conversation_trace.jsonl, toolagent_trace.jsonl) carry the hash_ids that make prefixes
shareable. With --docs its table goes into <!-- fleet-sim-trace-STEM --> (STEM: the file's
name without its extension), which ROUTING.md must hold.
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
BUILTIN = ("sessions", "mooncake")
SESSION_ARGS = ("requests", "replicas", "session_rate", "turns", "think_time", "input_len", "output_len",
                "system_tokens", "system_prompts", "seed")   # and kv_capacity 65,536 (set after parsing)
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


def load(a):
    if a.trace not in BUILTIN:
        from shepherd.bench.traces import load_trace
        return load_trace(a.trace, limit=a.requests)
    if a.trace == "mooncake":
        from shepherd.bench.traces import load_trace
        from shepherd.paths import data_path
        return load_trace(str(data_path("mooncake", "synthetic_trace.jsonl")), "mooncake", limit=a.requests)
    from shepherd.bench.synthetic import synthetic
    return synthetic(workload(a))


def run_one(job):
    name, knobs, label, a = job
    if a.whole_leaf_eviction:
        import shepherd.scheduler.radix_cache as radix
        radix.EVICT_CHUNK_TOKENS = 1 << 62      # every eviction frees its whole leaf, as before
    from shepherd.config import SchedulerConfig
    from shepherd.sim.simulator import SimConfig, Simulator
    trace = load(a)
    sched = SchedulerConfig(max_total_tokens=a.kv_capacity) if a.kv_capacity else SchedulerConfig()
    cfg = SimConfig(replicas=a.replicas, router=name, router_knobs=dict(knobs), kv_capacity=a.kv_capacity,
                    scheduler=sched, keep_records=a.explain, timeseries=False, model="llama-3.1-8b", gpu="h100")
    t0 = time.perf_counter()
    sim = Simulator(cfg)
    res = sim.run(trace)
    s = res.summary()
    b = s["hit_rate_bounds"]
    return {"policy": name, "knobs": knobs, "label": label, "hit": s["prefix_hit_rate"], "lru": b["lru_cluster"],
            "lru_causal": b["lru_cluster_causal"],
            "infinite": b["infinite"], "max_over_mean": s["balance"]["requests"], "ttft_p50": s["ttft_p50"],
            "ttft_p99": s["ttft_p99"], "evicted": s["cache"]["evicted_tokens"], "reasons": s["routing"],
            "requests": s["requests"], "completed": s["completed"], "wall_s": time.perf_counter() - t0,
            "mean_prompt": sum(t.prompt_tokens for t in trace) / len(trace), "kv_per_replica": sim.kv_capacity,
            "rejected": sum(r["count"] for r in res.rejections.values()),
            **({"explain": explain(trace, res.records, sim.kv_capacity_total),
                "explain_causal": explain(trace, res.records, sim.kv_capacity_total, causal=True)}
               if a.explain else {})}


CAUSES = ("first turn", "previous turn still running", "previous turn on the same replica",
          "previous turn on another replica", "no session")


def explain(trace, records, capacity: int, causal: bool = False) -> dict:
    """{cause: [tokens lost, requests, tokens gained, requests]} against the cluster-LRU bound
    (causal: the causal one, fed this run's finishes), request by request (the bound fed in
    arrival order, as the simulator feeds it)."""
    from shepherd.sim.cache_bounds import HitRateBounds
    from shepherd.sim.simulator import request_id
    rec = {r.req_id: r for r in records}
    order = sorted(trace, key=lambda t: t.arrival)
    hits: dict = {}
    bound = HitRateBounds(capacity, on_causal_hit=(lambda tr, h: hits.__setitem__(id(tr), h)) if causal else None)
    for i, tr in enumerate(order):
        rid = request_id(tr, i)
        before = bound.hit_lru
        bound.observe(tr, rid)
        if not causal:
            hits[id(tr)] = bound.hit_lru - before
        r = rec.get(rid)
        if r is not None and r.ok and r.finish is not None:
            bound.finished(rid, r.finish)
    res = bound.result()
    total = res["lru_cluster_causal_hit_tokens" if causal else "lru_cluster_hit_tokens"]
    prev: dict = {}
    out = {c: [0, 0, 0, 0] for c in CAUSES}
    for i, tr in enumerate(order):
        r = rec.get(request_id(tr, i))
        if r is None or not r.ok:
            continue
        d = hits[id(tr)] - r.cached_tokens
        p = prev.get(tr.session) if tr.session else None
        if not tr.session:
            cause = "no session"
        elif p is None:
            cause = "first turn"
        elif p.finish is None or p.finish > tr.arrival:
            cause = "previous turn still running"
        else:
            cause = "previous turn on the same replica" if p.replica == r.replica else "previous turn on another replica"
        if tr.session:
            prev[tr.session] = r
        c = out[cause]
        if d > 0:
            c[0] += d
            c[1] += 1
        elif d < 0:
            c[2] -= d
            c[3] += 1
    out["bound_hit_tokens"] = total
    out["query_tokens"] = res["query_tokens"]
    return out


def explain_table(rows) -> str:
    lines = ["| router | bound | request | lost to the bound (tokens, requests) | gained over it | "
             "net, of the bound's hits |", "|---|---|---|---:|---:|---:|"]
    for r in rows:
        for key, name in (("explain", "LRU"), ("explain_causal", "causal LRU")):
            ex = r.get(key)
            if not ex:
                continue
            tot = ex["bound_hit_tokens"]
            for c in CAUSES:
                lost, nl, gain, ng = ex[c]
                if nl or ng:
                    lines.append(f"| {r['policy']} | {name} | {c} | {lost:,} ({nl}) | {gain:,} ({ng}) | "
                                 f"{(lost - gain) / tot:.2%} |")
    notes = []
    for r in rows:
        ex = r.get("explain_causal")
        if ex:
            # the engines hold a running answer's decoded blocks, which the causal bound (whole answer
            # at the finish) does not: credit the bound with the replicas' hits on those turns
            credited = (ex["bound_hit_tokens"] + ex["previous turn still running"][2]) / ex["query_tokens"]
            notes.append(f"{r['policy']}: {r['hit'] / credited:.3f} of the causal bound credited with the "
                         f"replicas' hits where they beat it on a turn whose previous turn was still running")
    if notes:
        lines.append("")
        lines.extend(notes)
    return "\n".join(lines) + "\n"


def _span(v) -> str:
    lo, hi = min(v), max(v)
    return f"{lo:.1%}" if f"{lo:.1%}" == f"{hi:.1%}" else f"{lo:.1%} to {hi:.1%}"


def table(rows, a) -> str:
    r0 = rows[0]
    if a.trace not in BUILTIN:
        what = (f"{os.path.basename(a.trace)} ({r0['requests']} requests, mean prompt {r0['mean_prompt']:,.0f} tokens, "
                f"{r0['rejected']} longer than llama-3.1-8b's context refused)")
    elif a.trace == "mooncake":
        what = (f"Mooncake synthetic trace ({r0['requests']} requests, mean prompt {r0['mean_prompt']:,.0f} tokens, "
                f"{r0['rejected']} longer than llama-3.1-8b's context refused)")
    else:
        what = (f"Synthetic chat sessions ({r0['requests']} requests, {a.turns} turns, {a.system_prompts} shared "
                f"system prompts of {a.system_tokens} tokens, mean prompt {r0['mean_prompt']:,.0f} tokens)")
    head = (f"{what}, {a.replicas} replicas of llama-3.1-8b on h100 with {r0['kv_per_replica']:,} KV tokens each. "
            f"Bounds from the trace: one unlimited cache {r0['infinite']:.1%}, one LRU cache with the cluster's KV "
            f"{r0['lru']:.1%}; the same LRU cache with each answer in at its finish in the run (causal, "
            f"sim/cache_bounds.py; each router's own run) {_span([r['lru_causal'] for r in rows])}.\n\n")
    lines = ["| router | knobs | prefix hit | of the LRU bound | of the causal bound | max/mean req | TTFT p50 ms | "
             "TTFT p99 ms | evicted tokens | decisions |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        dec = ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {r['policy']} | {r['label']} | {r['hit']:.1%} | {r['hit'] / r['lru']:.3f} | "
                     f"{r['hit'] / r['lru_causal']:.3f} | "
                     f"{r['max_over_mean']:.2f} | {r['ttft_p50'] * 1e3:.0f} | {r['ttft_p99'] * 1e3:.0f} | "
                     f"{r['evicted']:,} | {dec} |")
    return head + "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--trace", default="sessions",
                    help="sessions (synthetic), mooncake (the bundled synthetic trace) or a trace FILE of any format")
    ap.add_argument("--kv-capacity", type=int, default=None,
                    help="KV tokens per replica (default: 65,536 for sessions, the GPU's for a trace)")
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
    ap.add_argument("--knobs", default=None, help="JSON knobs for the chosen --routers (e.g. precise-prefix's "
                                                   "pressure_weight, pressure_window); rows labelled with them")
    ap.add_argument("--explain", action="store_true", help="split each router's distance to the LRU bound")
    ap.add_argument("--whole-leaf-eviction", action="store_true",
                    help="the replicas' radix caches free whole leaves (the engine before it freed only the "
                         "tail it needs): for before/after figures; never written to the docs")
    ap.add_argument("--docs", action="store_true", help="write the table into docs/ROUTING.md")
    return ap


def main() -> None:
    ap = parser()
    a = ap.parse_args()
    if a.trace not in BUILTIN and not os.path.isfile(a.trace):
        ap.error(f"--trace: {a.trace} is neither {' nor '.join(BUILTIN)} nor a file")
    if a.kv_capacity is None and a.trace == "sessions":
        a.kv_capacity = 65536
    if a.trace != "sessions" and a.requests == ap.get_default("requests"):
        a.requests = None                     # the whole trace
    routers = [r for r in ROUTERS if a.routers is None or r[0] in a.routers.split(",")]
    if a.knobs:
        extra = json.loads(a.knobs)
        routers = [(n, {**k, **extra}, ", ".join(f"{x}={v}" for x, v in extra.items())) for n, k, _ in routers]
    jobs = [(n, k, lbl, a) for n, k, lbl in routers]
    if a.jobs > 1:
        with ProcessPoolExecutor(a.jobs) as ex:
            rows = list(ex.map(run_one, jobs))
    else:
        rows = [run_one(j) for j in jobs]
    for r in rows:
        print(f"{r['policy']:15s} {r['label']:34s} hit {r['hit']:.4f} / lru {r['lru']:.4f} = {r['hit'] / r['lru']:.3f}"
              f"  / causal {r['lru_causal']:.4f} = {r['hit'] / r['lru_causal']:.3f}"
              f"  max/mean {r['max_over_mean']:.2f}  ttft p50 {r['ttft_p50'] * 1e3:.0f} ms  wall {r['wall_s']:.0f}s",
              flush=True)
    md = table(rows, a)
    xmd = explain_table(rows) if a.explain else ""
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(a).items()}, "rows": rows}, f, indent=1)
    print(md)
    print(xmd)
    default_sessions = (a.trace == "sessions" and a.kv_capacity == 65536
                        and all(getattr(a, k) == ap.get_default(k) for k in SESSION_ARGS))
    if a.docs and not a.whole_leaf_eviction:
        from routing_sim import write_docs
        if a.trace not in BUILTIN:
            write_docs(md, mark=f"fleet-sim-trace-{os.path.splitext(os.path.basename(a.trace))[0]}")
        elif a.trace == "mooncake":
            write_docs(md, mark="fleet-sim-mooncake")
        elif a.routers is None and not a.knobs:   # the sessions table has every router's row, as defaults
            # other generator arguments: the scaled trace fleet_gateway.py replays (the command it prints)
            write_docs(md, mark="fleet-sim" if default_sessions else "fleet-sim-scaled")
        if xmd and default_sessions:
            write_docs(xmd, mark="fleet-sim-explain")


if __name__ == "__main__":
    main()
