"""Seed 003 (TensorRT-LLM scheduling as deployed by grps) on the Azure conv
trace, one H100 running Llama-3-8B: admission `guaranteed` (GUARANTEED_NO_EVICT)
vs `peak` (LightLLM's exact peak check) vs `optimistic` (MAX_UTILIZATION /
vLLM, preempting by recompute), with their request timelines.

Clients ask for max_tokens (default 2048) and stop at the trace's output
length (EOS), so a reservation-based mode pays for tokens never generated,
as in the seed's example; the KV pool is limited (default 32,768 tokens, a
small kv_cache_free_gpu_mem_fraction) so that admission matters.

    .venv/bin/python benchmarks/simulate_seed003.py [--limit 1500] [--kv 32768] [--max-tokens 2048] [--out docs/img]
"""
import argparse
from pathlib import Path

from shepherd.bench.report import write_report
from shepherd.config import SchedulerConfig
from shepherd.sim.simulator import SimConfig, simulate
from shepherd.bench.traces import load_trace

from shepherd.paths import data_path

AZURE = str(data_path("azure_llm_2023", "AzureLLMInferenceTrace_conv.csv"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=AZURE)
    ap.add_argument("--limit", type=int, default=1500)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--kv", type=int, default=32768)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--window", default="240,260", help="timeline panel: arrivals in this window (s)")
    a = ap.parse_args()
    win = tuple(float(x) for x in a.window.split(","))
    runs = {}
    trace = load_trace(a.trace, limit=a.limit, time_scale=a.time_scale)
    print(f"{len(trace)} requests over {trace[-1].arrival:,.0f} s; Llama-3-8B on one H100, KV {a.kv:,} tokens, "
          f"max_tokens {a.max_tokens}")
    print()
    print("| admission | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | E2E p99 | req/s | out tok/s | "
          "preemptions | peak KV | mean running |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode in ("guaranteed", "peak", "optimistic"):
        cfg = SimConfig(model="llama-3-8b", gpu="h100", kv_capacity=a.kv, max_tokens=a.max_tokens,
                        max_model_len=a.kv,
                        scheduler=SchedulerConfig(admission=mode, max_total_tokens=a.kv))
        res = simulate(trace, cfg)
        s = res.summary()
        ts = res.timeseries
        import numpy as np
        t = np.asarray(ts["t"])
        run = np.asarray(ts["running"])
        mean_run = float((run[:-1] * np.diff(t)).sum() / (t[-1] - t[0])) if t.size > 1 else 0.0
        print(f"| {mode} | {s['ttft_p50']:.3f} s | {s['ttft_p99']:.2f} s | {s['tpot_p50'] * 1e3:.1f} ms | "
              f"{s['tpot_p99'] * 1e3:.1f} ms | {s['e2e_p99']:.1f} s | {s['throughput_req_s']:.2f} | "
              f"{s['output_tok_s']:.0f} | {s['preemptions']} | {s['kv_peak_used_tokens']:,} | {mean_run:.1f} |")
        out = Path(a.out) / f"seed003_{mode}"
        write_report(out, s, res.records, ts, title=f"seed 003, {mode}")
        runs[mode] = res
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from shepherd.bench.plots import draw_timeline
    fig, axs = plt.subplots(2, 3, figsize=(16, 8), gridspec_kw={"height_ratios": [3, 1]})
    for i, (mode, res) in enumerate(runs.items()):
        sel = [r for r in res.records if win[0] <= r.arrival < win[1]]
        draw_timeline(axs[0, i], sel, legend=(i == 0))
        axs[0, i].set_title(f"{mode}: requests arriving in [{win[0]:g}, {win[1]:g}) s")
        ts = res.timeseries
        t = np.asarray(ts["t"])
        axs[1, i].plot(t, ts["kv_used"], lw=0.8, drawstyle="steps-post", label="KV used")
        axs[1, i].axhline(a.kv, ls="--", color="k", lw=0.8, label="capacity")
        axs[1, i].set_ylabel("KV tokens")
        axs[1, i].set_ylim(0, a.kv * 1.1)
        tw = axs[1, i].twinx()
        tw.plot(t, ts["waiting"], lw=0.8, drawstyle="steps-post", color="C1", label="queued")
        tw.set_ylabel("queued requests", color="C1")
        axs[1, i].set_xlabel("time (s)")
        axs[1, i].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    p = Path(a.out) / "seed003_timelines.png"
    fig.savefig(p, dpi=100)
    print(f"\nwrote {p} and {a.out}/seed003_<mode>/")


if __name__ == "__main__":
    main()
