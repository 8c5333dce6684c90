"""The simulator against vLLM v0.6's published H100 figures (Llama-3-8B, ShareGPT).

    python benchmarks/simulate_vllm_v06.py            # prints the table, writes it into docs/SIMULATION.md
                                                      # (~5 minutes on two cores)

Published (vLLM blog, 2024-09-05, "vLLM v0.6.0: 2.7x Throughput Improvement and
5x Latency Reduction"; figures as quoted in shepherd/data/README.md): one
H100, Llama-3-8B, 500 ShareGPT prompts: about 37 req/s with every request at
once, about 8 ms per output token at 2 QPS and about 14 ms at 32 QPS. The blog's
plots show the mean TPOT (and its standard error), so the mean is compared.

What the blog ran (its "Performance Benchmarks" section): vLLM v0.6.0 with
multi-step scheduling on, `--num-scheduler-steps 10`; the other settings
default (256 sequences, no chunked prefill for an 8k-context model, so 8,192
batched tokens, asynchronous output processing on); ShareGPT prompts "randomly
sampled with a fixed seed", average 202 input and 179 output tokens.

Workload (a stand-in: ShareGPT is not in shepherd/data). vLLM's
benchmark_serving keeps a ShareGPT conversation only if prompt and output have
at least 4 tokens, the prompt at most 1,024 and both together at most 2,048
(others are skipped, not cut). The stand-in draws lognormal lengths (sigma 1.0
for prompts, 0.9 for outputs: guesses, nothing published measures them), skips
draws outside vLLM's limits the same way and keeps 500. The lognormals' means
(244 and 183 before the skips) are set so that the kept 500 average the blog's
202 and 179. Poisson arrivals at 2 and 32 QPS, or all at t = 0.

Scheduler: vLLM v0.6's for this model: 256 sequences and 8,192 batched tokens
per step, no chunked prefill (a step is prefill-only or decode-only, prefill
first whenever a waiting request fits, any number of prefill steps in a row), no
prefix caching; and multi-step scheduling (`SchedulerConfig.multi_step=10`,
vLLM PR #7000): a decode batch runs 10 steps, nothing joins it before the
tenth, its tokens reach the client together at its end, and the fixed
per-step overhead (scheduling, input preparation) is paid once per window
while the per-request term (each token's output processing) is paid every
step. The rows without multi-step show what it changes.

Cost models: the roofline (the H100 preset) and the profiled H100 model
(`--cost-model vidur`: vidur's measured H100 profile of Llama-2-7B's
non-attention layers, scaled token count by token count to Llama-3-8B by the
two models' measured ratio on A100, plus the LM head's read; attention from
the roofline). The roofline takes the larger of memory and compute time; the
profile shows what kernels do near the crossover: steps of 64 / 128 / 256
tokens take 1.2 / 1.3 / 1.6x the roofline on Llama-2-7B, and a decode of
50-100 requests or a prefill of one to three ShareGPT prompts is a step of
that size.

Overhead: vLLM's profile of v0.5.3 on this model and GPU (same blog) put 33%
of the time in the API server and 29% in scheduling, input preparation and
output processing, the GPU busy 38%; v0.6 moved the server to its own process
and amortises or overlaps the rest, so some CPU time per step is left and
neither model has it. It is modelled as fixed + per request in the batch
(`--step-overhead`, `--seq-overhead`; the fixed term once per multi-step
window). The script reports each model with its preset overhead (0.45 ms, 0: a
GPU launch floor set from single-request ITL) and the setting of a small grid
with the smallest worst error over the three figures, one setting for all of
them.

Draws: the stand-in is a random draw of 500 lengths, and the all-at-once run
ends with the draw's longest outputs decoding almost alone, so its req/s moves
by +-15% between draws while the TPOTs move by under 5%. Every figure is the
median over draws 0-5 (lengths seeded 0-5, the same arrivals), with the range.

    python benchmarks/simulate_vllm_v06.py --setting 0.003,0 --cost-model vidur --no-docs
                                                      # one setting, the three figures, no grid
    python benchmarks/simulate_vllm_v06.py --setting 0.012,110e-6 --overlap-output --no-docs
                                                      # overlapped output processing (CostModel
                                                      # overlap=True): fixed + max(GPU, per request x batch)
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from shepherd.bench.stream import tpot_of  # noqa: E402
from shepherd.bench.synthetic import ClientSpec, SyntheticSpec, synthetic  # noqa: E402
from shepherd.config import SchedulerConfig  # noqa: E402
from shepherd.sim.fitted_cost import make_cost_model  # noqa: E402
from shepherd.sim.simulator import SimConfig, Simulator  # noqa: E402

PUBLISHED = {"tpot_2qps": 8e-3, "tpot_32qps": 14e-3, "throughput_req_s": 37.0}
RATES = {"tpot_2qps": 2.0, "tpot_32qps": 32.0, "throughput_req_s": None}
COSTS = {"roofline": "roofline", "profiled": "vidur"}
STEP = [0.45e-3, 1e-3, 2e-3, 3e-3, 4e-3, 6e-3, 8e-3, 12e-3]
SEQ = [0.0, 10e-6, 20e-6, 40e-6]
MARK = "vllm-v06"
DRAWS = [0, 1, 2, 3, 4, 5]
N = 500
# lognormal means before the skips, set so the kept 500 average 202 and 179 (the blog's)
PROMPT, OUTPUT = "lognormal:244:1.0", "lognormal:183:0.9"
MAX_PROMPT, MAX_TOTAL, MIN_LEN = 1024, 2048, 4             # vLLM benchmark_serving's ShareGPT filter
SINGLE = dict(max_batch_size=256, max_num_tokens=8192, mixed_steps=False, max_consecutive_prefill=0,
              prefix_cache=False)
VLLM_V06 = dict(SINGLE, multi_step=10)                     # the blog's --num-scheduler-steps 10


def lengths(seed=0):
    """N (prompt, output) pairs: lognormal draws, those outside vLLM's ShareGPT limits skipped."""
    spec = SyntheticSpec(clients=[ClientSpec("sharegpt", rate=1.0, input_len=PROMPT, output_len=OUTPUT)],
                         num_requests=4 * N, seed=seed)
    keep = [(r.prompt_tokens, r.output_tokens) for r in synthetic(spec)
            if MIN_LEN <= r.prompt_tokens <= MAX_PROMPT and r.output_tokens >= MIN_LEN
            and r.prompt_tokens + r.output_tokens <= MAX_TOTAL]
    return keep[:N]


def workload(rate, seed=0):
    arrivals = SyntheticSpec(clients=[ClientSpec("sharegpt", rate=rate or 1e9)], num_requests=N, seed=1)
    reqs = synthetic(arrivals)
    for r, (p, o) in zip(reqs, lengths(seed)):
        r.prompt_tokens, r.output_tokens = p, o
        if rate is None:
            r.arrival = 0.0
    return reqs


def one_run(job) -> float:
    """One figure of one draw: mean TPOT at a rate, or req/s with every request at once."""
    cost_name, step, seq, sched, overlap, key, seed = job
    cost = make_cost_model("llama-3-8b", "h100", cost_model=COSTS[cost_name], step_overhead=step,
                           seq_overhead=seq, overlap=overlap)
    res = Simulator(SimConfig(model="llama-3-8b", gpu="h100", replicas=1, cache_bounds=False,
                              timeseries=False, scheduler=SchedulerConfig(**sched)),
                    cost).run(workload(RATES[key], seed))
    if RATES[key] is None:
        return res.summary()["throughput_req_s"]
    tpots = [t for t in map(tpot_of, res.records) if t is not None]
    return sum(tpots) / len(tpots)     # the blog plots the mean


POOL: ProcessPoolExecutor | None = None


def measure(step, seq, sched=VLLM_V06, cost="roofline", overlap=False) -> dict:
    """Each figure over DRAWS: {key: [value per draw]} (step/seq None: the model's preset)."""
    jobs = [(cost, step, seq, sched, overlap, key, d) for key in PUBLISHED for d in DRAWS]
    vals = list(POOL.map(one_run, jobs)) if POOL else [one_run(j) for j in jobs]
    return {key: vals[i * len(DRAWS):(i + 1) * len(DRAWS)] for i, key in enumerate(PUBLISHED)}


def med(m) -> dict:
    return {k: statistics.median(v) for k, v in m.items()}


def err(m):
    return {k: v / PUBLISHED[k] - 1 for k, v in med(m).items()}


def worst(m):
    return max(abs(v) for v in err(m).values())


def row(cost, label, step, seq, m, overlap=False):
    e, f = err(m), {"tpot_2qps": 1e3, "tpot_32qps": 1e3, "throughput_req_s": 1}
    if step is None:     # the model's own overhead, as make_cost_model builds it
        step, seq = make_cost_model("llama-3-8b", "h100", cost_model=COSTS[cost]).overhead
        label += ", preset overhead"
    how = f"{step * 1e3:.2f} ms + " + (f"max(GPU, {seq * 1e6:.0f} us/req)" if overlap else f"{seq * 1e6:.0f} us/req")
    cells = [f"{statistics.median(m[k]) * f[k]:.1f} ({e[k]:+.0%}) [{min(m[k]) * f[k]:.1f}-{max(m[k]) * f[k]:.1f}]"
             for k in PUBLISHED]
    return f"| {cost} | {label} | {how} | " + " | ".join(cells) + " |"


def grid(cost) -> tuple:
    """The multi-step setting with the smallest worst error: (worst, step, seq, figures)."""
    best = None
    for step, seq in itertools.product(STEP, SEQ):
        m = measure(step, seq, cost=cost)
        print(f"  {cost} {step * 1e3:.2f} ms + {seq * 1e6:.0f} us/req: worst {worst(m):.1%}", file=sys.stderr)
        if best is None or worst(m) < best[0]:
            best = (worst(m), step, seq, m)
    return best


def command(cost, step, seq, overlap=False) -> str:
    return (f"--cost-model {COSTS[cost]} --multi-step 10 --step-overhead {step:g} --seq-overhead {seq:g}"
            + (" --overlap-output" * overlap))


def one_setting(args) -> int:
    step, seq = (float(x) for x in args.setting.split(","))
    m = measure(step, seq, cost=args.cost_model, overlap=args.overlap_output)
    print(row(args.cost_model, "multi-step 10", step, seq, m, args.overlap_output))
    print(f"worst {worst(m):.1%}; draw 0: " + ", ".join(f"{k} {v[0]:.4g}" for k, v in m.items()))
    return 0


def table() -> tuple[str, str]:
    lines = ["| cost model | scheduler | overhead: per schedule() + per request per step "
             "| TPOT mean @ 2 QPS, ms | TPOT mean @ 32 QPS, ms | req/s, all at once |",
             "|---|---|---|---|---|---|",
             f"| vLLM v0.6 blog | | | {PUBLISHED['tpot_2qps'] * 1e3:.0f} | {PUBLISHED['tpot_32qps'] * 1e3:.0f} "
             f"| {PUBLISHED['throughput_req_s']:.0f} |"]
    best = {}
    for cost in COSTS:
        best[cost] = grid(cost)
        lines += [row(cost, "one step per schedule", None, None, measure(None, None, SINGLE, cost)),
                  row(cost, "multi-step 10 (the blog's)", None, None, measure(None, None, cost=cost))]
    doc = min(COSTS, key=lambda c: best[c][0])
    for cost in COSTS:
        lines.append(row(cost, "multi-step 10, best overhead" + (" (documented)" if cost == doc else ""),
                         *best[cost][1:]))
    longest = ", ".join(str(max(o for _, o in lengths(k))) for k in DRAWS)
    lines += ["", f"Each cell: the median over draws {DRAWS[0]}-{DRAWS[-1]} of the stand-in (error against the "
              f"blog) [range]. Longest output of each draw: {longest} tokens."]
    _, step, seq, _ = best[doc]
    return "\n".join(lines), command(doc, step, seq)


def main() -> int:
    global POOL
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--setting", metavar="STEP,SEQ", help="measure one overhead setting (seconds), no grid")
    ap.add_argument("--cost-model", choices=list(COSTS), default="profiled", help="with --setting")
    ap.add_argument("--overlap-output", action="store_true", help="with --setting: overlapped output processing")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="simulations run side by side")
    args = ap.parse_args()
    POOL = ProcessPoolExecutor(args.jobs) if args.jobs > 1 else None
    if args.setting:
        return one_setting(args)
    text, cmd = table()
    print(text)
    print(f"\ndocumented setting: {cmd}")
    if not args.no_docs:
        path = os.path.join(ROOT, "docs", "SIMULATION.md")
        doc = open(path).read()
        block = (f"<!-- {MARK} -->\n{text}\n\n`python benchmarks/simulate_vllm_v06.py`; documented setting: "
                 f"`{cmd}`\n<!-- /{MARK} -->")
        pat = re.compile(rf"<!-- {MARK} -->.*?<!-- /{MARK} -->", re.S)
        doc = pat.sub(lambda _: block, doc) if pat.search(doc) else doc.rstrip() + "\n\n" + block + "\n"
        open(path, "w").write(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
