#!/usr/bin/env python
"""Can one client fill the engine's memory with compiled grammars? Distinct large grammars,
each held while its request runs, against `--max-grammar-memory`.

    python benchmarks/grammar_memory.py [--requests 30] [--bounds 0,256,1024] [--docs]

For each bound (MiB; 0 = no bound, the tree before the bound), starts `shepherd serve` (the
real model) with one request running at a time (--max-batch-size 1: the others wait in the
queue, as they would behind a busy batch) and sends --requests streamed completions, one
after another, each with its own guided_regex: an alternation of 4,000 random 25-letter words
then `[a-z ]*` (~102 KB, under --max-grammar-bytes; ~50 MB compiled), ignore_eos and a long
max_tokens, so every accepted request holds its grammar until the end. The next request is sent
once the previous one is accepted (its response has begun) or refused (the grammar checker
compiles one spec at a time anyway). Reported: the answers, the engine-core process's RSS before
and once every request is in, and the largest RSS seen; then the streams are closed (aborted).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _docs import footer, publish  # noqa: E402
from _openai_client import descendants, rss_mb  # noqa: E402
from shepherd.bench.loadgen import exit_on_sigterm, start_server, stop_server, wait_healthy  # noqa: E402

NAME = "smollm2-135m"


def regex(rng: random.Random, words: int = 4000) -> str:
    alts = ("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(25)) for _ in range(words))
    return "(" + "|".join(alts) + ")[a-z ]*"


async def attack(url: str, n: int, max_tokens: int, core: int, seed: int) -> dict:
    import openai
    rng = random.Random(seed)
    oc = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    peak = [rss_mb(core)]
    statuses: dict[str, int] = {}
    open_streams = []

    async def watch():
        while True:
            peak[0] = max(peak[0], rss_mb(core))
            await asyncio.sleep(0.1)

    watcher = asyncio.ensure_future(watch())
    try:
        for _ in range(n):
            try:
                # returns once the response has begun: the core admitted it, its grammar held
                s = await oc.completions.create(model=NAME, prompt="Words:", max_tokens=max_tokens, stream=True,
                                                extra_body={"guided_regex": regex(rng), "ignore_eos": True})
                open_streams.append(s)
                key = "200"
            except openai.APIStatusError as e:
                key = str(e.status_code)
            statuses[key] = statuses.get(key, 0) + 1
        await asyncio.sleep(0.5)              # let the last one's memory show in /proc
        held = rss_mb(core)
    finally:
        watcher.cancel()
        for s in open_streams:
            await s.close()
        await oc.close()
    return {"statuses": statuses, "held": held, "peak": max(peak[0], held)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--bounds", default="0,256,1024", help="--max-grammar-memory values, MiB (0: no bound)")
    ap.add_argument("--max-tokens", type=int, default=8000)
    ap.add_argument("--docs", action="store_true")
    a = ap.parse_args()
    exit_on_sigterm()
    rows = []
    for bound in [int(b) for b in a.bounds.split(",")]:
        proc, url = start_server(["--served-model-name", NAME, "--log-level", "warning", "--max-batch-size", 1,
                                  "--max-grammar-memory", bound], cwd=ROOT)
        try:
            wait_healthy(url, proc, timeout=600)
            core = max(descendants(proc.pid), key=rss_mb)    # the engine core: it holds the model
            base = rss_mb(core)
            t0 = time.monotonic()
            r = asyncio.run(attack(url, a.requests, a.max_tokens, core, seed=bound))
            r.update(bound=bound, base=base, wall=time.monotonic() - t0)
            rows.append(r)
            print(r, flush=True)
        finally:
            stop_server(proc)
    lines = [f"| --max-grammar-memory | answers to {a.requests} distinct grammars | engine-core RSS before, MB "
             "| once all were sent, MB | largest, MB | wall, s |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        answers = ", ".join(f"{k} x{v}" for k, v in sorted(r["statuses"].items()))
        lines.append(f"| {r['bound'] or 'no bound (0)'} | {answers} | {r['base']:,.0f} | {r['held']:,.0f} | "
                     f"{r['peak']:,.0f} | {r['wall']:.0f} |")
    lines += ["", footer(f"python benchmarks/grammar_memory.py --requests {a.requests} --bounds {a.bounds}"
                         f"{' --docs' if a.docs else ''}")]
    publish("\n".join(lines), "SERVING.md", "grammar-memory", a.docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
