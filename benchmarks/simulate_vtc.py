"""VTC reproduction (Sheng et al., OSDI'24, qualitative): Llama-2-7B on an
A10G-like GPU, a KV pool of 10,000 tokens, two clients sending 256-in/256-out
requests at 1.5 and 3 req/s (both backlogged). Under FCFS the heavier client
gets twice the service and the gap grows; under VTC the gap stays bounded, at
the same total throughput.

    .venv/bin/python benchmarks/simulate_vtc.py [--duration 600] [--out docs/img]
"""
import argparse
from pathlib import Path

import numpy as np

from shepherd.bench.report import service_of, summarize
from shepherd.config import SchedulerConfig
from shepherd.sim.simulator import SimConfig, simulate
from shepherd.bench.synthetic import ClientSpec, SyntheticSpec, synthetic


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    trace = synthetic(SyntheticSpec(clients=[
        ClientSpec("client-A", rate=1.5, input_len="fixed:256", output_len="fixed:256"),
        ClientSpec("client-B", rate=3.0, input_len="fixed:256", output_len="fixed:256")],
        duration=a.duration, seed=a.seed))
    grid = np.linspace(0, a.duration, 11)[1:]
    results = {}
    for policy in ("fcfs", "vtc"):
        cfg = SimConfig(model="llama-2-7b", gpu="a10g", kv_capacity=10_000, max_model_len=4096,
                        # aging off: under a minutes-long backlog every request would age past
                        # aging_steps and be served in arrival order whatever the policy
                        scheduler=SchedulerConfig(policy=policy, max_total_tokens=10_000, aging_steps=10**9),
                        seed=a.seed)
        res = simulate(trace, cfg)
        s = summarize([r for r in res.records], duration_s=a.duration)
        s["whole"] = res.summary()
        sa = service_curve(res.records, "client-A", grid)
        sb = service_curve(res.records, "client-B", grid)
        results[policy] = (res, s, sa, sb)
    print(f"two clients, 256 in / 256 out, 1.5 and 3 req/s, Llama-2-7B on A10G, KV 10,000 tokens, "
          f"{a.duration:.0f} s of arrivals ({len(trace)} requests)")
    print()
    print("| t (s) | FCFS service A | FCFS service B | FCFS B-A | VTC service A | VTC service B | VTC B-A |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for i, t in enumerate(grid):
        f, v = results["fcfs"], results["vtc"]
        print(f"| {t:.0f} | {f[2][i]:,.0f} | {f[3][i]:,.0f} | {f[3][i] - f[2][i]:,.0f} | "
              f"{v[2][i]:,.0f} | {v[3][i]:,.0f} | {v[3][i] - v[2][i]:,.0f} |")
    print()
    print(f"| policy | output tok/s (first {a.duration:.0f} s) | requests completed | TTFT p50 A | TTFT p50 B | "
          f"Jain's index of service at {a.duration:.0f} s | Jain while both backlogged (summary.json) | "
          f"Jain whole run incl. drain | max abs(B-A) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p, (res, s, sa, sb) in results.items():
        pc = s["per_client"]
        tok = sum(1 for r in res.records for t in r.token_times if t <= a.duration) / a.duration
        x, y = sa[-1], sb[-1]
        jain = (x + y) ** 2 / (2 * (x * x + y * y))
        print(f"| {p} | {tok:.0f} | {sum(1 for r in res.records if r.finish and r.finish <= a.duration)} | "
              f"{pc['client-A']['ttft_p50']:.1f} s | {pc['client-B']['ttft_p50']:.1f} s | {jain:.3f} | "
              f"{s['whole']['jain_fairness_backlogged']:.3f} | {s['whole']['jain_fairness']:.3f} | "
              f"{max(abs(sb - sa)):,.0f} |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fine = np.linspace(0, a.duration, 300)
    fig, axs = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, p in zip(axs, ("fcfs", "vtc")):
        res = results[p][0]
        for c in ("client-A", "client-B"):
            ax.plot(fine, service_curve(res.records, c, fine), label=c)
        ax.plot(fine, service_curve(res.records, "client-B", fine) - service_curve(res.records, "client-A", fine),
                label="B - A", ls="--", color="k")
        ax.set_title(f"{p.upper()} queue: Llama-2-7B on A10G, 1 replica, KV 10,000 tokens", fontsize=10)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("cumulative service (1 x in + 2 x out tokens)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "vtc_service.png", dpi=110)
    print(f"\nwrote {out / 'vtc_service.png'}")


if __name__ == "__main__":
    main()
