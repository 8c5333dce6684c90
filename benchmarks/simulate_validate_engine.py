"""The simulator against the real engine on this CPU (SmolLM2-135M):

1. `shepherd calibrate --served` times the torch executor (driven by the real
   Scheduler) over a grid of batches and writes a fitted cost model, then
   measures the served path's per-step overhead over HTTP (its TPOT at 1-16
   streams minus the fitted step) and its frontend latency;
2. for each of three Poisson workloads (light, saturating, and a shared-prefix
   one whose requests all open with the same system prompt) a fresh `shepherd
   serve` runs the real engine with fixed scheduler knobs and `shepherd bench`
   replays the workload's synthetic spec file (same arrivals, same lengths as
   the simulator sees);
3. after each workload, calibrate again (step 1), so every workload sits
   between two calibrations (--calibrate once: one before them all);
4. `shepherd simulate` runs each spec with the calibration before it and the
   one after it, with the same knobs; the prediction is their mean;
5. repeats 1-4 --runs times (default 3) and prints, per figure, sim / real in
   every run and their median, what each calibration saw, and how many figures
   each way of using the calibrations brings within 10 %; unless --no-docs it
   writes all of it into docs/SIMULATION.md.

Run it on a quiet machine: this 2-vCPU VM's speed drifts by about 10 % over
minutes, the size of the target, which is why every workload is bracketed and
the whole comparison repeated. Both sides run the engine on one thread unless
--num-threads says otherwise (why: at --num-threads below). About 8 minutes a run.

    .venv/bin/python benchmarks/simulate_validate_engine.py [--runs 3] [--num-requests 60]
        [--input-len 128] [--output-len 64] [--num-threads 1] [--calibrate bracket|once] [--cost-model FILE]
        [--out out/validate] [--no-docs]
"""
import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from shepherd.bench import loadgen
from shepherd.sim.fitted_cost import load_cost_model

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
    # bracket by default: the machine's speed drifts by ~10 % over minutes, so a calibration taken
    # once up front can describe another machine than the one a later workload ran on
    ap.add_argument("--calibrate", choices=["bracket", "once"], default="bracket",
                    help="bracket: calibrate before and after every workload and simulate it with both; "
                         "once: one calibration before all (default bracket)")
    ap.add_argument("--cost-model", default=None, help="skip calibration, use this fitted model")
    ap.add_argument("--port", type=int, default=8471)
    ap.add_argument("--out", default="out/validate")
    # several runs by default: one noisy spell of this VM between a workload and both of its
    # calibrations moved one TPOT by 26 % in one run of five; the median over runs is the figure
    ap.add_argument("--runs", type=int, default=3, help="repeat the whole comparison; medians over runs")
    a = ap.parse_args()
    out = Path(a.out)
    knobs = ["--max-total-tokens", str(a.max_total_tokens), "--max-batch-size", str(a.max_batch_size),
             "--max-num-tokens", str(a.max_num_tokens), "--admission", "optimistic"]
    bracket = a.calibrate == "bracket" and not a.cost_model
    runs = [one_run(a, out / f"run{r + 1}" if a.runs > 1 else out, knobs, bracket) for r in range(max(1, a.runs))]
    parts = [render(runs)]
    for r, (rows, costs) in enumerate(runs):
        parts.append(f"Run {r + 1} of {len(runs)}, what each calibration saw:\n\n" + render_calibrations(costs))
        if bracket:
            parts.append(f"Run {r + 1}: " + render_methods(rows))
    table = "\n\n".join(parts)
    print(table)
    if not a.no_docs:
        write_docs(table, a.num_threads, bracket, len(runs))


def one_run(a, out: Path, knobs, bracket: bool):
    """Calibrate, and serve + bench + simulate every workload; ([(label, bench summary,
    [simulated summary per calibration], simulated with the first calibration)], cost paths)."""
    out.mkdir(parents=True, exist_ok=True)
    costs = [a.cost_model or calibrate(a, out / "cost_0.json")]
    rows = []
    for i, (name, rate, shared) in enumerate(w.split(":") for w in a.workloads.split(",")):
        spec = out / f"spec_{name}.json"
        spec.write_text(json.dumps({"seed": 1, "num_requests": a.num_requests, "clients": [
            {"name": "default", "rate": float(rate), "input_len": f"fixed:{a.input_len}",
             "output_len": f"fixed:{a.output_len}", "system_prompt_tokens": int(shared)}]}))
        bench = serve_and_bench(a, knobs, spec, out / f"bench_{name}", a.port + i)
        if bracket:
            costs.append(calibrate(a, out / f"cost_{i + 1}.json"))
        pair = [costs[-2], costs[-1]] if bracket else [costs[0]]
        sims = [simulate(spec, c, knobs, out / f"sim_{name}_{j}") for j, c in enumerate(pair)]
        once = simulate(spec, costs[0], knobs, out / f"sim_{name}_once") if bracket and i else sims[0]
        rows.append((f"{name} ({rate} req/s)", bench, sims, once))
    return rows, costs


def calibrate(a, path: Path) -> str:
    run([PY, "-m", "shepherd", "calibrate", "--out", str(path), "--batch-sizes", "1,2,4,8,16,32",
         "--prompt-lens", f"{a.input_len // 2},{a.input_len},{a.input_len * 4}", "--decode-steps", "10",
         "--max-num-tokens", str(a.max_num_tokens), "--served", "--num-threads", str(a.num_threads)])
    return str(path)


def serve_and_bench(a, knobs, spec: Path, bdir: Path, port: int) -> dict:
    """A fresh server per workload: nothing cached from the last one (the simulator starts cold
    too), and no engine idling beside the calibration that follows."""
    server = subprocess.Popen([PY, "-m", "shepherd", "serve", "--port", str(port), "--num-threads",
                               str(a.num_threads)] + knobs,
                              stdout=open(bdir.with_suffix(".serve.log"), "w"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        loadgen.wait_healthy(url, server, timeout=600, what="shepherd serve")
        run([PY, "-m", "shepherd", "bench", "--url", url, "--trace", str(spec), "--out", str(bdir),
             "--seed", str(port), "--no-progress", "--no-plots"])
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    return json.loads((bdir / "summary.json").read_text())


def simulate(spec: Path, cost: str, knobs, sdir: Path) -> dict:
    run([PY, "-m", "shepherd", "simulate", "--trace", str(spec), "--cost-model", cost,
         "--model", "smollm2-135m", "--gpu", "cpu", "--out", str(sdir), "--no-progress", "--no-plots"] + knobs)
    return json.loads((sdir / "summary.json").read_text())


METRICS = (("ttft_p50", "ms", 1e3), ("tpot_p50", "ms", 1e3), ("output_tok_s", "tok/s", 1),
           ("throughput_req_s", "req/s", 1))


def predicted(sims, key):
    """A run's simulated figure: the mean over its calibrations (both ends of the bracket);
    None where a simulation lacks it."""
    vals = [s.get(key) for s in sims]
    return None if None in vals else sum(vals) / len(vals)


def render(runs) -> str:
    """Per figure: the real and simulated values (medians over the runs), sim / real in each
    run, and its median."""
    lines = ["| workload | metric | real engine (bench) | simulated | sim / real, run by run | sim / real |",
             "|---|---|---:|---:|---:|---:|"]
    ok_runs = [True] * len(runs)
    for w, (label, *_) in enumerate(runs[0][0]):
        for key, unit, scale in METRICS:
            got = {}    # run index -> (real, simulated)
            for r, (rows, _) in enumerate(runs):
                _, b, sims, _ = rows[w]
                if b.get(key) and predicted(sims, key) is not None:
                    got[r] = (b[key], predicted(sims, key))
            if not got:
                lines.append(f"| {label} | {key} | - | - | - | - |")
                continue
            ratios = {r: s / b for r, (b, s) in got.items()}
            for r, x in ratios.items():
                ok_runs[r] &= abs(x - 1) <= 0.10
            med = statistics.median(ratios.values())
            flag = "" if abs(med - 1) <= 0.10 else " **(>10%)**"
            lines.append(f"| {label} | {key} | {statistics.median(b for b, _ in got.values()) * scale:.1f} {unit} | "
                         f"{statistics.median(s for _, s in got.values()) * scale:.1f} {unit} | "
                         f"{' / '.join(f'{x:.2f}' for x in ratios.values())} | {med:.2f}{flag} |")
    return "\n".join(lines) + (f"\n\nRuns with every figure within 10 %: {sum(ok_runs)} of {len(runs)}. "
                               "Real and simulated values: medians over the runs.")


def render_methods(rows) -> str:
    """How many of the figures each way of using the calibrations brings within 10 %: the
    bracket's mean, either end alone, and one calibration up front for every workload."""
    ways = {"mean of before and after": lambda sims, once: sims,
            "before only": lambda sims, once: sims[:1], "after only": lambda sims, once: sims[-1:],
            "one calibration before all": lambda sims, once: [once]}
    cells = []
    for way, pick in ways.items():
        ratios = [predicted(pick(sims, once), k) / b[k] for _, b, sims, once in rows
                  for k, _, _ in METRICS if b.get(k) and predicted(pick(sims, once), k) is not None]
        worst = max(ratios, key=lambda r: abs(r - 1))
        cells.append(f"{way}: {sum(abs(r - 1) <= 0.10 for r in ratios)} of {len(ratios)} within 10 % "
                     f"(worst {worst:.2f})")
    return "Within 10 %, by the calibrations used: " + "; ".join(cells) + "."


def render_calibrations(costs) -> str:
    """What each calibration saw: the machine's drift, in the terms the model is built from."""
    lines = ["| calibration | one-row step, 128 ctx | 16 rows | fit error (median) | served TPOT at 1 / 4 / 16 "
             "in flight | per-step overhead | frontend |", "|---|---:|---:|---:|---:|---:|---:|"]
    for i, path in enumerate(dict.fromkeys(costs)):
        m = load_cost_model(path)
        pts = {int(p[0]): p[2] for p in m.meta.get("served_overhead", {}).get("points", [])}
        fixed, per = m.overhead
        m.set_overhead(0.0, 0.0)
        served = " / ".join(f"{pts[k] * 1e3:.2f}" if k in pts else "-" for k in (1, 4, 16))
        lines.append(f"| {i} | {m.decode_itl(128) * 1e3:.2f} ms | {m.decode_itl(128, 16) * 1e3:.2f} ms | "
                     f"{m.meta.get('fit_median_rel_err', float('nan')):.1%} | {served} ms | "
                     f"{fixed * 1e3:.2f} ms + {per * 1e6:.0f} us/request | {m.frontend * 1e3:.1f} ms |")
    return "\n".join(lines)


def write_docs(table: str, threads: int, bracket: bool, runs: int, mark: str = "engine-validation") -> None:
    path = Path(__file__).resolve().parent.parent / "docs" / "SIMULATION.md"
    text = path.read_text()
    how = ("each workload simulated with the calibration taken just before it and the one just after, "
           "`simulated` their mean" if bracket else "one calibration before all the workloads")
    block = (f"<!-- {mark} -->\n{table}\n\nCalibrations: {how}; `shepherd calibrate --served` (grid of "
             f"1-32 rows x 64/128/512-token prompts; per-step overhead from served TPOT at 1-16 requests in "
             f"flight minus the fitted step; frontend: one request's TTFT alone minus the modelled prefill). "
             f"Engine threads: {threads}. `python benchmarks/simulate_validate_engine.py --runs {runs}`, "
             f"{time.strftime('%Y-%m-%d %H:%M')}.\n<!-- /{mark} -->")
    pat = re.compile(rf"<!-- {mark} -->.*?<!-- /{mark} -->", re.S)
    text = pat.sub(block, text) if pat.search(text) else text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    main()
