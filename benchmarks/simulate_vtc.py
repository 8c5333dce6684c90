"""VTC reproduction: the overload case of the VTC paper's artifact (Sheng et al., OSDI'24,
github.com/Ying1123/VTC-artifact, fair_bench/exp_suite.py "overload"): two clients sending
256-in / 256-out requests at fixed intervals, 1.5 and 3 req/s, for 600 s (the duration of
the artifact's stored FCFS run), Llama-2-7B on an A10G-like GPU with a KV pool of 10,000
tokens. Under FCFS the heavier client gets twice the service; under VTC both get the same.

Every policy runs with shepherd's default knobs (issue 30: the default aging used to turn
vtc into fcfs under a long overload); one row emulates that old behaviour (vtc's queue
reordered by age after 200 steps) for contrast.

The fairness figure is the artifact's (its plot/visualize.py, rewritten here): at 19
ticks over the run, each client's service rate in a 60-s window around the tick (a
request's 1 x prompt + 2 x output tokens spread evenly over its first to its last token)
and its request rate (the same weights, by arrival in the window); the difference at a tick
is the sum over clients of min(max service - service, |request rate - service|); the table
gives its mean and maximum over the ticks.

    .venv/bin/python benchmarks/simulate_vtc.py [--duration 600] [--out docs/img] [--no-docs]
"""
import argparse
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import write_block  # noqa: E402

from shepherd.bench.report import summarize  # noqa: E402
from shepherd.bench.synthetic import ClientSpec, SyntheticSpec, synthetic  # noqa: E402
from shepherd.config import SchedulerConfig  # noqa: E402
from shepherd.scheduler import policy as P  # noqa: E402
from shepherd.sim.simulator import SimConfig, simulate  # noqa: E402

# the artifact's stored results of this case, with the metric above (fair_bench/FCFS/
# all_results_overload.jsonl and, for VTC at 600 s, fair_bench/all_results_overload.jsonl
# at commit 192c2e2; computed once, the files are not shipped here)
ARTIFACT = {"fcfs": {"avg": 437.8, "max": 446.2, "tpot_ms": 43.7},
            "vtc": {"avg": 16.4, "max": 26.4, "tpot_ms": 42.6}}


@contextmanager
def aged_vtc():
    """vtc as before issue 30: requests that waited aging_steps were served first, in arrival order."""
    P.VTC.ages = True
    try:
        yield
    finally:
        P.VTC.ages = False


def service_curve(records, client, grid):
    ev_t, ev_w = [], []
    for r in records:
        if r.client != client:
            continue
        if r.first_token is not None:
            ev_t.append(r.first_token)
            ev_w.append(1.0 * r.prompt_tokens)
        ev_t.extend(r.token_times)
        ev_w.extend([2.0] * len(r.token_times))
    o = np.argsort(ev_t, kind="stable")
    t = np.asarray(ev_t)[o]
    c = np.cumsum(np.asarray(ev_w)[o])
    idx = np.searchsorted(t, grid, side="right") - 1
    return np.where(idx >= 0, c[np.clip(idx, 0, None)], 0.0)


def service_difference(records, window=60.0, ticks=20) -> tuple[float, float]:
    """The artifact's average and maximum service difference (see the module doc)."""
    T = int(max(r.arrival for r in records))
    clients = sorted({r.client for r in records})
    diffs = []
    for x in (T / ticks * i for i in range(1, ticks)):
        lo, hi = x - window / 2, x + window / 2
        served, asked = [], []
        for c in clients:
            s = a = 0.0
            for r in records:
                if r.client != c:
                    continue
                cost = r.prompt_tokens + 2 * r.output_tokens
                if lo <= r.arrival <= hi:
                    a += cost
                if r.first_token is None or r.finish is None or r.finish - r.first_token < 1e-5:
                    continue
                s += cost * max(min(hi, r.finish) - max(lo, r.first_token), 0.0) / (r.finish - r.first_token)
            served.append(s / window)
            asked.append(a / window)
        top = max(served)
        diffs.append(sum(min(top - s, abs(a - s)) for s, a in zip(served, asked)))
    return float(np.mean(diffs)), float(np.max(diffs))


def run(trace, policy: str, duration: float, seed: int):
    cfg = SimConfig(model="llama-2-7b", gpu="a10g", kv_capacity=10_000, router="round-robin",
                    scheduler=SchedulerConfig(policy=policy.replace("-aged", ""), max_total_tokens=10_000), seed=seed)
    with aged_vtc() if policy.endswith("-aged") else nullcontext():
        res = simulate(trace, cfg)
    recs = res.records
    s = summarize(recs, duration_s=duration)
    avg, mx = service_difference(recs)
    tpot = [(r.token_times[-1] - r.first_token) / (r.output_tokens - 1) for r in recs
            if r.output_tokens > 1 and r.first_token is not None]
    tok = sum(1 for r in recs for t in r.token_times if t <= duration) / duration
    return res, {"avg": avg, "max": mx, "tpot_ms": 1e3 * float(np.mean(tpot)), "tok_s": tok,
                 "done": sum(1 for r in recs if r.finish is not None and r.finish <= duration),
                 "ttft_a": s["per_client"]["client-A"]["ttft_p50"], "ttft_b": s["per_client"]["client-B"]["ttft_p50"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args()
    trace = synthetic(SyntheticSpec(clients=[
        ClientSpec("client-A", rate=1.5, input_len="fixed:256", output_len="fixed:256", arrival="constant"),
        ClientSpec("client-B", rate=3.0, input_len="fixed:256", output_len="fixed:256", arrival="constant")],
        duration=a.duration, seed=a.seed))
    rows = [("fcfs", "fcfs", "fcfs"), ("vtc", "vtc (default knobs)", "vtc"),
            ("vtc-aged", "vtc, queue reordered by age after 200 steps (the default before issue 30)", None)]
    results = {p: run(trace, p, a.duration, a.seed) for p, _, _ in rows}
    out = [f"Two clients at 1.5 and 3 req/s (fixed intervals), 256 in / 256 out, {a.duration:.0f} s of arrivals "
           f"({len(trace)} requests), Llama-2-7B on A10G (roofline), KV 10,000 tokens, default knobs.", "",
           "| policy | avg service difference | max | artifact avg / max | TPOT mean | artifact TPOT mean | "
           f"output tok/s (first {a.duration:.0f} s) | done by {a.duration:.0f} s | TTFT p50 A / B |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p, label, art in rows:
        m = results[p][1]
        ref = ARTIFACT.get(art) if art else None
        out.append(f"| {label} | {m['avg']:.1f} | {m['max']:.1f} | "
                   + (f"{ref['avg']:.1f} / {ref['max']:.1f}" if ref else "-") + f" | {m['tpot_ms']:.1f} ms | "
                   + (f"{ref['tpot_ms']:.1f} ms" if ref else "-")
                   + f" | {m['tok_s']:.0f} | {m['done']} | {m['ttft_a']:.1f} s / {m['ttft_b']:.1f} s |")
    grid = np.linspace(0, a.duration, 11)[1:]
    out += ["", "Cumulative service (1 x in + 2 x out tokens) by time:", "",
            "| t (s) | FCFS A | FCFS B | FCFS B-A | VTC A | VTC B | VTC B-A |", "|---:|---:|---:|---:|---:|---:|---:|"]
    fa, fb = (service_curve(results["fcfs"][0].records, c, grid) for c in ("client-A", "client-B"))
    va, vb = (service_curve(results["vtc"][0].records, c, grid) for c in ("client-A", "client-B"))
    for i, t in enumerate(grid):
        out.append(f"| {t:.0f} | {fa[i]:,.0f} | {fb[i]:,.0f} | {fb[i] - fa[i]:,.0f} | "
                   f"{va[i]:,.0f} | {vb[i]:,.0f} | {vb[i] - va[i]:,.0f} |")
    out += ["", "Artifact figures: its stored results of the same case with the same metric "
                "(FCFS: fair_bench/FCFS/all_results_overload.jsonl; VTC at 600 s: fair_bench/all_results_overload.jsonl; "
                "commit 192c2e2). `python benchmarks/simulate_vtc.py`"]
    text = "\n".join(out)
    print(text)
    if not a.no_docs:
        print(f"wrote {write_block('SIMULATION.md', 'vtc-overload', text)}")
    outdir = Path(a.out)
    outdir.mkdir(parents=True, exist_ok=True)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fine = np.linspace(0, a.duration, 300)
    fig, axs = plt.subplots(1, 3, figsize=(16, 4), sharey=True)
    for ax, (p, label, _) in zip(axs, rows):
        recs = results[p][0].records
        sa, sb = (service_curve(recs, c, fine) for c in ("client-A", "client-B"))
        ax.plot(fine, sa, label="client-A")
        ax.plot(fine, sb, label="client-B")
        ax.plot(fine, sb - sa, label="B - A", ls="--", color="k")
        ax.set_title(label if len(label) < 40 else "vtc aged (before issue 30)", fontsize=10)
        ax.set_xlabel("time (s)")
        ax.legend(fontsize=8)
    axs[0].set_ylabel("cumulative service (1 x in + 2 x out tokens)")
    fig.suptitle("VTC overload case: Llama-2-7B on A10G, 1 replica, KV 10,000 tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(outdir / "vtc_service.png", dpi=110)
    print(f"wrote {outdir / 'vtc_service.png'}")


if __name__ == "__main__":
    main()
