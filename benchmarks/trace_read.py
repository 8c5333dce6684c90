"""How fast shepherd reads real trace files, and in how much memory (bench/trace_formats.py).

    python benchmarks/trace_read.py FILE [FILE ...] [--docs]

Each file is read whole by `shepherd.bench.traces.iter_trace` (the reader `simulate` and
`bench --trace` use; format from the file) in a process of its own, which reports the
requests it gave out, the rows' span, the seconds the read took and its peak RSS. The first
row is a process that imports the same modules and reads nothing: the readers stream, so a
file's peak should sit near it whatever the file's length. With --docs the table goes into
docs/SIMULATION.md (<!-- trace-read -->). Run it alone (the house's quiet gate): the
seconds are wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, resource, sys, time
from shepherd.bench.traces import iter_trace
from shepherd.bench.trace_formats import detect_format
path = sys.argv[1]
n = 0
span = 0.0
clients = set()
t0 = time.perf_counter()
if path != "-":
    for r in iter_trace(path):
        n += 1
        span = r.arrival
        clients.add(r.client)
dt = time.perf_counter() - t0
print(json.dumps({"format": detect_format(path) if path != "-" else "-", "requests": n, "span_s": span,
                  "clients": len(clients), "seconds": dt,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def read_one(path: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, env=env, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["file"] = "(nothing read)" if path == "-" else os.path.basename(path)
    row["mb"] = 0.0 if path == "-" else os.path.getsize(path) / 2**20
    return row


def table(rows) -> str:
    lines = ["| file | format | size MB | requests | span h | clients | read s | requests/s | peak RSS MB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rate = f"{r['requests'] / r['seconds']:,.0f}" if r["requests"] else "-"
        lines.append(f"| {r['file']} | {r['format']} | {r['mb']:.1f} | {r['requests']:,} | {r['span_s'] / 3600:.1f} | "
                     f"{r['clients']} | {r['seconds']:.2f} | {rate} | {r['peak_rss_mb']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--docs", action="store_true", help="write the table into docs/SIMULATION.md")
    a = ap.parse_args()
    rows = [read_one(p) for p in ["-", *a.files]]
    md = table(rows)
    print(md)
    if a.docs:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _docs import write_block
        write_block("SIMULATION.md", "trace-read", md + f"\nPython {platform.python_version()}\n")


if __name__ == "__main__":
    main()
