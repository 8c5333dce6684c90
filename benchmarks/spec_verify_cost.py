#!/usr/bin/env python
"""What a verify row costs: the in-process step time of B requests each feeding its last token
and k drafts (B x (k + 1) rows, logits on every row, greedy verification), against the plain
decode step of the same B requests (k = 0), median of --steps steps, the cases interleaved
round-robin so that a slow phase of the machine hits every case alike.

Speculation pays when a step with k drafts costs less than the tokens it yields: with an
acceptance rate a per draft (each kept while the ones before were), a verify yields
E(k, a) = 1 + a + a^2 + ... + a^k tokens a request, so it pays while T(B, k) / T(B, 0) < E(k, a).
The table prints that break-even rate per (B, k); disable_by_batch_size is the largest B where
the drafts of the measured workloads pay (docs/SPECULATIVE.md).

    python benchmarks/spec_verify_cost.py                            # B in 1..64, k in 0..4, bf16
    python benchmarks/spec_verify_cost.py --batch 1,8,16 --drafts 0,3 --steps 15
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def breakeven(ratio: float, k: int) -> float:
    """The acceptance rate a at which 1 + a + ... + a^k == ratio (bisection); > 1: never pays."""
    if k == 0:
        return 0.0
    if ratio >= k + 1:
        return float("inf")
    lo, hi = 0.0, 1.0
    for _ in range(50):
        a = (lo + hi) / 2
        if sum(a ** i for i in range(k + 1)) < ratio:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,2,4,8,16,32,64")
    ap.add_argument("--drafts", default="0,1,2,3,4")
    ap.add_argument("--ctx", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="none")
    a = ap.parse_args()
    import torch
    from shepherd.config import EngineConfig
    from shepherd.engine.torch_executor import TorchExecutor
    from shepherd.request import SamplingParams
    from shepherd.step import NewRequest, ScheduledBatch, ScheduledSeq
    Bs = [int(x) for x in a.batch.split(",")]
    Ks = [int(x) for x in a.drafts.split(",")]
    span = a.ctx + max(Ks) + 8
    ex = TorchExecutor(EngineConfig(dtype="bfloat16", num_threads=a.threads, quantization=a.quantization,
                                    max_total_tokens=max(Bs) * span + 64))
    tok = ex.tokenizer
    text = ("Write a long and careful essay about the history of rivers, bridges, trains and the people "
            "who built them, variant {i}. ") * 20
    B = max(Bs)
    reqs = []
    for i in range(B):
        ids = tok.encode(text.format(i=i))[: a.ctx]
        slots = list(range(i * span, (i + 1) * span))
        reqs.append((f"v{i}", ids, slots))
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for j in range(0, B, 8):      # prefill
        chunk = reqs[j:j + 8]
        ex.execute(ScheduledBatch(step=0, new=[NewRequest(r, ids, params) for r, ids, _ in chunk],
                                  seqs=[ScheduledSeq(r, ids, 0, True, 0, list(sl)) for r, ids, sl in chunk]))

    def step(b: int, k: int) -> float:
        seqs = []
        for r, ids, sl in reqs[:b]:
            # the last prompt token again at its position, then k drafts (their KV is scratch)
            seqs.append(ScheduledSeq(r, [ids[-1]] + [ids[-2 - d] for d in range(k)], len(ids) - 1, True,
                                     0, list(sl), k, 0))
        t0 = time.perf_counter()
        ex.execute(ScheduledBatch(step=1, seqs=seqs))
        return time.perf_counter() - t0

    cases = [(b, k) for b in Bs for k in Ks]
    times: dict[tuple[int, int], list[float]] = {c: [] for c in cases}
    for c in cases:
        step(*c)          # warm-up
    for _ in range(a.steps):
        for c in cases:
            times[c].append(step(*c))
    med = {c: statistics.median(v) * 1e3 for c, v in times.items()}
    print(f"\nverify cost, {a.quantization}, ctx {a.ctx}, {torch.get_num_threads()} threads, median of {a.steps} "
          f"(ms per step; in brackets: step / plain step, and the acceptance rate where it breaks even)\n")
    print("| requests | " + " | ".join(f"k = {k}" for k in Ks) + " |")
    print("|---:|" + "---:|" * len(Ks))
    for b in Bs:
        cells = []
        for k in Ks:
            m = med[(b, k)]
            if k == 0 or (b, 0) not in med:
                cells.append(f"{m:.2f}")
            else:
                r = m / med[(b, 0)]
                be = breakeven(r, k)
                cells.append(f"{m:.2f} ({r:.2f}x, a >= {be:.2f})" if be <= 1 else f"{m:.2f} ({r:.2f}x, never)")
        print(f"| {b} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
