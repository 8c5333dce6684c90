#!/usr/bin/env python
"""Constrained against unconstrained decoding on one shepherd server: json-64 / openai-64.

    python benchmarks/grammar_served.py [--rounds 3] [--checkout PATH] [--label NAME] [--write]

Starts one `shepherd serve` (the tree at --checkout, default this one, with this Python and
PYTHONPATH=checkout) and alternates peers.py's two 64-stream workloads against it, with the
official `openai` client: openai-64 (64 streaming chat completions of ~40-token prompts, 128
output tokens, ignore_eos, all in flight) and json-64 (the same with a `json_schema`
response_format). Round r runs openai-64 then json-64, the next round json-64 then
openai-64, so a slow spell of the machine falls on both. The first json-64 run is cold (the
server and the engine compile the schema while its requests wait); the rest are warm. Prints
every round and the medians; --write puts the table into docs/BENCHMARKS.md (block
`grammar-served-LABEL`).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _docs import write_block  # noqa: E402
from _openai_client import fixed_concurrency, json_schema_format, questions  # noqa: E402
from shepherd.bench.loadgen import exit_on_sigterm, start_server, stop_server, wait_healthy  # noqa: E402

SERVED_NAME = "smollm2-135m"
WORKLOADS = ("openai-64", "json-64")


def start(checkout: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    return start_server(["--served-model-name", SERVED_NAME, "--log-level", "warning", *extra], cwd=str(checkout),
                        env={**os.environ, "PYTHONPATH": str(checkout)})


def run(url: str, workload: str, streams: int, max_tokens: int) -> dict:
    fmt = json_schema_format() if workload.startswith("json") else None
    res = asyncio.run(fixed_concurrency(url, SERVED_NAME, questions(streams), streams, streams, max_tokens,
                                        {"ignore_eos": True}, response_format=fmt))
    if res["errors"]:
        raise RuntimeError(f"{workload}: {res['errors']} requests failed: {res['first_error']}")
    return res


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "this CPU"


def table(rounds: list[dict], label: str, cmd: str, rev: str) -> str:
    out = [f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {cpu_name()}"
           f" ({os.cpu_count()} cores), server tree {rev} ({label}); `{cmd}`.", "",
           "| round | openai-64 tok/s | json-64 tok/s | json / openai | TTFT p50 openai / json (ms) "
           "| TPOT p50 openai / json (ms) |",
           "|---|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(rounds):
        o, j = r["openai-64"], r["json-64"]
        tag = f"{i + 1}{' (json cold)' if i == 0 else ''}"
        out.append(f"| {tag} | {o['tok_s']:.1f} | {j['tok_s']:.1f} | {j['tok_s'] / o['tok_s']:.3f} | "
                   f"{o['ttft_p50'] * 1e3:,.0f} / {j['ttft_p50'] * 1e3:,.0f} | "
                   f"{o['tpot_p50'] * 1e3:.1f} / {j['tpot_p50'] * 1e3:.1f} |")

    def med(rs, w, k="tok_s"):
        return statistics.median(r[w][k] for r in rs)
    for name, rs in (("median, all rounds", rounds), ("median, warm rounds (2..)", rounds[1:])):
        if not rs:
            continue
        o, j = med(rs, "openai-64"), med(rs, "json-64")
        out.append(f"| {name} | {o:.1f} | {j:.1f} | **{j / o:.3f}** | "
                   f"{med(rs, 'openai-64', 'ttft_p50') * 1e3:,.0f} / {med(rs, 'json-64', 'ttft_p50') * 1e3:,.0f} | "
                   f"{med(rs, 'openai-64', 'tpot_p50') * 1e3:.1f} / {med(rs, 'json-64', 'tpot_p50') * 1e3:.1f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkout", default=str(HERE.parent), help="the shepherd tree to serve")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `shepherd serve` argument (repeat)")
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--write", action="store_true", help="write the table into docs/BENCHMARKS.md")
    a = ap.parse_args()
    exit_on_sigterm()     # a cut-off run still stops the servers it started
    checkout = Path(a.checkout).resolve()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True,
                         text=True).stdout.strip() or checkout.name
    proc, url = start(checkout, a.serve_arg)
    rounds: list[dict] = []
    try:
        wait_healthy(url, proc, what="shepherd serve")
        run(url, "openai-64", 2, 4)                      # warm-up, unconstrained (as peers.py)
        for r in range(a.rounds):
            order = WORKLOADS if r % 2 == 0 else WORKLOADS[::-1]
            got = {w: run(url, w, a.streams, a.max_tokens) for w in order}
            rounds.append(got)
            print(f"[grammar_served] round {r + 1}: " + ", ".join(
                f"{w} {got[w]['tok_s']:.1f} tok/s" for w in WORKLOADS), file=sys.stderr, flush=True)
    finally:
        stop_server(proc)
    cmd = "python benchmarks/grammar_served.py " + " ".join(sys.argv[1:])
    md = table(rounds, a.label, cmd, rev)
    print(md)
    if a.write:
        slug = "".join(c if c.isalnum() else "-" for c in a.label.lower()).strip("-")
        print(f"wrote {write_block('BENCHMARKS.md', f'grammar-served-{slug}', md)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
