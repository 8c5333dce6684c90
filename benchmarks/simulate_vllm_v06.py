"""The simulator against vLLM v0.6's published H100 figures (Llama-3-8B, ShareGPT).

    python benchmarks/simulate_vllm_v06.py            # prints the table, writes it into docs/SIMULATION.md

Published (vLLM blog, 2024-09-05, "vLLM v0.6.0: 2.7x throughput improvement";
figures as quoted in /work/shared/data/README.md): one H100, Llama-3-8B,
500 ShareGPT prompts: about 37 req/s at unlimited rate, about 8 ms per output
token at 2 QPS and about 14 ms at 32 QPS.

Workload: ShareGPT itself is not in the shared data, so its lengths are
approximated by lognormals with the dataset's usual means under vLLM's
benchmark sampling (prompt mean 220 tokens, sigma 1.0; output mean 200,
sigma 0.9), cut as vLLM's sampler cuts ShareGPT (prompt <= 1,024 tokens,
prompt + output <= 2,048), 500 requests, Poisson arrivals at 2 and 32 QPS,
and all at once for the throughput figure; the scheduler as vLLM v0.6's
defaults (256 sequences, 8,192 batched tokens: no chunked prefill). The roofline model has no CPU in it; the
per-step overhead (fixed + per request in the batch, `--step-overhead`,
`--seq-overhead`) is what vLLM's scheduler, input preparation and output
processing add per step. The script reports the H100 preset (0.45 ms, 0)
and the setting of a small grid with the smallest worst error; that setting
is the documented overhead for simulating vLLM-like serving on H100.
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from shepherd.bench.synthetic import ClientSpec, SyntheticSpec, synthetic  # noqa: E402
from shepherd.config import SchedulerConfig  # noqa: E402
from shepherd.sim.cost_model import make_cost_model  # noqa: E402
from shepherd.sim.simulator import SimConfig, Simulator  # noqa: E402

PUBLISHED = {"tpot_2qps": 8e-3, "tpot_32qps": 14e-3, "throughput_req_s": 37.0}
STEP = [0.45e-3, 1e-3, 2e-3, 3e-3]
SEQ = [0.0, 10e-6, 20e-6, 40e-6]
MARK = "vllm-v06"


def workload(rate):
    spec = SyntheticSpec(clients=[ClientSpec("sharegpt", rate=rate or 1e9, input_len="lognormal:220:1.0",
                                             output_len="lognormal:200:0.9")], num_requests=500, seed=0)
    reqs = synthetic(spec)
    for r in reqs:
        r.prompt_tokens = min(r.prompt_tokens, 1024)
        r.output_tokens = max(1, min(r.output_tokens, 2048 - r.prompt_tokens))
    if rate is None:
        for r in reqs:
            r.arrival = 0.0
    return reqs


def measure(step, seq):
    out = {}
    for key, rate in (("tpot_2qps", 2.0), ("tpot_32qps", 32.0), ("throughput_req_s", None)):
        cost = make_cost_model("llama-3-8b", "h100", step_overhead=step, seq_overhead=seq)
        sched = SchedulerConfig(max_batch_size=256, max_num_tokens=8192)
        res = Simulator(SimConfig(model="llama-3-8b", gpu="h100", replicas=1, keep_records=False,
                                  cache_bounds=False, timeseries=False, scheduler=sched), cost).run(workload(rate))
        s = res.summary()
        out[key] = s["throughput_req_s"] if rate is None else s["tpot_p50"]
    return out


def err(m):
    return {k: m[k] / PUBLISHED[k] - 1 for k in PUBLISHED}


def row(label, step, seq, m):
    e = err(m)
    return (f"| {label} | {step * 1e3:.2f} ms + {seq * 1e6:.0f} us/req | {m['tpot_2qps'] * 1e3:.1f} ({e['tpot_2qps']:+.0%}) "
            f"| {m['tpot_32qps'] * 1e3:.1f} ({e['tpot_32qps']:+.0%}) | {m['throughput_req_s']:.1f} "
            f"({e['throughput_req_s']:+.0%}) |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-docs", action="store_true")
    args = ap.parse_args()
    preset = measure(None, None)
    best = None
    for step, seq in itertools.product(STEP, SEQ):
        m = measure(step, seq)
        worst = max(abs(v) for v in err(m).values())
        if best is None or worst < best[0]:
            best = (worst, step, seq, m)
    _, step, seq, m = best
    lines = ["| overhead setting | per-step overhead | TPOT p50 @ 2 QPS, ms | TPOT p50 @ 32 QPS, ms | req/s, all at once |",
             "|---|---|---|---|---|",
             f"| vLLM v0.6 blog | | {PUBLISHED['tpot_2qps'] * 1e3:.0f} | {PUBLISHED['tpot_32qps'] * 1e3:.0f} "
             f"| {PUBLISHED['throughput_req_s']:.0f} |",
             row("H100 preset", 0.45e-3, 0.0, preset),
             row("fitted to the blog (documented)", step, seq, m)]
    table = "\n".join(lines)
    print(table)
    print(f"\nbest worst-case error {best[0]:.1%} at --step-overhead {step} --seq-overhead {seq}")
    if not args.no_docs:
        path = os.path.join(ROOT, "docs", "SIMULATION.md")
        text = open(path).read()
        block = (f"<!-- {MARK} -->\n{table}\n\n`python benchmarks/simulate_vllm_v06.py`; documented setting: "
                 f"`--step-overhead {step:g} --seq-overhead {seq:g}`\n<!-- /{MARK} -->")
        pat = re.compile(rf"<!-- {MARK} -->.*?<!-- /{MARK} -->", re.S)
        text = pat.sub(block, text) if pat.search(text) else text.rstrip() + "\n\n" + block + "\n"
        open(path, "w").write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
