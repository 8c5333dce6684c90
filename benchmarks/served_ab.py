#!/usr/bin/env python
"""Two shepherd checkouts served side by side, measured alternately in one run: did a change
move the served tokens per second?

    python benchmarks/served_ab.py --a ../wt-base --b . [--rounds 6] [--streams 1,64] [--max-tokens 128]

Each checkout runs `shepherd serve` from its own folder and virtual environment (its
.venv/bin/python), both up for the whole run: an idle server blocks in its loop and takes no
CPU. Each round measures every stream count on A then B, the next round B then A (ABBA, so a
slow spell of the machine falls on both), with the workload of peers.py's openai-C rows: the
official `openai` client, C streaming chat completions of ~40-token prompts all in flight, 128
output tokens each (ignore_eos). It prints per server and stream count the median output tok/s
over the rounds, their spread, and B / A; --out writes every sample as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _openai_client import fixed_concurrency, questions  # noqa: E402
from shepherd.bench.loadgen import exit_on_sigterm, start_server, stop_server, wait_healthy  # noqa: E402

SERVED_NAME = "smollm2-135m"


def start(checkout: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    return start_server(["--served-model-name", SERVED_NAME, "--log-level", "warning", *extra], cwd=str(checkout),
                        python=str(checkout / ".venv" / "bin" / "python"))


def measure(url: str, c: int, max_tokens: int) -> float:
    res = asyncio.run(fixed_concurrency(url, SERVED_NAME, questions(c), c, c, max_tokens, {"ignore_eos": True}))
    if res["errors"]:
        raise RuntimeError(f"{url}: {res['errors']} requests failed")
    return res["tok_s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="checkout A (the baseline), with its .venv")
    ap.add_argument("--b", required=True, help="checkout B (the change), with its .venv")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--streams", default="1,64")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `shepherd serve` argument (repeat)")
    ap.add_argument("--out", default=None, help="write every sample here (JSON)")
    args = ap.parse_args()
    exit_on_sigterm()     # a cut-off run still stops the servers it started
    streams = [int(x) for x in args.streams.split(",") if x.strip()]
    names = {"A": Path(args.a).resolve(), "B": Path(args.b).resolve()}
    servers = {}
    try:
        for k, path in names.items():
            servers[k] = start(path, args.serve_arg)
        for k, (proc, url) in servers.items():
            wait_healthy(url, proc, timeout=600, what=f"server {k}")
            for c in streams:                       # warm-up: first-use costs out of the figures
                measure(url, c, 16)
        samples: dict = {k: {c: [] for c in streams} for k in servers}
        for r in range(args.rounds):
            order = ["A", "B"] if r % 2 == 0 else ["B", "A"]
            for c in streams:
                for k in order:
                    tok_s = measure(servers[k][1], c, args.max_tokens)
                    samples[k][c].append(tok_s)
                    print(f"[served_ab {time.strftime('%H:%M:%S')}] round {r + 1} {k} {c:>3} streams: "
                          f"{tok_s:8.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    print(f"A = {names['A']}\nB = {names['B']}\n{args.rounds} rounds (ABBA), {args.max_tokens} output tokens, "
          f"openai client\n")
    print("| streams | A tok/s (median) | A range | B tok/s (median) | B range | B / A |")
    print("|---:|---:|---:|---:|---:|---:|")
    for c in streams:
        a, b = samples["A"][c], samples["B"][c]
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"| {c} | {ma:.1f} | {min(a):.1f}-{max(a):.1f} | {mb:.1f} | {min(b):.1f}-{max(b):.1f} | {mb / ma:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"a": str(names["A"]), "b": str(names["B"]), "samples": samples},
                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
