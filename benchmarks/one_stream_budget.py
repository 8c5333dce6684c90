#!/usr/bin/env python
"""Where one served stream's time per token goes: the engine's step beside the whole token, and
the CPU that every process spends per token.

    python benchmarks/one_stream_budget.py [--rounds 2] [--streams 1] [--docs]

Starts `shepherd serve` (the defaults, optimistic admission as peers.py's shepherd-optimistic),
warms it up, then runs peers.py's free-1 workload --rounds times: the official `openai` client,
8 questions one at a time, 128 streamed tokens each (EOS ignored). Per round it reports the
client's tok/s and TPOT p50, the mean wall time per decoded token (the requests' time after their
first token over the tokens after the first), the engine's mean executor step from the server's
own /metrics (shepherd:step_time_seconds: build input, forward, sample), what the token costs
beyond it (the scheduler, the core loop and its pipe, and every stall of the step's two threads
while the server and the client take a core), and the CPU seconds per token of the server
process (HTTP, detokenising, SSE), the engine-core process (its OpenMP threads spin at their
barriers, so ~2x the wall) and this client. --streams N (N > 1) runs N requests at once per round
instead (128 tokens each; "wall per decoded token" is then the wall per decode step, every stream's
token together); the CPU columns stay per generated token. --docs writes the table into docs/SERVING.md
(<!-- one-stream-budget -->).
"""
from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _docs import footer, publish  # noqa: E402
from _openai_client import children, fixed_concurrency, questions  # noqa: E402
from proc_sampler import cpu_io  # noqa: E402
from shepherd.bench.loadgen import exit_on_sigterm, start_server, stop_server, wait_healthy  # noqa: E402
from shepherd.bench.metrics_poll import parse_prometheus  # noqa: E402

NAME = "smollm2-135m"


def steps(url: str) -> tuple[float, float]:
    m = parse_prometheus(httpx.get(url + "/metrics", timeout=5).text)
    return m.get("shepherd:step_time_seconds_sum", 0.0), m.get("shepherd:step_time_seconds_count", 0.0)


def one_round(url: str, server: int, core: list[int], streams: int = 1) -> dict:
    c0 = {p: cpu_io(p)[0] for p in [server, *core]}
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    s0 = steps(url)
    requests = 8 if streams == 1 else streams
    groups = requests // streams            # requests that ran one after another per stream
    res = asyncio.run(fixed_concurrency(url, NAME, questions(requests), streams, requests, 128, {"ignore_eos": True}))
    s1 = steps(url)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    c1 = {p: cpu_io(p)[0] for p in c0}
    if res["errors"]:
        raise RuntimeError(f"{res['errors']} requests failed: {res['first_error']}")
    n = res["tokens"]
    # the decode steps' share of the wall: each request's first token came after its TTFT
    decode_ms = (res["wall_s"] - groups * res["ttft_p50"]) / (n / streams - groups) * 1e3
    step_ms = (s1[0] - s0[0]) / max(1.0, s1[1] - s0[1]) * 1e3
    client = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    return {"tok_s": res["tok_s"], "tpot": res["tpot_p50"] * 1e3, "token": decode_ms, "step": step_ms,
            "server": (c1[server] - c0[server]) / n * 1e3, "core": sum(c1[p] - c0[p] for p in core) / n * 1e3,
            "client": client / n * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", type=int, default=1, help="requests in flight (N > 1: N requests a round)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `shepherd serve` argument (repeat)")
    ap.add_argument("--docs", action="store_true")
    a = ap.parse_args()
    exit_on_sigterm()     # a cut-off run still stops the servers it started
    if a.docs and a.streams != 1:
        ap.error("--docs writes the one-stream table: run it without --streams")
    proc, url = start_server(["--admission", "optimistic", "--served-model-name", NAME, "--log-level", "warning",
                              *a.serve_arg], cwd=ROOT)
    rows = []
    try:
        wait_healthy(url, proc, timeout=600)
        asyncio.run(fixed_concurrency(url, NAME, questions(2), 1, 2, 32, {"ignore_eos": True}))   # warm-up
        core = children(proc.pid)
        for _ in range(a.rounds):
            rows.append(one_round(url, proc.pid, core, a.streams))
    finally:
        stop_server(proc)
    lines = ["| round | tok/s | TPOT p50, ms | wall per decoded token, ms | engine step (mean), ms | "
             "beyond the step, ms | CPU per token, ms: server / engine core / client |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | {r['tok_s']:.1f} | {r['tpot']:.2f} | {r['token']:.2f} | {r['step']:.2f} | "
                     f"{r['token'] - r['step']:.2f} | {r['server']:.3f} / {r['core']:.2f} / {r['client']:.2f} |")
    lines += ["", footer(f"python benchmarks/one_stream_budget.py --rounds {a.rounds}"
                         f"{f' --streams {a.streams}' if a.streams != 1 else ''}{' --docs' if a.docs else ''}")]
    publish("\n".join(lines), "SERVING.md", "one-stream-budget", a.docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
