#!/usr/bin/env python
"""Which shepherd files one request visits on its way through `shepherd serve`: HTTP in, the
engine-core process, a token out, measured rather than read off the code.

    python benchmarks/request_path.py [--max-tokens 8] [--executor sim|torch] [--json OUT]

It starts `shepherd serve` (engine core in its own process) with a profile hook in both
processes (benchmarks/_path_trace/sitecustomize.py), sends one warm-up request, then turns the
hook on (SIGUSR1 to both processes), sends one streaming chat completion with the official
`openai` client, turns it off (SIGUSR2) and prints, per process and in total:

  files    the shepherd files in which at least one function ran for the request
  visits   the distinct hand-offs into a file: a call from a function in file A into one in
           file B (A != B), or from outside shepherd (the event loop, uvicorn, a library) into B,
           counts once however often it repeats (every token repeats them)
  calls    how many calls crossed into a file in all (grows with the tokens)

The server's own timers (the core-process watchdog check, once a second) run inside the window
as well; they are part of what serving a request costs, and visit no file the request does not.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shepherd.bench.loadgen import free_port, wait_healthy  # noqa: E402
from _openai_client import children  # noqa: E402


def one_request(url: str, max_tokens: int) -> str:
    from openai import OpenAI
    client = OpenAI(base_url=url + "/v1", api_key="none")
    stream = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=max_tokens, temperature=0.0, stream=True)
    return "".join((c.choices[0].delta.content or "") for c in stream if c.choices)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--executor", choices=["torch", "sim"], default="torch")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the raw per-process traces here")
    args = ap.parse_args()
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, SHEPHERD_PATH_TRACE=tmp,
                   PYTHONPATH=os.pathsep.join([str(ROOT / "benchmarks" / "_path_trace"), str(ROOT),
                                               os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "shepherd", "serve", "--port", str(port), "--executor", args.executor,
               "--served-model-name", "smollm2-135m", "--log-level", "warning"]
        server = subprocess.Popen(cmd, env=env, cwd=ROOT)
        try:
            wait_healthy(url, server, timeout=300, what="`shepherd serve`")
            one_request(url, args.max_tokens)          # warm-up: imports, first-call caches
            pids = [server.pid] + children(server.pid)
            for p in pids:
                os.kill(p, signal.SIGUSR1)
            time.sleep(0.2)
            text = one_request(url, args.max_tokens)
            time.sleep(0.2)
            for p in pids:
                os.kill(p, signal.SIGUSR2)
            deadline = time.monotonic() + 10
            while len(list(Path(tmp).glob("*.json"))) < len(pids) and time.monotonic() < deadline:
                time.sleep(0.1)
            traces = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("*.json"))]
        finally:
            server.terminate()
            server.wait(30)
    report(traces, text, server.pid)
    if args.json:
        Path(args.json).write_text(json.dumps(traces, indent=1))
    return 0


def report(traces: list[dict], text: str, server_pid: int) -> None:
    print(f"one streaming chat completion through `shepherd serve` (answer: {text!r})\n")
    all_files: set = set()
    all_edges: set = set()
    calls = 0
    for t in traces:
        if not t["files"]:
            continue         # a helper process of multiprocessing (resource tracker): no shepherd code ran
        role = "server" if t["pid"] == server_pid else "engine core"
        edges = [(a, b, n) for a, b, n in t["edges"]]
        print(f"{role} (pid {t['pid']}): {len(t['files'])} files, {len(edges)} visits, "
              f"{sum(n for *_, n in edges)} cross-file calls")
        for f, n in sorted(t["files"].items()):
            print(f"    {f:45s} {n:7d} calls")
        for a, b, n in edges:
            print(f"      {a} -> {b}  x{n}")
        all_files |= set(t["files"])
        all_edges |= {(a, b) for a, b, _ in edges}
        calls += sum(n for *_, n in edges)
    print(f"\ntotal: {len(all_files)} files, {len(all_edges)} visits, {calls} cross-file calls")


if __name__ == "__main__":
    sys.exit(main())
