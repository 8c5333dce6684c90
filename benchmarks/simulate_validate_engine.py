"""The simulator against the real engine on this CPU (SmolLM2-135M):

1. `shepherd calibrate --served` times the torch executor (driven by the real
   Scheduler) over a grid of batches and writes a fitted cost model, then
   measures the served path's per-step overhead over HTTP (its TPOT at 1 and
   16 streams minus the fitted step);
2. `shepherd serve` runs the real engine with fixed scheduler knobs;
3. `shepherd bench` replays three Poisson workloads: light, saturating, and a
   shared-prefix one (every request opens with the same system prompt), the
   same synthetic spec file for both sides (same arrivals, same lengths);
4. `shepherd simulate` runs the same specs with the calibrated model (its
   per-step scheduler overhead included) and the same knobs;
5. prints TTFT p50, TPOT p50 and throughput side by side and, unless
   --no-docs, writes the table into docs/SIMULATION.md.

Run it on a quiet machine, after the engine's speed work has landed: the
calibration and the benchmark must see the same machine. Both run the engine on
one thread unless --num-threads says otherwise (why: at --num-threads below).

    .venv/bin/python benchmarks/simulate_validate_engine.py [--num-requests 60]
        [--input-len 128] [--output-len 64] [--num-threads 1] [--cost-model FILE] [--out out/validate] [--no-docs]
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from shepherd.bench import loadgen

PY = sys.executable


def run(cmd, **kw):
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="light:0.5:0,saturated:4:0,shared-prefix:2:512",
                    help="NAME:RATE:SHARED_PREFIX_TOKENS,...")
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--num-requests", type=int, default=60)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--max-num-tokens", type=int, default=512)
    # one thread by default: on this 2-vCPU VM a two-thread engine's one-row step moves 4.9-8.9 ms
    # from one 30-step median to the next (one thread: 8.7-11.0 ms, half of them within +-2 %), more
    # than the 10 % the comparison is judged by; its barriers wait on whichever vCPU runs late
    ap.add_argument("--num-threads", type=int, default=1, help="engine threads, both sides (default 1)")
    ap.add_argument("--cost-model", default=None, help="skip calibration, use this fitted model")
    ap.add_argument("--port", type=int, default=8471)
    ap.add_argument("--out", default="out/validate")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    knobs = ["--max-total-tokens", str(a.max_total_tokens), "--max-batch-size", str(a.max_batch_size),
             "--max-num-tokens", str(a.max_num_tokens), "--admission", "optimistic"]
    threads = ["--num-threads", str(a.num_threads)]
    cost = a.cost_model or str(out / "cost_cpu.json")
    if not a.cost_model:
        run([PY, "-m", "shepherd", "calibrate", "--out", cost, "--batch-sizes", "1,2,4,8,16,32",
             "--prompt-lens", f"{a.input_len // 2},{a.input_len},{a.input_len * 4}", "--decode-steps", "10",
             "--max-num-tokens", str(a.max_num_tokens), "--served"] + threads)
    server = subprocess.Popen([PY, "-m", "shepherd", "serve", "--port", str(a.port)] + knobs + threads,
                              stdout=open(out / "serve.log", "w"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{a.port}"
        loadgen.wait_healthy(url, server, timeout=600, what="shepherd serve")
        rows = []
        for i, w in enumerate(a.workloads.split(",")):
            name, rate, shared = w.split(":")
            spec = out / f"spec_{name}.json"
            spec.write_text(json.dumps({"seed": 1, "num_requests": a.num_requests, "clients": [
                {"name": "default", "rate": float(rate), "input_len": f"fixed:{a.input_len}",
                 "output_len": f"fixed:{a.output_len}", "system_prompt_tokens": int(shared)}]}))
            bdir, sdir = out / f"bench_{name}", out / f"sim_{name}"
            # one server serves every workload: a prompt seed of its own per workload, or the prefix
            # cache would serve one workload's prompts from the last one's (the simulator starts cold)
            run([PY, "-m", "shepherd", "bench", "--url", url, "--trace", str(spec), "--out", str(bdir),
                 "--seed", str(100 + i), "--no-progress", "--no-plots"])
            run([PY, "-m", "shepherd", "simulate", "--trace", str(spec), "--cost-model", cost,
                 "--model", "smollm2-135m", "--gpu", "cpu", "--out", str(sdir), "--no-progress",
                 "--no-plots"] + knobs)
            rows.append((f"{name} ({rate} req/s)", json.loads((bdir / "summary.json").read_text()),
                         json.loads((sdir / "summary.json").read_text())))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    table = render(rows)
    print(table)
    if not a.no_docs:
        write_docs(table, cost, a.num_threads)


def render(rows) -> str:
    lines = ["| workload | metric | real engine (bench) | simulated (calibrated) | sim / real |",
             "|---|---|---:|---:|---:|"]
    for label, b, s in rows:
        for key, unit, scale in (("ttft_p50", "ms", 1e3), ("tpot_p50", "ms", 1e3),
                                 ("output_tok_s", "tok/s", 1), ("throughput_req_s", "req/s", 1)):
            bv, sv = b.get(key), s.get(key)
            if bv is None or sv is None:
                lines.append(f"| {label} | {key} | {bv} | {sv} | - |")
                continue
            ratio = sv / bv if bv else float("nan")
            flag = "" if abs(ratio - 1) <= 0.10 else " **(>10%)**"
            lines.append(f"| {label} | {key} | {bv * scale:.1f} {unit} | {sv * scale:.1f} {unit} | {ratio:.2f}{flag} |")
    return "\n".join(lines)


def write_docs(table: str, cost: str, threads: int, mark: str = "engine-validation") -> None:
    path = Path(__file__).resolve().parent.parent / "docs" / "SIMULATION.md"
    text = path.read_text()
    oh = json.loads(Path(cost).read_text())
    so = oh.get("meta", {}).get("served_overhead") or {}
    served = (f" (served path over HTTP: TPOT at 1-16 requests in flight minus the fitted step, least squares; "
              f"the scheduler's own share: {so.get('scheduler_fixed', 0) * 1e3:.3f} ms + "
              f"{so.get('scheduler_per_req', 0) * 1e6:.1f} us); frontend latency "
              f"{oh.get('frontend', 0) * 1e3:.1f} ms (one request's TTFT alone minus the modelled prefill)"
              if so else "")
    block = (f"<!-- {mark} -->\n{table}\n\nCalibrated per-step overhead: "
             f"{oh.get('cpu_fixed', 0) * 1e3:.3f} ms + {oh.get('cpu_per_req', 0) * 1e6:.1f} us per request{served}. "
             f"Engine threads: {threads}. `python benchmarks/simulate_validate_engine.py`, "
             f"{time.strftime('%Y-%m-%d %H:%M')}.\n<!-- /{mark} -->")
    pat = re.compile(rf"<!-- {mark} -->.*?<!-- /{mark} -->", re.S)
    text = pat.sub(block, text) if pat.search(text) else text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    main()
