"""Precise prefix routing through a real gateway over 3 real replicas, on a scaled multi-turn workload.

    python benchmarks/fleet_gateway.py [--executor torch|sim] [--requests 1000] [--explain] [--docs]
    python benchmarks/fleet_gateway.py --workload chat [--sessions 24] [--turns 6]     # the older chat client

Three `shepherd serve` processes (the default model; --executor sim keeps the real
engine, HTTP and KV events but paces steps with the cost model instead of running
the weights) publish their KV events; `shepherd gateway` routes the requests over
them with each router in turn (fresh replicas for each, so every router starts from
empty caches); precise-prefix subscribes to the three streams (--kv-events).

The workload (default, --workload sessions) is the simulator's long multi-turn
trace (benchmarks/fleet_sim.py's sessions: bench/synthetic.py's generator, the same
function and arguments), scaled to three small replicas: lengths /8 (1,500-token
system prompts -> 192, user messages ~75 tokens, answers ~38), KV /8 (8,192 tokens per
replica), 3 system prompts for 3 replicas, think time 30 s -> 5 s and 1.1 new sessions
a second, so that each replica has about as many conversations open (~22) against a
cache of the same relative size as the simulator's eight do. The
client replays the trace as token ids on /v1/completions: turn 1's prompt is the
trace's (system prompt, then the session's own tokens), every later turn's is the
previous prompt, the answer the replica returned (return_token_ids; ignore_eos and
max_tokens = the trace's output length, so it is exactly as long) and the trace's
new tokens: the same lengths and the same sharing as the simulator's prompts. A turn
is sent at its trace time, or when the previous answer is in if that is later
(counted as "waited"). The same trace in the simulator, 3 replicas:
`python benchmarks/fleet_sim.py --replicas 3 ARGS` with the ARGS this script prints.

Reported per router: the prefix hit rate (usage.prompt_tokens_details.cached_tokens
over prompt tokens, as the replicas count them), the simulator's bounds for the same
trace (sim/cache_bounds.py: one LRU cache with the three replicas' KV; the causal one
fed this run's finishes), max/mean requests per replica (x-shepherd-backend), e2e
latency p50. --explain splits each router's distance to the bounds request by request
as fleet_sim.py --explain does (<!-- fleet-gateway-explain -->). Writes
OUT/results.json, OUT/ROUTER/records.json and, with --docs, docs/ROUTING.md
(<!-- fleet-gateway -->; --workload chat: <!-- fleet-gateway-chat -->).

--workload chat is the earlier client: --sessions chat sessions of --turns
user messages of random words under --system-prompts system prompts of
--system-words words, with the whole history re-sent each turn; its bound
replays the run's token ids (a replica's /tokenize) through one radix cache as
large as the three replicas' KV.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from peers import Server, free_port  # noqa: E402

WORDS = ("river stone light cloud market garden bridge window letter music winter forest signal harbor engine "
         "paper story number silver orange morning planet theory voice island machine").split()
NAME = "smollm2-135m"
VOCAB = 49152                      # SmolLM2's: the replicas' tokenizer
ROUTERS = [("least-request", []), ("cache-aware", []), ("precise-prefix", [])]
# fleet_sim.py's session arguments: the gateway's values are the simulator's defaults scaled (module doc)
TRACE_ARGS = ("requests", "session_rate", "turns", "think_time", "input_len", "output_len", "system_tokens",
              "system_prompts", "seed")


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def chat_plan(a):
    """--workload chat: [(start time, system prompt index, [user messages], [think times])]."""
    rng = random.Random(a.seed)
    t = 0.0
    out = []
    for _ in range(a.sessions):
        t += rng.expovariate(a.session_rate)
        users = [text(rng, rng.randint(30, 70)) for _ in range(a.chat_turns)]
        out.append((t, rng.randrange(a.system_prompts), users, [rng.expovariate(1 / a.think_time)
                                                                 for _ in range(a.chat_turns)]))
    return out


def session_trace(a) -> list:
    """The simulator's sessions trace (fleet_sim.py's own generator) with this run's arguments."""
    from fleet_sim import workload

    from shepherd.bench.synthetic import synthetic
    return synthetic(workload(a))


def sim_command(a) -> str:
    """fleet_sim.py's command line for the same trace on 3 replicas."""
    flags = " ".join(f"--{k.replace('_', '-')} {getattr(a, k)}" for k in TRACE_ARGS)
    return f"python benchmarks/fleet_sim.py --replicas 3 --kv-capacity {a.kv_capacity} {flags}"


def start_fleet(a, policy: str, out: Path):
    py = sys.executable
    reps, specs = [], []
    for i in range(3):
        port, pub, rep = free_port(), free_port(), free_port()
        ev = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                         "replay_endpoint": f"tcp://*:{rep}"})
        cmd = [py, "-m", "shepherd", "serve", "--port", port, "--served-model-name", NAME, "--executor", a.executor,
               "--num-threads", 1,
               "--max-total-tokens", a.kv_capacity, "--kv-events-config", ev]
        reps.append(Server(f"replica{i}", [(cmd, {})], port, out / f"replica{i}"))
        specs.append(f"http://127.0.0.1:{port}=tcp://127.0.0.1:{pub},replay=tcp://127.0.0.1:{rep}")
    gport = free_port()
    gcmd = [py, "-m", "shepherd", "gateway", "--port", gport, "--policy", policy,
            *[x for r in reps for x in ("--backend", r.url)]]
    if policy == "precise-prefix":
        gcmd += [x for s in specs for x in ("--kv-events", s)]
        gcmd += [x for k in a.precise_knob for x in ("--policy-knob", k)]
    if policy == "cache-aware":
        # token-id prompts (sessions) are keyed by their ids, as in the simulator; chat text by characters
        gcmd += ["--policy-knob", "tokenizer_type=" + ("tokens" if a.workload == "sessions" else "character")]
    gw = Server(f"gateway-{policy}", [(gcmd, {})], gport, out / f"gateway-{policy}")
    return reps, gw


async def play_chat(a, url: str, systems: list, plan) -> list:
    import httpx
    records = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        t0 = time.monotonic()

        async def session(sid, start, sysi, users, thinks):
            await asyncio.sleep(max(0.0, start - (time.monotonic() - t0)))
            msgs = [{"role": "system", "content": systems[sysi]}]
            for turn, (u, think) in enumerate(zip(users, thinks)):
                msgs.append({"role": "user", "content": u})
                body = {"model": NAME, "messages": msgs, "max_tokens": a.max_tokens, "temperature": 0}
                t1 = time.monotonic()
                r = await c.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                j = r.json()
                usage = j["usage"]
                records.append({"session": sid, "turn": turn, "system": sysi, "t": t1 - t0,
                                "backend": r.headers.get("x-shepherd-backend"),
                                "prompt": usage["prompt_tokens"], "output": usage["completion_tokens"],
                                "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                                "e2e": time.monotonic() - t1, "messages": list(msgs),
                                "answer": j["choices"][0]["message"]["content"]})
                msgs.append({"role": "assistant", "content": j["choices"][0]["message"]["content"]})
                await asyncio.sleep(think)

        await asyncio.gather(*(session(i, *s) for i, s in enumerate(plan)))
    return records


def turn_prompt(held: list, tr) -> list:
    """A turn's prompt: the previous turn's prompt and the answer the replica gave (`held`), then
    the trace's new tokens; as long as the trace's prompt, sharing what the simulator's does."""
    from shepherd.bench.traces import prompt_token_ids
    prompt = held + prompt_token_ids(tr, VOCAB)[len(held):]
    if len(prompt) != tr.prompt_tokens:
        raise RuntimeError(f"turn {tr.turn} of {tr.session}: {len(prompt)} prompt tokens, the trace says "
                           f"{tr.prompt_tokens} (an answer of the wrong length?)")
    return prompt


async def play_sessions(url: str, trace: list) -> list:
    """Replay the sessions trace as token ids (module doc); one record per request, in trace order."""
    import httpx
    turns: dict = {}
    for i, tr in enumerate(trace):
        turns.setdefault(tr.session, []).append((i, tr))
    records: list = [None] * len(trace)
    limits = httpx.Limits(max_connections=len(turns), max_keepalive_connections=len(turns))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        t0 = time.monotonic()

        async def session(reqs):
            held: list[int] = []             # the previous turn's prompt and answer
            for i, tr in reqs:
                late = tr.arrival - (time.monotonic() - t0)
                if late > 0:
                    await asyncio.sleep(late)
                prompt = turn_prompt(held, tr)
                body = {"model": NAME, "prompt": prompt, "max_tokens": tr.output_tokens, "ignore_eos": True,
                        "temperature": 0, "return_token_ids": True}
                t1 = time.monotonic() - t0
                r = await c.post("/v1/completions", json=body)
                r.raise_for_status()
                j = r.json()
                usage = j["usage"]
                answer = j["choices"][0]["token_ids"]
                t2 = time.monotonic() - t0
                records[i] = {"i": i, "session": tr.session, "turn": tr.turn, "arrival": tr.arrival, "sent": t1,
                              "finish": t2, "e2e": t2 - t1, "waited": late < -0.05,
                              "backend": r.headers.get("x-shepherd-backend"), "prompt": usage["prompt_tokens"],
                              "output": usage["completion_tokens"],
                              "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0}
                held = prompt + answer

        await asyncio.gather(*(session(v) for v in turns.values()))
    return records


def lru_bound(records: list, replica_url: str, capacity: int) -> float:
    """--workload chat: the run's requests in arrival order through one radix cache with
    `capacity` tokens; each record gets its own hit in it ("bound")."""
    import httpx

    from shepherd.scheduler.kv_pool import KVPool
    from shepherd.scheduler.radix_cache import RadixCache
    pool = KVPool(capacity, 1)
    tree = RadixCache(pool)
    hit = total = 0
    for r in sorted(records, key=lambda x: x["t"]):
        prompt = httpx.post(replica_url + "/tokenize", json={"messages": r["messages"]}).json()["tokens"]
        full = httpx.post(replica_url + "/tokenize", json={"messages": r["messages"] + [
            {"role": "assistant", "content": r["answer"]}], "add_generation_prompt": False}).json()["tokens"]
        total += len(prompt)
        r["bound"] = tree.match_len(prompt[:-1])
        hit += r["bound"]
        seq = full[:len(prompt) + max(0, r["output"] - 1)]
        need = len(seq)
        if need > pool.free_pages:
            tree.evict(need - pool.free_pages)
        if need <= pool.free_pages:
            slots = []
            pool.extend(slots, need, pool.alloc(need))
            existing = tree.insert(seq, slots)
            if existing:
                pool.free(pool.pages_of(slots, 0, existing))
    return hit / total if total else 0.0


def session_bounds(trace: list, records: list, capacity: int) -> dict:
    """The simulator's bounds (sim/cache_bounds.py) for the trace, the causal one fed this run's finishes."""
    from shepherd.sim.cache_bounds import HitRateBounds
    from shepherd.sim.simulator import request_id
    b = HitRateBounds(capacity)
    for i, tr in enumerate(trace):
        rid = request_id(tr, i)
        b.observe(tr, rid)
        b.finished(rid, records[i]["finish"])
    return b.result()


def sim_records(trace: list, records: list, replicas: list) -> list:
    """The run's records as the simulator's RequestRecords, which fleet_sim.explain reads."""
    from shepherd.bench.records import RequestRecord
    from shepherd.sim.simulator import request_id
    index = {u: k for k, u in enumerate(replicas)}
    return [RequestRecord(req_id=request_id(tr, i), arrival=r["sent"], prompt_tokens=r["prompt"],
                          output_tokens=r["output"], finish=r["finish"], cached_tokens=r["cached"],
                          replica=index.get(r["backend"], -1)) for i, (tr, r) in enumerate(zip(trace, records))]


def run_router(a, policy: str, out: Path, trace, systems, plan) -> dict:
    reps, gw = start_fleet(a, policy, out / policy)
    try:
        for r in reps:
            r.start()
        gw.start()
        t0 = time.monotonic()
        if a.workload == "sessions":
            recs = asyncio.run(play_sessions(gw.url, trace))
        else:
            recs = asyncio.run(play_chat(a, gw.url, systems, plan))
        wall = time.monotonic() - t0
        bound = lru_bound(recs, reps[0].url, 3 * a.kv_capacity) if a.workload == "chat" else None
    finally:
        gw.stop()
        for r in reps:
            r.stop()
    urls = [r.url for r in reps]
    per = {u: 0 for u in urls}
    for x in recs:
        per[x["backend"]] = per.get(x["backend"], 0) + 1
    row = {"policy": policy, "requests": len(recs), "hit": sum(x["cached"] for x in recs) / sum(x["prompt"] for x in recs),
           "per_replica": list(per.values()), "max_over_mean": max(per.values()) / (len(recs) / 3),
           "e2e_p50": statistics.median(x["e2e"] for x in recs),
           "prompt_mean": statistics.mean(x["prompt"] for x in recs), "wall_s": wall}
    if a.workload == "chat":
        row["lru"] = bound
    else:
        from fleet_sim import explain
        b = session_bounds(trace, recs, 3 * a.kv_capacity)
        row.update(lru=b["lru_cluster"], lru_causal=b["lru_cluster_causal"], infinite=b["infinite"],
                   waited=sum(x["waited"] for x in recs))
        if a.explain:
            srec = sim_records(trace, recs, urls)
            row["explain"] = explain(trace, srec, 3 * a.kv_capacity)
            row["explain_causal"] = explain(trace, srec, 3 * a.kv_capacity, causal=True)
    (out / policy).mkdir(parents=True, exist_ok=True)
    (out / policy / "records.json").write_text(json.dumps(recs, indent=0))
    return row


def sessions_table(a, rows) -> str:
    r0 = rows[0]
    causal = ", ".join(f"{r['lru_causal']:.1%}" for r in rows)
    md = (f"`python benchmarks/fleet_gateway.py --executor {a.executor} --requests {a.requests}`: 3 replicas "
          f"(`shepherd serve --executor {a.executor} --max-total-tokens {a.kv_capacity}`, SmolLM2-135M's tokenizer), "
          f"the simulator's sessions trace scaled ({r0['requests']} requests, {a.turns} turns, {a.system_prompts} "
          f"shared system prompts of {a.system_tokens} tokens, mean prompt {r0['prompt_mean']:,.0f} tokens; the same "
          f"trace in the simulator: `{sim_command(a)}`), as token ids through `shepherd gateway`. Bounds from the "
          f"trace: one unlimited cache {r0['infinite']:.1%}, one LRU cache with the 3 replicas' KV {r0['lru']:.1%}; "
          f"causal (each router's run) {causal}.\n\n"
          "| router | prefix hit | of the LRU bound | of the causal bound | requests per replica | max/mean | "
          "turns that waited for the previous answer | e2e p50 ms |\n|---|---:|---:|---:|---|---:|---:|---:|\n")
    for r in rows:
        md += (f"| {r['policy']} | {r['hit']:.1%} | {r['hit'] / r['lru']:.3f} | {r['hit'] / r['lru_causal']:.3f} | "
               f"{', '.join(map(str, r['per_replica']))} | {r['max_over_mean']:.2f} | {r['waited']} | "
               f"{r['e2e_p50'] * 1e3:.0f} |\n")
    return md


def chat_table(a, rows) -> str:
    md = (f"`python benchmarks/fleet_gateway.py --workload chat --executor {a.executor} --sessions {a.sessions} "
          f"--turns {a.chat_turns}`: 3 replicas (`shepherd serve --executor {a.executor} --max-total-tokens "
          f"{a.kv_capacity}`, SmolLM2-135M), {rows[0]['requests']} chat requests (mean prompt "
          f"{rows[0]['prompt_mean']:.0f} tokens, {a.system_prompts} shared system prompts), through `shepherd gateway`.\n\n"
          "| router | prefix hit | cluster-LRU bound (this run) | of the bound | requests per replica | max/mean | "
          "e2e p50 ms |\n|---|---:|---:|---:|---|---:|---:|\n")
    for r in rows:
        md += (f"| {r['policy']} | {r['hit']:.1%} | {r['lru']:.1%} | {r['hit'] / r['lru']:.3f} | "
               f"{', '.join(map(str, r['per_replica']))} | {r['max_over_mean']:.2f} | {r['e2e_p50'] * 1e3:.0f} |\n")
    return md


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--executor", default="torch", choices=["torch", "sim"])
    ap.add_argument("--workload", default="sessions", choices=["sessions", "chat"])
    ap.add_argument("--kv-capacity", type=int, default=None, help="KV tokens per replica (sessions 8,192, chat 3,072)")
    # sessions: fleet_sim.py's generator and argument names, its defaults scaled (module doc)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--session-rate", type=float, default=None, help="new sessions per second (sessions 1.1, chat 0.5)")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--think-time", type=float, default=None, help="mean seconds between turns (sessions 5, chat 4)")
    ap.add_argument("--input-len", default="lognormal:75:0.8")
    ap.add_argument("--output-len", default="lognormal:38:0.8")
    ap.add_argument("--system-tokens", type=int, default=192)
    ap.add_argument("--system-prompts", type=int, default=3)
    # chat
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--chat-turns", type=int, default=6)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--routers", default=None)
    ap.add_argument("--precise-knob", action="append", default=[], metavar="K=V",
                    help="a knob for precise-prefix's gateway (--policy-knob), e.g. pressure_weight=0.02")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--explain", action="store_true", help="split each router's distance to the bounds (sessions)")
    ap.add_argument("--out", default=str(ROOT / "out" / "fleet_gateway"))
    ap.add_argument("--docs", action="store_true")
    a = ap.parse_args(argv)
    chat = a.workload == "chat"
    if a.kv_capacity is None:
        a.kv_capacity = 3072 if chat else 8192
    if a.session_rate is None:
        a.session_rate = 0.5 if chat else 1.1
    if a.think_time is None:
        a.think_time = 4.0 if chat else 5.0
    return a


def main() -> None:
    a = parse()
    chat = a.workload == "chat"
    out = Path(a.out)
    trace = systems = plan = None
    if chat:
        rng = random.Random(a.seed + 1)
        systems = [f"You are assistant number {i}. " + text(rng, a.system_words) for i in range(a.system_prompts)]
        plan = chat_plan(a)
    else:
        trace = session_trace(a)
        print(f"{len(trace)} requests; the same trace in the simulator: {sim_command(a)}", flush=True)
    rows = []
    for policy, _ in [r for r in ROUTERS if a.routers is None or r[0] in a.routers.split(",")]:
        row = run_router(a, policy, out, trace, systems, plan)
        rows.append(row)
        extra = (f" / causal {row['lru_causal']:.4f} = {row['hit'] / row['lru_causal']:.3f} waited {row['waited']}"
                 if not chat else "")
        print(f"{policy:15s} hit {row['hit']:.4f} lru-bound {row['lru']:.4f} ratio {row['hit'] / row['lru']:.3f}{extra}"
              f" per replica {row['per_replica']} e2e p50 {row['e2e_p50'] * 1e3:.0f} ms wall {row['wall_s']:.0f}s",
              flush=True)
    md = chat_table(a, rows) if chat else sessions_table(a, rows)
    print(md)
    xmd = ""
    if a.explain and not chat:
        from fleet_sim import explain_table
        xmd = explain_table(rows)
        print(xmd)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    if a.docs:
        from routing_sim import write_docs
        write_docs(md, mark="fleet-gateway-chat" if chat else "fleet-gateway")
        if xmd:
            write_docs(xmd, mark="fleet-gateway-explain")


if __name__ == "__main__":
    main()
