"""Threads on a shared machine: a 32-token request quiet and with a competing CPU load (issue 31, item 7).

    python benchmarks/threads_contention.py                             # the variants below, both loads
    python benchmarks/threads_contention.py --variant default= --variant "spin10k=env:GOMP_SPINCOUNT=10000"
    python benchmarks/threads_contention.py --write docs/SERVING.md

For each variant a real `shepherd serve` (SmolLM2, the engine core in its own
process) is started and left until its processes are idle (a guard: before
the server waited for its grammar worker, that worker imported xgrammar for
~1.5 s after /health answered); then, with the official
`openai` client:
- quiet: `--requests` 32-token completions one after another (greedy,
  ignore_eos), the median wall time of one;
- contended: the same while `--hogs` processes spin on the CPU (each a
  Python busy loop, started by this script after the server is up and
  stopped before the next measurement), for each value of --hogs;
- 64 streams: 64 concurrent 64-token chat requests, quiet, the served
  tok/s (what a variant costs when the machine is the server's).
Ratios are contended / quiet of the same variant. A variant is
`NAME=ARGS`: serve arguments, and `env:K=V` items for the core's environment.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from shepherd.bench.loadgen import exit_on_sigterm, start_server, stop_server, wait_healthy  # noqa: E402

MARK_BEGIN, MARK_END = "<!-- threads-contention:begin -->", "<!-- threads-contention:end -->"
DEFAULT_VARIANTS = [
    "default=",
    "fixed2=--num-threads 2",      # two spinning threads whatever the load: the layout before issue 31
    "passive=env:OMP_WAIT_POLICY=passive",
    "threads1=--num-threads 1",
]


def hog() -> None:
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    x = 0
    while True:
        x += 1


def settled(proc: subprocess.Popen, idle_cpu: float = 0.05, period: float = 0.5, timeout: float = 60.0) -> float:
    """Wait until the server and every process it started used under `idle_cpu` CPUs over one
    `period` (before serve waited for its grammar worker, it still imported xgrammar for ~1.5 s
    after /health answered, a core: measured, a competitor the quiet figure is not about). Returns the seconds waited."""
    from _openai_client import descendants
    from proc_sampler import cpu_io
    t0 = time.perf_counter()

    def used() -> float:
        return sum(cpu_io(p)[0] for p in [proc.pid] + descendants(proc.pid))
    while time.perf_counter() - t0 < timeout:
        a = used()
        time.sleep(period)      # the measuring window itself, not a stand-in for a signal
        if used() - a < idle_cpu * period:
            break
    return time.perf_counter() - t0


def parse_variant(text: str) -> tuple[str, list[str], dict]:
    name, _, rest = text.partition("=")
    args, env = [], {}
    for item in rest.split():
        if item.startswith("env:"):
            k, _, v = item[4:].partition("=")
            env[k] = v
        else:
            args.append(item)
    return name, args, env


async def one_request(client, model: str, max_tokens: int) -> float:
    t0 = time.perf_counter()
    r = await client.completions.create(model=model, prompt="Write a story about the sea.", max_tokens=max_tokens,
                                        temperature=0.0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == max_tokens
    return time.perf_counter() - t0


async def sequential(url: str, n: int, max_tokens: int) -> float:
    import httpx
    import openai
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600,
                                http_client=httpx.AsyncClient(timeout=600))
    model = (await client.models.list()).data[0].id
    await one_request(client, model, 4)                      # warm
    times = [await one_request(client, model, max_tokens) for _ in range(n)]
    await client.close()
    return statistics.median(times)


def measure(args, variant: str) -> dict:
    from _openai_client import fixed_concurrency, questions
    name, extra, env = parse_variant(variant)
    proc, url = start_server(["--max-total-tokens", "16384", "--log-level", "info"] + extra, cwd=ROOT,
                             env=dict(os.environ, **env), log=os.path.join(args.logs, f"threads-{name}.log"))
    out = {"name": name, "variant": variant}
    try:
        wait_healthy(url, proc, timeout=300, what=name)
        out["settled_s"] = settled(proc)
        out["quiet"] = asyncio.run(sequential(url, args.requests, args.tokens))
        for n in args.hogs:
            ctx = multiprocessing.get_context("spawn")
            hogs = [ctx.Process(target=hog, daemon=True) for _ in range(n)]
            for h in hogs:
                h.start()
            try:
                out[f"hogs{n}"] = asyncio.run(sequential(url, args.requests, args.tokens))
            finally:
                for h in hogs:
                    h.terminate()
                    h.join(5)
        model = asyncio.run(_model(url))
        res = asyncio.run(fixed_concurrency(url, model, questions(64), concurrency=64, num_requests=64,
                                            max_tokens=64, extra_body={"ignore_eos": True}))
        out["tok_s_64"] = res["tok_s"]
    finally:
        stop_server(proc)
    return out


async def _model(url: str) -> str:
    import httpx
    async with httpx.AsyncClient() as c:
        return (await c.get(url + "/v1/models")).json()["data"][0]["id"]


def table(rows: list, hogs: list, tokens: int) -> str:
    heads = [f"{tokens} tokens quiet"] + [f"with {n} hog{'s' * (n > 1)}" for n in hogs] + ["64 streams quiet"]
    lines = ["| variant | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    for r in rows:
        cells = ([f"{r['quiet']:.2f} s"] + [f"{r[f'hogs{n}']:.2f} s ({r[f'hogs{n}'] / r['quiet']:.1f}x)" for n in hogs]
                 + [f"{r['tok_s_64']:.0f} tok/s"])
        lines.append(f"| {r['name']} (`{r['variant'].partition('=')[2] or 'defaults'}`) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", default=None, help="NAME=ARGS (repeat); default: " +
                    "; ".join(DEFAULT_VARIANTS))
    ap.add_argument("--hogs", default="1,2", help="competing busy processes, comma list (default %(default)s)")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--logs", default="/tmp")
    ap.add_argument("--write", default=None, help="docs file to write the table into (between its markers)")
    args = ap.parse_args()
    exit_on_sigterm()     # a cut-off run still stops the servers it started
    args.hogs = [int(x) for x in args.hogs.split(",") if x]
    rows = []
    for v in args.variant or DEFAULT_VARIANTS:
        rows.append(measure(args, v))
        print(f"{rows[-1]['name']}: the server's processes were idle {rows[-1]['settled_s']:.1f} s after /health")
        print(table(rows[-1:], args.hogs, args.tokens).splitlines()[-1], flush=True)
    block = table(rows, args.hogs, args.tokens)
    print("\n" + block)
    if args.write:
        text = open(args.write, encoding="utf-8").read()
        a, b = text.index(MARK_BEGIN) + len(MARK_BEGIN), text.index(MARK_END)
        open(args.write, "w", encoding="utf-8").write(text[:a] + "\n" + block + "\n" + text[b:])


if __name__ == "__main__":
    main()
