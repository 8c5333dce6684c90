#!/usr/bin/env python
"""Why the engine core runs its loop in the process's main thread: one bf16 GEMM of a decode
step's shape, timed when driven from the initial thread and from a second thread.

    python benchmarks/omp_thread.py [--threads 2]

On the 2-core machine of docs/SERVING.md: ~70 us from the main thread, ~155-220 us from a
second thread at 2 OpenMP threads (libgomp keeps a warm worker team for the initial thread);
at 1 thread both are the same. Prints one line per case; writes nothing.
"""
from __future__ import annotations

import argparse
import threading
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=2000)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    w = torch.randn(1536, 576).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    x = torch.randn(4, 576).bfloat16()

    def bench(where: str) -> None:
        for _ in range(50):
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        t = time.perf_counter()
        for _ in range(a.iters):
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        print(f"{where:>14}: {(time.perf_counter() - t) / a.iters * 1e6:7.1f} us per GEMM "
              f"({torch.get_num_threads()} threads)", flush=True)

    bench("main thread")
    t = threading.Thread(target=bench, args=("second thread",))
    t.start()
    t.join()


if __name__ == "__main__":
    main()
