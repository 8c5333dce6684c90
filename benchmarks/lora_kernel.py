#!/usr/bin/env python
"""The batched LoRA update alone (kernels.c `lora_*`), in process: 30 layers x 4 linear layers of
SmolLM2-135M's shapes, rows spread evenly over 8 adapters of rank 8 on all 7 projections.

    .venv/bin/python benchmarks/lora_kernel.py [--rows 64,2048] [--adapters 8] [--rank 8]

Checks each linear against the torch path (same sums, another order: close, not equal) and that a
row alone gives the bits it gives in the batch, then prints the best of 3 timings per step, in ms.
docs/SERVING.md ("LoRA adapters") quotes it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shepherd.config import ModelConfig  # noqa: E402
from shepherd.model import kernels as K  # noqa: E402
from shepherd.model.lora import LoraAdapter, LoraPool, linear_shapes  # noqa: E402

SMOLLM2 = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 1e4, None, 2048, True, False)


def pool_of(cfg: ModelConfig, adapters: int, rank: int, g: torch.Generator) -> LoraPool:
    pool = LoraPool(cfg, adapters, rank)
    shapes = {m: (k, n) for lin, (k, parts) in linear_shapes(cfg).items() for m, n in parts}
    for s in range(adapters):
        ad = LoraAdapter(f"a{s}", "", rank)
        for li in range(cfg.num_layers):
            for m, (k, n) in shapes.items():
                ad.weights[(li, m)] = (torch.randn(rank, k, generator=g) * 0.02, torch.randn(rank, n, generator=g) * 0.02)
        pool.load(s, ad)
    return pool


def time_rows(pool: LoraPool, kern, n: int, adapters: int, g: torch.Generator) -> dict[str, float]:
    rows = LoraPool.rows([i % adapters for i in range(n)])
    out = {}
    for lin, (k, parts) in pool.shapes.items():
        cols = sum(c for _, c in parts)
        x = torch.randn(n, k, generator=g).to(torch.bfloat16)
        y0 = torch.randn(n, cols, generator=g).to(torch.bfloat16)
        y1, y2 = y0.clone(), y0.clone()
        pool.apply(3, lin, x, y1, rows, kern)
        pool.apply(3, lin, x, y2, rows, None)
        assert (y1.float() - y2.float()).abs().max() <= 0.02 * y2.float().abs().max(), lin
        alone = y0[5:6].clone()
        pool.apply(3, lin, x[5:6].contiguous(), alone, LoraPool.rows([5 % adapters]), kern)
        assert torch.equal(alone, y1[5:6]), f"{lin}: a row alone differs from the same row in the batch"
        inner = 10 if n <= 256 else 1
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(inner):
                for li in range(pool.cfg.num_layers):
                    pool.apply(li, lin, x, y1, rows, kern)
            best = min(best, (time.perf_counter() - t0) / inner * 1000)
        out[lin] = best
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,2048")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    a = ap.parse_args()
    lib = K.load()
    if lib is None:
        print("no kernel library (no compiler?): nothing to time", file=sys.stderr)
        return 1
    kern = K.Kernels(lib, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    pool = pool_of(SMOLLM2, a.adapters, a.rank, g)
    print(f"LoRA update alone, {SMOLLM2.num_layers} layers, {a.adapters} adapters of rank {a.rank}, "
          f"threads {torch.get_num_threads()}; ms per step, best of 3\n")
    print("| rows | qkv | o | gate-up | down | total |\n|---:|---:|---:|---:|---:|---:|")
    for n in (int(r) for r in a.rows.split(",") if r):
        t = time_rows(pool, kern, n, a.adapters, g)
        print(f"| {n} | {t['qkv']:.2f} | {t['o']:.2f} | {t['gu']:.2f} | {t['down']:.2f} | {sum(t.values()):.2f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
