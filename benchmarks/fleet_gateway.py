"""Precise prefix routing through a real gateway over 3 real replicas, on a scaled multi-turn workload.

    python benchmarks/fleet_gateway.py [--executor torch|sim] [--sessions 24] [--turns 6] [--docs]

Three `shepherd serve` processes (the default model; --executor sim keeps the real
engine, HTTP and KV events but paces steps with the cost model instead of running
the weights) publish their KV events; `shepherd gateway` routes chat requests over
them with each router in turn (fresh replicas for each, so every router starts from
empty caches); precise-prefix subscribes to the three streams (--kv-events) and asks
a replica's /tokenize for each prompt's token ids.

The client (httpx, asyncio) plays --sessions chat sessions: each starts at a
Poisson time, opens with one of --system-prompts shared system prompts and sends
--turns user messages, each after an exponential think time, with the whole
history (its previous questions and the replica's answers) as an OpenAI client
does. Reported per router: the prefix hit rate (usage.prompt_tokens_details.
cached_tokens over prompt tokens, as the replicas count them), max/mean requests
per replica (x-shepherd-backend), TTFT-free end-to-end latency p50, and the same
request stream replayed in arrival order through one radix cache as large as the
three replicas' KV together (shepherd's own RadixCache: the cluster-LRU bound of
this run). Writes OUT/results.json and, with --docs, docs/ROUTING.md
(<!-- fleet-gateway -->).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
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
ROUTERS = [("least-request", []), ("cache-aware", []), ("precise-prefix", [])]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def sessions(a):
    """[(start time, system prompt index, [user messages], [think times])]."""
    rng = random.Random(a.seed)
    t = 0.0
    out = []
    for _ in range(a.sessions):
        t += rng.expovariate(a.session_rate)
        users = [text(rng, rng.randint(30, 70)) for _ in range(a.turns)]
        out.append((t, rng.randrange(a.system_prompts), users, [rng.expovariate(1 / a.think_time)
                                                                 for _ in range(a.turns)]))
    return out


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
    if policy == "cache-aware":
        gcmd += ["--policy-knob", "tokenizer_type=character"]
    gw = Server(f"gateway-{policy}", [(gcmd, {})], gport, out / f"gateway-{policy}")
    return reps, gw


async def play(a, url: str, systems: list, plan) -> list:
    import httpx
    records = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        t0 = time.monotonic()

        async def session(start, sysi, users, thinks):
            await asyncio.sleep(max(0.0, start - (time.monotonic() - t0)))
            msgs = [{"role": "system", "content": systems[sysi]}]
            for u, think in zip(users, thinks):
                msgs.append({"role": "user", "content": u})
                body = {"model": NAME, "messages": msgs, "max_tokens": a.max_tokens, "temperature": 0}
                t1 = time.monotonic()
                r = await c.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                j = r.json()
                usage = j["usage"]
                records.append({"t": t1 - t0, "backend": r.headers.get("x-shepherd-backend"),
                                "prompt": usage["prompt_tokens"], "output": usage["completion_tokens"],
                                "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                                "e2e": time.monotonic() - t1, "messages": list(msgs),
                                "answer": j["choices"][0]["message"]["content"]})
                msgs.append({"role": "assistant", "content": j["choices"][0]["message"]["content"]})
                await asyncio.sleep(think)

        await asyncio.gather(*(session(*s) for s in plan))
    return records


def lru_bound(records: list, replica_url: str, capacity: int) -> float:
    """The run's requests in arrival order through one radix cache with `capacity` tokens."""
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
        hit += tree.match_len(prompt[:-1])
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--executor", default="torch", choices=["torch", "sim"])
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--session-rate", type=float, default=0.5)
    ap.add_argument("--think-time", type=float, default=4.0)
    ap.add_argument("--system-prompts", type=int, default=3)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--kv-capacity", type=int, default=3072, help="KV tokens per replica")
    ap.add_argument("--routers", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "out" / "fleet_gateway"))
    ap.add_argument("--docs", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    rng = random.Random(a.seed + 1)
    systems = [f"You are assistant number {i}. " + text(rng, a.system_words) for i in range(a.system_prompts)]
    plan = sessions(a)
    rows = []
    for policy, _ in [r for r in ROUTERS if a.routers is None or r[0] in a.routers.split(",")]:
        reps, gw = start_fleet(a, policy, out / policy)
        try:
            for r in reps:
                r.start()
            gw.start()
            t0 = time.monotonic()
            recs = asyncio.run(play(a, gw.url, systems, plan))
            wall = time.monotonic() - t0
            bound = lru_bound(recs, reps[0].url, 3 * a.kv_capacity)
        finally:
            gw.stop()
            for r in reps:
                r.stop()
        per = {r.url: 0 for r in reps}
        for x in recs:
            per[x["backend"]] = per.get(x["backend"], 0) + 1
        hit = sum(x["cached"] for x in recs) / sum(x["prompt"] for x in recs)
        row = {"policy": policy, "requests": len(recs), "hit": hit, "lru": bound, "per_replica": list(per.values()),
               "max_over_mean": max(per.values()) / (len(recs) / 3), "e2e_p50": statistics.median(x["e2e"] for x in recs),
               "prompt_mean": statistics.mean(x["prompt"] for x in recs), "wall_s": wall}
        rows.append(row)
        print(f"{policy:15s} hit {hit:.4f} lru-bound {bound:.4f} ratio {hit / bound:.3f} per replica {row['per_replica']}"
              f" e2e p50 {row['e2e_p50'] * 1e3:.0f} ms wall {wall:.0f}s", flush=True)
    md = (f"`python benchmarks/fleet_gateway.py --executor {a.executor} --sessions {a.sessions} --turns {a.turns}`: "
          f"3 replicas (`shepherd serve --executor {a.executor} --max-total-tokens {a.kv_capacity}`, SmolLM2-135M), "
          f"{rows[0]['requests']} chat requests (mean prompt {rows[0]['prompt_mean']:.0f} tokens, {a.system_prompts} "
          f"shared system prompts), through `shepherd gateway`.\n\n"
          "| router | prefix hit | cluster-LRU bound (this run) | of the bound | requests per replica | max/mean | "
          "e2e p50 ms |\n|---|---:|---:|---:|---|---:|---:|\n")
    for r in rows:
        md += (f"| {r['policy']} | {r['hit']:.1%} | {r['lru']:.1%} | {r['hit'] / r['lru']:.3f} | "
               f"{', '.join(map(str, r['per_replica']))} | {r['max_over_mean']:.2f} | {r['e2e_p50'] * 1e3:.0f} |\n")
    print(md)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    if a.docs:
        from routing_sim import write_docs
        write_docs(md, mark="fleet-gateway")


if __name__ == "__main__":
    main()
