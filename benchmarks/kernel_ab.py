#!/usr/bin/env python
"""Did a kernels.c change move the decode step? Two builds in ONE process, swapped step by step.

    python benchmarks/kernel_ab.py --base main [--rows 1] [--steps 600] [--runs 2] [--docs]

Builds shepherd/model/kernels.c of git revision --base (in a subprocess, from that revision's
shepherd/ tree, into this tree's kernel cache) beside this tree's own, builds one TorchExecutor
(batch-invariant, the served default), prefills --rows prompts of ~128 tokens and times
`executor.execute` on decode steps, the model's kernel library swapped between the two builds
before every step (A = base, B = this tree; they alternate, so a slow spell of a shared machine
falls on both alike: served A/B runs on this 2-core machine moved 47-83 tok/s within minutes).
Both builds must keep the same kernel ABI (kernel_abi.py is this tree's). Prints per run the
median step of each and the median of B over the mean of its two neighbouring A steps; --docs
writes the table into docs/MODEL.md (<!-- kernel-ab -->).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _docs import footer, publish  # noqa: E402


def export_shepherd(rev: str, dest: str) -> None:
    """The shepherd/ package of git revision `rev` of this checkout, written under `dest`."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "shepherd"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", dest], input=tar.stdout, check=True)


def build_base(rev: str) -> str:
    """The path of kernels.c of `rev` built as kernels.build() builds it (same flags, same cache)."""
    from shepherd.model import kernels
    with tempfile.TemporaryDirectory() as tmp:
        export_shepherd(rev, tmp)
        env = {**os.environ, "PYTHONPATH": tmp, "SHEPHERD_CACHE_DIR": os.path.dirname(kernels.cache_dir())}
        out = subprocess.run([sys.executable, "-c", "from shepherd.model import kernels; print(kernels.build())"],
                             env=env, cwd=tmp, check=True, capture_output=True, text=True)
    so = out.stdout.strip().splitlines()[-1]
    if so == "None":
        raise SystemExit(f"kernels.c of {rev} did not build")
    return so


def one_run(ex, libs: dict, rows: int, steps: int, run: int) -> dict:
    from step_time import decode_turns
    kern = ex.model.kernels

    def use(side: str) -> None:
        kern.lib = libs[side]

    seq = [(side, dt) for side, dt, _ in decode_turns(ex, rows, 128, ["A", "B"], use, steps // 2, 10, f"ab{run}")]
    kern.lib = libs["B"]
    a = [dt for side, dt in seq if side == "A"]
    b = [dt for side, dt in seq if side == "B"]
    paired = [seq[i][1] / ((seq[i - 1][1] + seq[i + 1][1]) / 2) for i in range(1, len(seq) - 1) if seq[i][0] == "B"]
    return {"a": statistics.median(a) * 1e3, "b": statistics.median(b) * 1e3, "n": len(b),
            "paired": statistics.median(paired)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="main", help="git revision whose kernels.c is A")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--steps", type=int, default=600, help="timed decode steps per run (half each)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--docs", action="store_true", help="write the table into docs/MODEL.md")
    a = ap.parse_args()
    base_so = build_base(a.base)
    import torch
    from shepherd.config import EngineConfig
    from shepherd.engine.torch_executor import TorchExecutor
    from shepherd.model import kernel_abi
    ex = TorchExecutor(EngineConfig(num_threads=a.threads, batch_invariant=True,
                                    max_total_tokens=a.runs * a.rows * (a.steps + 200) + 1024))
    if ex.model.kernels is None:
        raise SystemExit("no fused kernels in this process: nothing to compare")
    libs = {"A": kernel_abi.bind(ctypes.CDLL(base_so)), "B": ex.model.kernels.lib}
    head = (f"{a.rows}-row decode step, A = kernels.c of {a.base}, B = this tree's, swapped every step "
            f"({a.steps // 2} steps each a run, {torch.get_num_threads()} threads, batch-invariant)")
    lines = [head, "", "| run | A p50, ms | B p50, ms | B / A (p50s) | B / neighbouring A (median) |",
             "|---:|---:|---:|---:|---:|"]
    for run in range(a.runs):
        r = one_run(ex, libs, a.rows, a.steps, run)
        lines.append(f"| {run + 1} | {r['a']:.3f} | {r['b']:.3f} | {r['b'] / r['a']:.3f} | {r['paired']:.3f} |")
        print(lines[-1], flush=True)
    cpu = platform.processor() or platform.machine()
    lines += ["", footer(f"python benchmarks/kernel_ab.py --base {a.base} --rows {a.rows} --steps {a.steps} "
                         f"--runs {a.runs}{' --docs' if a.docs else ''}", f" on {cpu}")]
    print()
    publish("\n".join(lines), "MODEL.md", "kernel-ab", a.docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
