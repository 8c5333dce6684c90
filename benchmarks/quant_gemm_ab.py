#!/usr/bin/env python
"""The 120 layer GEMMs of a SmolLM2-135M step (QKV, O, gate-up, down x 30; random weights of
the model's shapes), per weight format, interleaved runs, median of 5:

  bf16      llama.Linear: shepherd's bf16_mm where the CPU has AVX512-BF16, else oneDNN
  oneDNN    oneDNN prepacked bf16 (what llama.Linear ran before bf16_mm)
  w8a8      row quantisation + torch._int_mm + scaling (quant.QLinear, fused kernels)
  int4      torch's _weight_int4pack_mm_for_cpu (bf16 activations)
  w4a8      shepherd's VNNI kernel (int4 weights x per-group int8 activations), where built

Then the LM head (49,152 x 576) alone, logits in float32: bf16 (bf16_mm), oneDNN, int8 with
torch's _weight_int8pack_mm, int8 with shepherd's w8_mm.

In-process figures that explain the step-time table (docs/MODEL.md); they are not serving speed.

    python benchmarks/quant_gemm_ab.py [--threads 1] [--rows 1,4,64]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

from shepherd.model import kernels, quant  # noqa: E402
from shepherd.model.llama import Linear  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # (N, K) of QKV, O, gate-up, down


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,4,64")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lib = kernels.load()
    k = kernels.Kernels(lib, torch.bfloat16) if lib is not None else None
    owner = type("Owner", (), dict(kernels=k, batch_invariant=False, min_rows=1, use_mkldnn=True,
                                   device=torch.device("cpu")))()
    dnn = type("Owner", (), dict(kernels=None, batch_invariant=False, min_rows=1, use_mkldnn=True,
                                 device=torch.device("cpu")))()
    fmts = {"bf16": [], "oneDNN": [], "w8a8": [], "int4": []}
    if k is not None and k.w4a8:
        fmts["w4a8"] = []
    for _ in range(30):
        for N, K in SHAPES:
            w = torch.randn(N, K) * 0.05
            fmts["bf16"].append(Linear(w.bfloat16(), None, owner))
            fmts["oneDNN"].append(Linear(w.bfloat16(), None, dnn))
            fmts["w8a8"].append(quant.QLinear(quant.quantize_int8(w, "w8a8"), None, owner, torch.bfloat16))
            q4 = quant.quantize_int4(w)
            fmts["int4"].append(quant.QLinear(q4, None, type("O", (), dict(kernels=None))(), torch.bfloat16))
            if "w4a8" in fmts:
                fmts["w4a8"].append(quant.QLinear(q4, None, owner, torch.bfloat16))
    table(fmts, a.rows, "the 120 GEMMs", lambda lin, x: lin.raw(x[lin.in_features]), a.threads)
    head = torch.randn(49152, 576) * 0.05
    q8 = quant.quantize_int8(head)
    heads = {"bf16": [Linear(head.bfloat16(), None, owner)], "oneDNN": [Linear(head.bfloat16(), None, dnn)],
             "int8 (torch)": [quant.QLinear(q8, None, dnn, torch.bfloat16)]}
    if k is not None and k.w8:
        heads["int8 (w8_mm)"] = [quant.QLinear(q8, None, owner, torch.bfloat16)]
    table(heads, a.rows, "the LM head", lambda lin, x: lin.logits(x[576]), a.threads)


def table(fmts: dict, rows: str, what: str, call, threads: int) -> None:
    print(f"\n| rows | {' | '.join(fmts)} |  (ms for {what}, {threads} thread(s), median of 5)")
    print("|---|" + "---|" * len(fmts))
    for M in map(int, rows.split(",")):
        xs = {K: torch.randn(M, K).bfloat16() for K in (576, 1536)}
        times = {f: [] for f in fmts}
        with torch.inference_mode():
            for rep in range(6):
                for f, lins in fmts.items():     # interleaved: each format sees the same machine state
                    t0 = time.perf_counter()
                    for lin in lins:
                        call(lin, xs)
                    if rep:
                        times[f].append((time.perf_counter() - t0) * 1e3)
        print(f"| {M} | " + " | ".join(f"{statistics.median(v):.2f}" for v in times.values()) + " |")

if __name__ == "__main__":
    main()
