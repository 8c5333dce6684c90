"""Does precise-prefix's load penalty ever cost a cache hit? (simulator, deterministic)

    python benchmarks/fleet_moves.py [--docs]
    python benchmarks/fleet_moves.py --trace FILE    # any trace file fleet_sim.py takes (no --docs)

Runs fleet_sim.py's two workloads (the chat sessions and the Mooncake trace) with
precise-prefix, recording every decision: the longest match any replica held and the
chosen replica's. A decision "forgoes" a match when the chosen replica held fewer of
the prompt's blocks than another: the pressure term of its cost outweighed the blocks,
or the imbalance rule sent it to the least loaded replica (the two ways precise-prefix
trades hits for load).
Beside them, the distance to the cluster-LRU bound and to the causal one (answers in at
their finish in the run, sim/cache_bounds.py) in tokens (fleet_sim.py's explain),
and, on the sessions, the turns that left the replica of the session's previous turn
after it had finished ("previous turn on another replica" in fleet_sim.py --explain)
with what that replica still held of the prompt when the turn was routed: only the
1,500-token system prompt means the history had been evicted there before the move.
With --docs the table goes into docs/ROUTING.md (<!-- fleet-moves -->).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from shepherd.routing import registry  # noqa: E402
from shepherd.routing.precise_prefix import PrecisePrefixPolicy  # noqa: E402


class RecordingPrecisePrefix(PrecisePrefixPolicy):
    """precise-prefix, unchanged, noting per request the blocks each replica held when it chose."""
    seen: dict = {}          # req_id -> ({replica key: blocks held}, chosen key); one run per process

    def choose(self, request, replicas):
        held = self.scorer.matched(request, replicas)
        chosen = super().choose(request, replicas)
        RecordingPrecisePrefix.seen[request.req_id] = (held, chosen.key)
        return chosen


def run(trace_name: str) -> dict:
    import fleet_sim
    from shepherd.config import SchedulerConfig
    from shepherd.sim.cache_bounds import HitRateBounds
    from shepherd.sim.simulator import SimConfig, Simulator, request_id
    a = argparse.Namespace(requests=3000 if trace_name == "sessions" else None, replicas=8, trace=trace_name,
                           kv_capacity=65536 if trace_name == "sessions" else None, session_rate=0.5, turns=12,
                           think_time=30.0, input_len="lognormal:600:0.8", output_len="lognormal:300:0.8",
                           system_tokens=1500, system_prompts=8, seed=0)
    trace = fleet_sim.load(a)
    registry.POLICIES["precise-prefix"] = RecordingPrecisePrefix     # this process only
    RecordingPrecisePrefix.seen = {}
    sched = SchedulerConfig(max_total_tokens=a.kv_capacity) if a.kv_capacity else SchedulerConfig()
    sim = Simulator(SimConfig(replicas=a.replicas, router="precise-prefix", kv_capacity=a.kv_capacity, scheduler=sched,
                              keep_records=True, timeseries=False, model="llama-3.1-8b", gpu="h100"))
    res = sim.run(trace)
    seen = RecordingPrecisePrefix.seen
    bs = 16
    forgo = [(max(h.values()) - h.get(c, 0)) * bs for h, c in seen.values() if h and max(h.values()) > h.get(c, 0)]
    # the bounds, request by request, as fleet_sim.py --explain feeds them (the causal one with
    # this run's finishes)
    causal_hits: dict = {}
    bound = HitRateBounds(sim.kv_capacity_total, on_causal_hit=lambda tr, h: causal_hits.__setitem__(id(tr), h))
    rec = {r.req_id: r for r in res.records}
    order = sorted(trace, key=lambda t: t.arrival)
    hits = []
    for i, tr in enumerate(order):
        before = bound.hit_lru
        rid = request_id(tr, i)
        bound.observe(tr, rid)
        hits.append(bound.hit_lru - before)
        r = rec.get(rid)
        if r is not None and r.ok and r.finish is not None:
            bound.finished(rid, r.finish)
    bound.settle(float("inf"))
    prev: dict = {}
    moved = moved_lost = moved_history_gone = 0
    gap = gap_causal = 0
    for i, tr in enumerate(order):
        rid = request_id(tr, i)
        r = rec.get(rid)
        if r is None or not r.ok:
            continue
        d = hits[i] - r.cached_tokens
        gap += d
        gap_causal += causal_hits[id(tr)] - r.cached_tokens
        p = prev.get(tr.session) if tr.session else None
        if p is not None and p.finish is not None and p.finish <= tr.arrival and p.replica != r.replica and d > 0:
            moved += 1
            moved_lost += d
            held, _ = seen.get(rid, ({}, None))
            prev_key = next((k for k in held if str(k) == str(p.replica) or k == p.replica), None)
            if bs * held.get(prev_key, 0) <= a.system_tokens:
                moved_history_gone += 1
        if tr.session:
            prev[tr.session] = r
    s = res.summary()
    b = s["hit_rate_bounds"]
    return {"trace": os.path.basename(trace_name), "decisions": len(seen), "forgo": len(forgo), "forgone": sum(forgo), "gap": gap,
            "gap_causal": gap_causal, "ratio": s["prefix_hit_rate"] / b["lru_cluster"],
            "ratio_causal": s["prefix_hit_rate"] / b["lru_cluster_causal"], "moved": moved,
            "moved_lost": moved_lost, "moved_history_gone": moved_history_gone, "sessions": trace_name == "sessions"}


def table(rows) -> str:
    out = ["| trace | of the LRU bound | of the causal bound | decisions | forgoing a longer match | tokens forgone | "
           "gap to the bound (tokens, served requests) | gap to the causal bound | moved turns (tokens lost) | "
           "of them, history already evicted on the previous replica |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mv = (f"{r['moved']} ({r['moved_lost']:,})", f"{r['moved_history_gone']}") if r["sessions"] else ("-", "-")
        out.append(f"| {r['trace']} | {r['ratio']:.3f} | {r['ratio_causal']:.3f} | {r['decisions']:,} | {r['forgo']} | "
                   f"{r['forgone']:,} | {r['gap']:,} | {r['gap_causal']:,} | {mv[0]} | {mv[1]} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", action="store_true", help="write the table into docs/ROUTING.md")
    ap.add_argument("--trace", action="append", default=None,
                    help="a trace FILE instead of the two workloads (repeatable; the table is printed only)")
    a = ap.parse_args()
    if a.trace and a.docs:
        ap.error("--docs writes the two workloads' table: leave out --trace")
    rows = [run(t) for t in (a.trace or ("sessions", "mooncake"))]
    md = table(rows)
    print(md)
    if a.docs:
        from routing_sim import write_docs
        write_docs(md, mark="fleet-moves")


if __name__ == "__main__":
    main()
