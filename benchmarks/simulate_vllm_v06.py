"""The simulator against vLLM v0.6's published H100 figures (Llama-3-8B, ShareGPT).

    python benchmarks/simulate_vllm_v06.py            # prints the table, writes it into docs/SIMULATION.md

Published (vLLM blog, 2024-09-05, "vLLM v0.6.0: 2.7x Throughput Improvement and
5x Latency Reduction"; figures as quoted in /work/shared/data/README.md): one
H100, Llama-3-8B, 500 ShareGPT prompts: about 37 req/s with every request at
once, about 8 ms per output token at 2 QPS and about 14 ms at 32 QPS. The blog's
plots show the mean TPOT (and its standard error), so the mean is compared.

What the blog ran (its "Performance Benchmarks" section): vLLM v0.6.0 with
multi-step scheduling on, `--num-scheduler-steps 10`; the other settings
default (256 sequences, no chunked prefill for an 8k-context model, so 8,192
batched tokens, asynchronous output processing on); ShareGPT prompts "randomly
sampled with a fixed seed", average 202 input and 179 output tokens.

Workload (a stand-in: ShareGPT is not in the shared data). vLLM's
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

Overhead: vLLM's profile of v0.5.3 on this model and GPU (same blog) put 33%
of the time in the API server and 29% in scheduling, input preparation and
output processing, the GPU busy 38%; v0.6 moved the server to its own process
and amortises or overlaps the rest, so some CPU time per step is left and the
roofline has none. It is modelled as fixed + per request in the batch
(`--step-overhead`, `--seq-overhead`). The script reports the H100 preset
(0.45 ms, 0: a GPU launch floor set from single-request ITL) and the setting of
a small grid with the smallest worst error over the three figures, one setting
for all of them: the documented overhead for simulating vLLM-v0.6-like serving
on H100.

Overlapped output processing (`--overlap-output`, CostModel overlap=True): vLLM
v0.6's asynchronous output processing turns step N's tokens into outputs on the
CPU while the GPU computes step N+1, so a step costs the fixed term plus the
larger of the GPU time and the per-request term times the batch, not their sum.
The script runs the same grid (with larger per-request terms) in that mode and
reports its best setting by the worst error, and by the worse of the two TPOTs.

    python benchmarks/simulate_vllm_v06.py --setting 0.012,110e-6 --overlap-output --no-docs
                                                      # one setting, the three figures, no grid
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from shepherd.bench.stream import tpot_of  # noqa: E402
from shepherd.bench.synthetic import ClientSpec, SyntheticSpec, synthetic  # noqa: E402
from shepherd.config import SchedulerConfig  # noqa: E402
from shepherd.sim.cost_model import make_cost_model  # noqa: E402
from shepherd.sim.simulator import SimConfig, Simulator  # noqa: E402

PUBLISHED = {"tpot_2qps": 8e-3, "tpot_32qps": 14e-3, "throughput_req_s": 37.0}
STEP = [0.45e-3, 1e-3, 2e-3, 3e-3, 4e-3, 6e-3, 8e-3, 12e-3]
SEQ = [0.0, 10e-6, 20e-6, 30e-6, 40e-6, 60e-6]
# overlapped, a per-request term changes nothing until it outlasts the forward (~6.5-11 ms)
OVL_SEQ = [0.0, 40e-6, 80e-6, 100e-6, 110e-6, 120e-6, 140e-6]
MARK = "vllm-v06"
SEEDS = [1, 2, 3, 4, 5]
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


def measure(step, seq, sched=VLLM_V06, seed=0, overlap=False):
    out = {}
    for key, rate in (("tpot_2qps", 2.0), ("tpot_32qps", 32.0), ("throughput_req_s", None)):
        cost = make_cost_model("llama-3-8b", "h100", step_overhead=step, seq_overhead=seq, overlap=overlap)
        res = Simulator(SimConfig(model="llama-3-8b", gpu="h100", replicas=1, cache_bounds=False,
                                  timeseries=False, scheduler=SchedulerConfig(**sched)),
                        cost).run(workload(rate, seed))
        if rate is None:
            out[key] = res.summary()["throughput_req_s"]
        else:
            tpots = [t for t in map(tpot_of, res.records) if t is not None]
            out[key] = sum(tpots) / len(tpots)     # the blog plots the mean
    return out


def err(m):
    return {k: m[k] / PUBLISHED[k] - 1 for k in PUBLISHED}


def worst(m, keys=tuple(PUBLISHED)):
    return max(abs(v) for k, v in err(m).items() if k in keys)


def row(label, step, seq, m, overlap=False):
    e = err(m)
    how = f"{step * 1e3:.2f} ms + max(GPU, {seq * 1e6:.0f} us/req)" if overlap else \
        f"{step * 1e3:.2f} ms + {seq * 1e6:.0f} us/req"
    return (f"| {label} | {how} | {m['tpot_2qps'] * 1e3:.1f} ({e['tpot_2qps']:+.0%}) "
            f"| {m['tpot_32qps'] * 1e3:.1f} ({e['tpot_32qps']:+.0%}) | {m['throughput_req_s']:.1f} "
            f"({e['throughput_req_s']:+.0%}) |")


TPOTS = ("tpot_2qps", "tpot_32qps")


def grid() -> dict:
    """The best setting of each mode, as (worst error, step, seq, figures): by the worst of the
    three figures, and (overlapped) by the worse of the two TPOTs alone."""
    best: dict = {}
    for name, sched, seqs, ovl in (("single", SINGLE, SEQ, False), ("multi", VLLM_V06, SEQ, False),
                                   ("overlap", VLLM_V06, OVL_SEQ, True)):
        for step, seq in itertools.product(STEP, seqs):
            m = measure(step, seq, sched, overlap=ovl)
            print(f"  {name} {step * 1e3:.2f} ms + {seq * 1e6:.0f} us/req: worst {worst(m):.1%}, "
                  f"TPOTs {worst(m, TPOTS):.1%}", file=sys.stderr)
            for key, w in ((name, worst(m)), (name + "-tpot", worst(m, TPOTS))):
                if key != "single-tpot" and (key not in best or w < best[key][0]):
                    best[key] = (w, step, seq, m)
    return best


def spread(step, seq, overlap) -> str:
    # the stand-in is one draw of 500; other draws of the same lognormals show how much of
    # each figure is the draw (the all-at-once run ends with its longest outputs decoding alone)
    others = [measure(step, seq, seed=k, overlap=overlap) for k in SEEDS]
    return ", ".join(f"{label} {min(o[k] for o in others) * f:.1f}-{max(o[k] for o in others) * f:.1f}"
                     for k, label, f in (("tpot_2qps", "TPOT @ 2 QPS", 1e3), ("tpot_32qps", "@ 32 QPS", 1e3),
                                         ("throughput_req_s", "req/s", 1)))


def command(step, seq, overlap) -> str:
    return f"--multi-step 10 --step-overhead {step:g} --seq-overhead {seq:g}" + (" --overlap-output" * overlap)


def one_setting(text: str, overlap: bool) -> int:
    step, seq = (float(x) for x in text.split(","))
    m = measure(step, seq, overlap=overlap)
    print(row("multi-step 10", step, seq, m, overlap))
    print(f"worst {worst(m):.1%}; draws {SEEDS[0]}-{SEEDS[-1]}: {spread(step, seq, overlap)}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--setting", metavar="STEP,SEQ", help="measure one overhead setting (seconds), no grid")
    ap.add_argument("--overlap-output", action="store_true", help="with --setting: overlapped output processing")
    args = ap.parse_args()
    if args.setting:
        return one_setting(args.setting, args.overlap_output)
    best = grid()
    doc = min(("multi", "overlap"), key=lambda k: best[k][0])
    _, step, seq, m = best[doc]
    lines = ["| scheduler | overhead: per schedule() + per request per step | TPOT mean @ 2 QPS, ms "
             "| TPOT mean @ 32 QPS, ms | req/s, all at once |",
             "|---|---|---|---|---|",
             f"| vLLM v0.6 blog | | {PUBLISHED['tpot_2qps'] * 1e3:.0f} | {PUBLISHED['tpot_32qps'] * 1e3:.0f} "
             f"| {PUBLISHED['throughput_req_s']:.0f} |",
             row("one step per schedule, H100 preset", 0.45e-3, 0.0, measure(None, None, SINGLE)),
             row("one step per schedule, its best overhead", *best["single"][1:]),
             row("multi-step 10 (the blog's), H100 preset", 0.45e-3, 0.0, measure(None, None))]
    for key, label in (("multi", "multi-step 10, best overhead"),
                       ("overlap", "multi-step 10, overlapped output processing, best overhead"),
                       ("overlap-tpot", "multi-step 10, overlapped output processing, best on the two TPOTs")):
        lines.append(row(label + (" (documented)" if key == doc else ""), *best[key][1:], key != "multi"))
    tpot_step, tpot_seq = best["overlap-tpot"][1:3]
    longest = ", ".join(str(max(o for _, o in lengths(k))) for k in (0, *SEEDS))
    lines += ["", f"On {len(SEEDS)} other draws of the stand-in (length seeds {SEEDS[0]}-{SEEDS[-1]}): "
              f"documented setting {spread(step, seq, doc == 'overlap')}; overlapped, best on the two TPOTs "
              f"{spread(tpot_step, tpot_seq, True)}. Longest output of draws 0-{SEEDS[-1]}: {longest} tokens."]
    table = "\n".join(lines)
    print(table)
    print(f"\nbest worst-case error {best[doc][0]:.1%} at {command(step, seq, doc == 'overlap')}")
    if not args.no_docs:
        path = os.path.join(ROOT, "docs", "SIMULATION.md")
        text = open(path).read()
        block = (f"<!-- {MARK} -->\n{table}\n\n`python benchmarks/simulate_vllm_v06.py`; documented setting: "
                 f"`{command(step, seq, doc == 'overlap')}`; overlapped, best on the two TPOTs: "
                 f"`{command(tpot_step, tpot_seq, True)}`\n<!-- /{MARK} -->")
        pat = re.compile(rf"<!-- {MARK} -->.*?<!-- /{MARK} -->", re.S)
        text = pat.sub(block, text) if pat.search(text) else text.rstrip() + "\n\n" + block + "\n"
        open(path, "w").write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
