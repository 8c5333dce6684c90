"""What publishing KV events costs a served replica: 64 streams, events on vs off.

    python benchmarks/kv_events_cost.py [--rounds 3] [--requests 192] [--docs]
    python benchmarks/kv_events_cost.py --against DIR [--rounds 4] [--requests 128]

Two `shepherd serve` processes of the default model (SmolLM2-135M, torch executor,
the same flags) run side by side; one publishes its KV events
(--kv-events-config, PUB + replay on loopback) to a subscriber in this process
that builds the gateway's index from them, as a fleet router would. The official
`openai` client (benchmarks/_openai_client.py) keeps 64 streaming chat requests
in flight (max_tokens 128, ignore_eos) against one server at a time, in rounds
ordered off-on, on-off, off-on, ... (a drift of the machine over a round pair
falls on both); the figures are the median served tok/s of each, their ratio,
and each round's own on/off ratio with the median and range of those. Writes the table into docs/ROUTING.md (<!-- kv-events-cost -->) with --docs.

--against DIR compares two trees instead, both publishing: the "off" server runs the
shepherd package found in DIR (an unpacked earlier commit: PYTHONPATH=DIR) with events
on, the "on" server this tree's, for a before/after of an engine change at 64 streams
(--docs is refused with it).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from _openai_client import fixed_concurrency, questions  # noqa: E402
from peers import Server, free_port  # noqa: E402

NAME = "smollm2-135m"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=192, help="requests per round (64 in flight)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "out" / "kv_events_cost"))
    ap.add_argument("--docs", action="store_true")
    ap.add_argument("--against", default=None, help="a tree whose shepherd runs as the baseline, events on")
    a = ap.parse_args()
    if a.against and a.docs:
        ap.error("--against writes no docs table")
    from shepherd.kv_events.index import KVBlockIndex
    from shepherd.kv_events.subscriber import KVEventSubscriber, Source
    out = Path(a.out)
    py = sys.executable
    pub, rep = free_port(), free_port()
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                         "replay_endpoint": f"tcp://*:{rep}"})
    ports = {"off": free_port(), "on": free_port()}
    base = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{free_port()}",
                       "replay_endpoint": f"tcp://*:{free_port()}"})
    env = {"off": {"PYTHONPATH": str(Path(a.against).resolve())} if a.against else {}, "on": {}}
    flags = {"off": ["--kv-events-config", base] if a.against else [], "on": ["--kv-events-config", events]}
    # -P: the server's working directory is this tree; without it `-m` would import this tree's shepherd
    pre = {"off": ["-P"] if a.against else [], "on": []}
    servers = {k: Server(k, [([py, *pre[k], "-m", "shepherd", "serve", "--port", p, "--served-model-name", NAME, *flags[k]],
                              env[k])], p, out / k)
               for k, p in ports.items()}
    if a.against:
        print(f"off = {a.against} with events on; on = this tree with events on", flush=True)
    index = KVBlockIndex()
    sub = KVEventSubscriber(index, [Source("on", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}")])
    got: dict = {"off": [], "on": []}
    try:
        for s in servers.values():
            s.start()
        sub.start()
        body = {"ignore_eos": True}
        for k, s in servers.items():          # warm-up: first requests pay one-time costs
            asyncio.run(fixed_concurrency(s.url, NAME, questions(4), 4, 8, 16, body))
        for rnd in range(a.rounds):
            for k in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
                r = asyncio.run(fixed_concurrency(servers[k].url, NAME, questions(a.requests), a.concurrency,
                                                  a.requests, a.max_tokens, body))
                assert r["errors"] == 0, r
                got[k].append(r["tok_s"])
                print(f"round {rnd + 1} events {k:3s}: {r['tok_s']:.1f} tok/s (TTFT p50 {r['ttft_p50'] * 1e3:.0f} ms, "
                      f"TPOT p50 {r['tpot_p50'] * 1e3:.1f} ms)", flush=True)
        st = sub.status()["on"]
        blocks = index.blocks("on")
    finally:
        sub.close()
        for s in servers.values():
            s.stop()
    off, on = statistics.median(got["off"]), statistics.median(got["on"])
    ratios = [y / x for x, y in zip(got["off"], got["on"])]
    md = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, `python benchmarks/kv_events_cost.py "
          f"--rounds {a.rounds} --requests {a.requests}` ({a.concurrency} streams, max_tokens {a.max_tokens}); "
          f"the subscriber applied {st['batches']} batches ({st['gaps']} gaps, {st['drops']} drops), its index "
          f"ended with {blocks} blocks.\n\n"
          "| events | served tok/s, each round | median | ratio |\n|---|---|---:|---:|\n"
          f"| off | {', '.join(f'{x:.1f}' for x in got['off'])} | {off:.1f} | 1.000 |\n"
          f"| on | {', '.join(f'{x:.1f}' for x in got['on'])} | {on:.1f} | {on / off:.3f} |\n"
          f"\nEach round's on/off ratio: {', '.join(f'{r:.3f}' for r in ratios)}; median "
          f"{statistics.median(ratios):.3f}, range {min(ratios):.3f} to {max(ratios):.3f}.\n")
    print(md)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"off": got["off"], "on": got["on"], "ratios": ratios,
                                                  "subscriber": st}, indent=1))
    if a.docs:
        from routing_sim import write_docs
        write_docs(md, mark="kv-events-cost")


if __name__ == "__main__":
    main()
