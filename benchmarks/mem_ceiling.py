#!/usr/bin/env python
"""What one decode row can cost at best here: the memory-read ceiling, and bf16_mm's rate at one row.

    python benchmarks/mem_ceiling.py [--threads 2] [--docs]

At one row a bf16 decode step reads every weight once (SmolLM2-135M: 269 MB with the tied LM
head), so the step cannot be shorter than those bytes over the machine's read bandwidth. Prints,
at --threads threads: torch.sum over float32 tensors of 32 MB to 1.2 GB (a plain streaming read;
sizes around the last-level cache show what stays in it), bf16_mm (kernels.c) at M = 1 over one
large weight, and the model's own GEMM shapes at M = 1, 30 copies of each in rotation and the LM
head, as a layer stack meets them (each call with its own OpenMP region, so the small ones carry
a fork/join too). --docs writes the table into docs/MODEL.md (<!-- mem-ceiling -->).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _docs import footer, publish  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate-up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)
LAYERS = 30


def median_s(f, n: int = 15) -> float:
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--docs", action="store_true")
    a = ap.parse_args()
    import torch
    torch.set_num_threads(a.threads)
    from shepherd.model import kernels
    lib = kernels.load()
    if lib is None or not lib.has_bf16_mm():
        raise SystemExit("no bf16_mm on this CPU (needs AVX-512 and a C compiler)")
    k = kernels.Kernels(lib, torch.bfloat16)
    rows = ["| what | MB | ms (median) | GB/s |", "|---|---:|---:|---:|"]
    for mb in (32, 84, 150, 270, 600, 1200):
        t = torch.ones(mb * 2 ** 20 // 4, dtype=torch.float32)
        s = median_s(lambda: t.sum())
        rows.append(f"| torch.sum, float32 | {mb} | {s * 1e3:.2f} | {t.numel() * 4 / s / 1e9:.1f} |")
        del t
    x = torch.randn(1, 576).bfloat16()
    for mb in (84, 270, 600):
        n = mb * 2 ** 20 // (576 * 2) // 16 * 16
        w = kernels.Kernels.pack_bf16(torch.randn(n, 576).bfloat16())
        s = median_s(lambda: k.mm_bf16(x, w, n))
        rows.append(f"| bf16_mm, M = 1, one {n} x 576 weight | {mb} | {s * 1e3:.2f} | {n * 576 * 2 / s / 1e9:.1f} |")
        del w
    ws = {name: [kernels.Kernels.pack_bf16(torch.randn(*nk).bfloat16()) for _ in range(LAYERS)]
          for name, nk in SHAPES.items()}
    head = kernels.Kernels.pack_bf16(torch.randn(*HEAD).bfloat16())
    xs = {K: torch.randn(1, K).bfloat16() for K in (576, 1536)}
    per: dict[str, list[float]] = {name: [] for name in [*SHAPES, "lm-head"]}
    whole = []
    for _ in range(12):
        t0 = time.perf_counter()
        for layer in range(LAYERS):
            for name, (n, K) in SHAPES.items():
                t = time.perf_counter()
                k.mm_bf16(xs[K], ws[name][layer], n)
                per[name].append(time.perf_counter() - t)
        t = time.perf_counter()
        k.mm_bf16(xs[576], head, HEAD[0], out_dtype=torch.float32)
        per["lm-head"].append(time.perf_counter() - t)
        whole.append(time.perf_counter() - t0)
    for name, ts in per.items():
        n, K = SHAPES.get(name, HEAD)
        s = statistics.median(ts)
        rows.append(f"| bf16_mm, M = 1, {name} {n} x {K} | {n * K * 2 / 2 ** 20:.2f} | {s * 1e3:.3f} | "
                    f"{n * K * 2 / s / 1e9:.1f} |")
    total = sum(n * K * 2 for n, K in SHAPES.values()) * LAYERS + HEAD[0] * HEAD[1] * 2
    s = statistics.median(whole[2:])
    rows.append(f"| the 121 GEMMs of a one-row step, in order | {total / 2 ** 20:.0f} | {s * 1e3:.2f} | "
                f"{total / s / 1e9:.1f} |")
    rows += ["", footer(f"python benchmarks/mem_ceiling.py --threads {a.threads}{' --docs' if a.docs else ''}",
                        f", {a.threads} threads")]
    publish("\n".join(rows), "MODEL.md", "mem-ceiling", a.docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
