"""The simulator against vLLM v0.6's published H100 figures (Llama-3-8B, ShareGPT).

    python benchmarks/simulate_vllm_v06.py            # prints the table, writes it into docs/SIMULATION.md

Published (vLLM blog, 2024-09-05, "vLLM v0.6.0: 2.7x throughput improvement";
figures as quoted in /work/shared/data/README.md): one H100, Llama-3-8B,
500 ShareGPT prompts: about 37 req/s at unlimited rate, about 8 ms per output
token at 2 QPS and about 14 ms at 32 QPS.

Workload (a stand-in: ShareGPT is not in the shared data). vLLM's
benchmark_serving keeps a ShareGPT conversation only if its prompt has 4 to
1,024 tokens and prompt + output at most 2,048 (others are skipped, not cut);
SGLang's benchmark log of 300 prompts sampled that way on H100
(sgl-project/sglang#1268) totals 74,403 input and 61,393 output tokens: means
of 248 and 205. The stand-in draws lognormal lengths with those means (sigma
1.0 for prompts, 0.9 for outputs, not measured), skips draws outside vLLM's
limits the same way, keeps 500, and gives them Poisson arrivals at 2 and 32
QPS, or all at t = 0 for the throughput figure.

Scheduler: vLLM v0.6's defaults for this model: 256 sequences and 8,192
batched tokens per step, no chunked prefill (a step is prefill-only or
decode-only, prefill first whenever a waiting request fits, however many
prefill steps in a row), no prefix caching. The "mixed steps" rows use
shepherd's default (decodes ride along in prefill steps, as vLLM's chunked
prefill) for comparison.

Overhead: the roofline has no CPU in it. vLLM's profile of v0.5.3 on this
model and GPU (same blog) put 33% of the time in the API server and 29% in
scheduling, input preparation and output processing, the GPU busy 38%; v0.6
moved the server to its own process and overlaps or amortises the rest
(async output processing, multi-step scheduling). What is left is modelled as
a per-step cost, fixed + per request in the batch (`--step-overhead`,
`--seq-overhead`). The script reports the H100 preset (0.45 ms, 0: a GPU
launch floor set from single-request ITL) and the setting of a small grid
with the smallest worst error over the three figures, one setting for all of
them; that setting is the documented overhead for simulating vLLM-v0.6-like
serving on H100.
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
STEP = [0.45e-3, 1e-3, 1.5e-3, 2e-3, 3e-3]
SEQ = [0.0, 10e-6, 20e-6, 40e-6]
MARK = "vllm-v06"
N = 500
PROMPT, OUTPUT = "lognormal:248:1.0", "lognormal:205:0.9"   # means of a ShareGPT sample (see above)
MAX_PROMPT, MAX_TOTAL, MIN_LEN = 1024, 2048, 4             # vLLM benchmark_serving's ShareGPT filter
VLLM_V06 = dict(max_batch_size=256, max_num_tokens=8192, mixed_steps=False, max_consecutive_prefill=0,
                prefix_cache=False)
MIXED = dict(max_batch_size=256, max_num_tokens=8192, prefix_cache=False)


def lengths():
    """N (prompt, output) pairs: lognormal draws, those outside vLLM's ShareGPT limits skipped."""
    spec = SyntheticSpec(clients=[ClientSpec("sharegpt", rate=1.0, input_len=PROMPT, output_len=OUTPUT)],
                         num_requests=4 * N, seed=0)
    keep = [(r.prompt_tokens, r.output_tokens) for r in synthetic(spec)
            if MIN_LEN <= r.prompt_tokens <= MAX_PROMPT and r.output_tokens >= MIN_LEN
            and r.prompt_tokens + r.output_tokens <= MAX_TOTAL]
    return keep[:N]


def workload(rate):
    arrivals = SyntheticSpec(clients=[ClientSpec("sharegpt", rate=rate or 1e9)], num_requests=N, seed=1)
    reqs = synthetic(arrivals)
    for r, (p, o) in zip(reqs, lengths()):
        r.prompt_tokens, r.output_tokens = p, o
        if rate is None:
            r.arrival = 0.0
    return reqs


def measure(step, seq, sched=VLLM_V06):
    out = {}
    for key, rate in (("tpot_2qps", 2.0), ("tpot_32qps", 32.0), ("throughput_req_s", None)):
        cost = make_cost_model("llama-3-8b", "h100", step_overhead=step, seq_overhead=seq)
        res = Simulator(SimConfig(model="llama-3-8b", gpu="h100", replicas=1, keep_records=False,
                                  cache_bounds=False, timeseries=False, scheduler=SchedulerConfig(**sched)),
                        cost).run(workload(rate))
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
    best = None
    for step, seq in itertools.product(STEP, SEQ):
        m = measure(step, seq)
        worst = max(abs(v) for v in err(m).values())
        print(f"  {step * 1e3:.2f} ms + {seq * 1e6:.0f} us/req: worst {worst:.1%}", file=sys.stderr)
        if best is None or worst < best[0]:
            best = (worst, step, seq, m)
    _, step, seq, m = best
    lines = ["| scheduler | per-step overhead | TPOT p50 @ 2 QPS, ms | TPOT p50 @ 32 QPS, ms | req/s, all at once |",
             "|---|---|---|---|---|",
             f"| vLLM v0.6 blog | | {PUBLISHED['tpot_2qps'] * 1e3:.0f} | {PUBLISHED['tpot_32qps'] * 1e3:.0f} "
             f"| {PUBLISHED['throughput_req_s']:.0f} |",
             row("mixed steps, H100 preset", 0.45e-3, 0.0, measure(None, None, MIXED)),
             row("mixed steps, fitted overhead", step, seq, measure(step, seq, MIXED)),
             row("vLLM v0.6 (separate prefill steps), H100 preset", 0.45e-3, 0.0, measure(None, None)),
             row("vLLM v0.6 (separate prefill steps), fitted overhead (documented)", step, seq, m)]
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
