#!/usr/bin/env python
"""A client that opens a stream and stops reading: what does its answer hold in the server?

    python benchmarks/slow_reader.py [--roots /old/checkout,.@--max-logprob-entries=100000,.] [--seconds 60] [--docs]

For each checkout (`shepherd serve` runs from it; default this one; after an @, its own serve
flags, space-separated), starts serve with the real
model and sends one streamed completion from a raw socket with a 4 KB receive window: `n` 8,
`logprobs` 20, `max_tokens` 4,000, `ignore_eos`; then reads nothing. Every 5 s: the server
process's RSS above its figure at the start, and whether the requests still run (/metrics).
The requests end either by themselves (all tokens made) or by the server cutting the answer
(`--max-logprob-entries`: docs/SERVING.md, "Large answers").
"""
from __future__ import annotations

import argparse
import json
import re
import socket
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _docs import footer, publish  # noqa: E402
from _openai_client import rss_mb  # noqa: E402
from shepherd.bench.loadgen import exit_on_sigterm, start_server, stop_server, wait_healthy  # noqa: E402

RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", re.M)
MADE = re.compile(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", re.M)


def metric(url: str, rx) -> float:
    m = rx.search(httpx.get(url + "/metrics", timeout=30).text)
    return float(m.group(1)) if m else float("nan")


def one(root: str, seconds: float, serve_args: list) -> list[tuple]:
    proc, url = start_server(["--log-level", "warning", *serve_args], cwd=root)
    try:
        wait_healthy(url, proc, timeout=600)
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "The history of", "max_tokens": 4000, "n": 8, "logprobs": 20,
                           "stream": True, "ignore_eos": True}).encode()
        port = int(url.rsplit(":", 1)[1])
        base = rss_mb(proc.pid)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        rows, t0 = [], time.monotonic()
        while time.monotonic() - t0 < seconds:
            time.sleep(5.0)
            rows.append((time.monotonic() - t0, rss_mb(proc.pid) - base, metric(url, RUNNING), metric(url, MADE)))
            print(f"{root}: t+{rows[-1][0]:.0f} s RSS +{rows[-1][1]:.0f} MB, running {rows[-1][2]:.0f}, "
                  f"tokens made {rows[-1][3]:.0f}", flush=True)
        s.close()
        return rows
    finally:
        stop_server(proc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--roots", default=".", help="comma list of checkouts to serve from, each ROOT[@FLAGS]")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--docs", action="store_true")
    a = ap.parse_args()
    exit_on_sigterm()
    runs = []
    for item in a.roots.split(","):
        root, _, flags = item.partition("@")
        runs.append((item, one(str((ROOT / root).resolve()), a.seconds, flags.split())))
    every = max(1, len(runs[0][1]) // 6)          # about six columns, the last sample always
    picks = sorted({*range(every - 1, len(runs[0][1]), every), len(runs[0][1]) - 1})
    lines = ["| checkout (serve flags) | " + " | ".join(f"t+{runs[0][1][i][0]:.0f} s" for i in picks) + " |",
             "|---|" + "---:|" * len(picks)]
    for root, rows in runs:
        lines.append(f"| `{root}` | " + " | ".join(f"+{rows[i][1]:.0f} MB, {rows[i][2]:.0f} running, "
                                                  f"{rows[i][3]:,.0f} tokens" for i in picks if i < len(rows)) + " |")
    lines += ["", footer(f"python benchmarks/slow_reader.py --roots '{a.roots}' --seconds {a.seconds:g}"
                         f"{' --docs' if a.docs else ''}")]
    publish("\n".join(lines), "SERVING.md", "slow-reader", a.docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
