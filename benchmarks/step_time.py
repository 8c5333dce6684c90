#!/usr/bin/env python
"""In-process decode step time at 1 and 64 rows, beside the time of its GEMMs alone.

Builds a TorchExecutor (batch-invariant by default), prefills N distinct prompts of
~`--ctx` tokens, then times `executor.execute` on decode steps of all N rows (the step
the engine runs: build input, forward, sampling). "GEMM only" runs the same 121
products (qkv, o, gate-up, down per layer, and the LM head on the sampled rows) with
the same M on random inputs: the floor the rest of the step is measured against.

Prints a table and, with --label, writes/updates one row per (label, rows) in
docs/BENCHMARKS.md between <!-- steptime:start --> and <!-- steptime:end -->.

    python benchmarks/step_time.py                         # 1 and 64 rows, bf16, 2 threads

CPU is the main thread's CPU time (time.thread_time): with --threads 1 it is the work itself,
unaffected by other processes taking the core; wall time is what a user sees.
    python benchmarks/step_time.py --label "baseline" --quantization int4

--watch takes a comma list of between-layers hooks that take turns step by step in one
process (so that the machine's slow spells fall on each alike): none (the one-call layer
stack), governor (the serving core's thread governor, engine/threads.py
ThreadGovernor.between_layers, as `shepherd serve` installs it when it picks the thread count:
at 2 threads the stack's C call looks every 10 ms at an op boundary and returns to it only at a
short look), every (a look at every op boundary: the stack cut at each op, inside layers too, what
a cut costs; the per-op paths: before every layer),
probe (the stack returns at each of its looks every 10 ms whatever it finds: prints the looks,
each thread's CPU time against the wall time, that the governor's `least` is set against).
--hogs N runs N busy processes beside it (threads_contention.py's hog) while it times.
    python benchmarks/step_time.py --threads 2 --steps 20 --watch none,governor,every
    python benchmarks/step_time.py --watch probe --hogs 1
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

START, END = "<!-- steptime:start -->", "<!-- steptime:end -->"
HEAD = ("| change | quant | rows | decode step p50, ms: wall (CPU) | GEMM only, ms: wall (CPU) | rest, ms: wall (CPU) "
        "| device, threads | measured |\n|---|---|---|---|---|---|---|---|")


def decode_steps(args) -> int:
    """Decode steps time_decode runs: warm-up and timed steps for each --watch variant."""
    return (args.steps + args.warmup) * len(args.watch)


def build(args):
    import torch
    from shepherd.config import EngineConfig
    from shepherd.engine.torch_executor import TorchExecutor
    kw = {}
    for k in ("quantization", "device", "kernels"):
        if getattr(args, k, None) is not None and hasattr(EngineConfig, k):
            kw[k] = getattr(args, k)
    cfg = EngineConfig(model=args.model, dtype=args.dtype, batch_invariant=not args.no_batch_invariant,
                       num_threads=args.threads,
                       max_total_tokens=max(args.rows) * (args.ctx + decode_steps(args) + 64) + 256, **kw)
    t0 = time.perf_counter()
    ex = TorchExecutor(cfg)
    args.looks = {}

    def probe(layer, look):   # --watch probe: the stack's looks, by rows
        if look is not None:
            args.looks.setdefault(args.rows_now, []).append(look)
        return 0.01
    args.hooks = {"none": None, "every": lambda layer, look: 0.0, "probe": probe}
    if "governor" in args.watch:
        from shepherd.engine.threads import ThreadGovernor
        args.governor = ThreadGovernor(torch.get_num_threads(), torch.set_num_threads)
        args.hooks["governor"] = args.governor.between_layers
    print(f"executor ready in {time.perf_counter() - t0:.1f} s (threads {torch.get_num_threads()})", flush=True)
    return ex


def prompts(tok, n, ctx):
    base = ("Write a long and careful essay about the history of rivers, bridges, trains and the "
            "people who built them, variant {i}. ") * 20
    out = []
    for i in range(n):
        ids = tok.encode(base.format(i=i))[:ctx]
        out.append(ids)
    return out


def decode_turns(ex, n: int, ctx: int, variants: list, apply, steps: int, warmup: int, tag: str) -> list:
    """Prefill `n` prompts of `ctx` tokens, then decode them, the `variants` taking turns step by
    step (`apply(v)` before each of v's steps), so that a slow spell of the machine falls on all of
    them alike: [(variant, wall s, thread CPU s)] of the timed steps in order, after `warmup` steps
    of each. Used by time_decode (between-layer hooks) and kernel_ab.py (kernel builds)."""
    from shepherd.request import Request, RequestState, SamplingParams
    from shepherd.step import NewRequest, ScheduledBatch, ScheduledSeq
    total = (steps + warmup) * len(variants)
    reqs, slot = [], 0
    for i, p in enumerate(prompts(ex.tokenizer, n, ctx)):
        r = Request(req_id=f"{tag}-{i}", prompt_ids=p,
                    params=SamplingParams(max_tokens=total + 8, temperature=0.0, ignore_eos=True))
        r.slots = list(range(slot, slot + len(p) + total + 8))
        slot += len(r.slots)
        r.state = RequestState.RUNNING
        reqs.append(r)
    for k in range(0, n, 8):   # prefill 8 at a time
        seqs = [ScheduledSeq(r.req_id, r.prompt_ids, 0, True, 0, list(r.slots)) for r in reqs[k:k + 8]]
        new = [NewRequest(r.req_id, r.prompt_ids, r.params) for r in reqs[k:k + 8]]
        res = ex.execute(ScheduledBatch(step=0, new=new, seqs=seqs))
        for r in reqs[k:k + 8]:
            r.output_ids.append(res.tokens[r.req_id][0])
    out = []
    for s in range(total):
        v = variants[s % len(variants)]
        apply(v)
        seqs = [ScheduledSeq(r.req_id, [r.output_ids[-1]], r.num_tokens - 1, True, len(r.slots)) for r in reqs]
        t0, c0 = time.perf_counter(), time.thread_time()
        res = ex.execute(ScheduledBatch(step=s + 1, seqs=seqs))
        dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        if s >= warmup * len(variants):
            out.append((v, dt, dc))
        for r in reqs:
            r.output_ids.append(res.tokens[r.req_id][0])
    for r in reqs:
        r.state = RequestState.FINISHED
    ex.execute(ScheduledBatch(step=0, finished=[r.req_id for r in reqs]))
    return out


def time_decode(ex, n, args):
    seq = decode_turns(ex, n, args.ctx, args.watch, lambda w: ex.watch_layers(args.hooks[w]),
                       args.steps, args.warmup, f"st{n}")
    ex.watch_layers(None)
    return {w: (statistics.median(dt for v, dt, _ in seq if v == w) * 1000,
                statistics.median(dc for v, _, dc in seq if v == w) * 1000) for w in args.watch}


def time_gemms(ex, n, args):
    """The step's GEMMs alone, same M (padded as the model pads it), same kernels."""
    import torch
    m = ex.model
    M = n
    if m.batch_invariant and M < m.min_rows:
        M = m.min_rows
    dev = getattr(m, "device", torch.device("cpu"))
    lins = []
    for L in m.layers:
        lins += [L["qkv"], L["o"], L["gu"], L["down"]]
    lins.append(m.lm_head)
    xs = {lin.in_features: torch.randn(M, lin.in_features, device=dev).to(m.dtype) for lin in lins}
    times, cpu = [], []
    with torch.inference_mode():
        for s in range(args.steps + args.warmup):
            t0, c0 = time.perf_counter(), time.thread_time()
            for lin in lins:
                lin.raw(xs[lin.in_features])
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if s >= args.warmup:
                times.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
    return statistics.median(times) * 1000, statistics.median(cpu) * 1000


def start_hogs(n: int) -> list:
    """n busy processes (threads_contention.py's hog), started now."""
    import multiprocessing

    from threads_contention import hog
    hogs = [multiprocessing.get_context("spawn").Process(target=hog, daemon=True) for _ in range(n)]
    for h in hogs:
        h.start()
    return hogs


def look_table(looks: list) -> str:
    """The stack's looks: percentiles of the least CPU share a thread got and of the team's CPUs,
    and how many looks fall under each candidate `least`."""
    def pct(v, q):
        v = sorted(v)
        return v[min(len(v) - 1, int(q * len(v)))]
    least, cpus = [lk.least for lk in looks], [lk.cpus for lk in looks]
    qs = (0.01, 0.05, 0.25, 0.5, 0.75)
    return (f"{len(looks)} looks, wall p50 {1e3 * pct([lk.wall for lk in looks], 0.5):.1f} ms; least thread share "
            + " ".join(f"p{int(100 * q)} {pct(least, q):.2f}" for q in qs)
            + "; team CPUs " + " ".join(f"p{int(100 * q)} {pct(cpus, q):.2f}" for q in qs)
            + "; share of looks under " + " ".join(f"{t}: {sum(x < t for x in least) / len(least):.0%}"
                                                   for t in (0.5, 0.65, 0.8, 0.9)))


def write_rows(rows: list[str], path: Path) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    old = []
    if START in text and END in text:
        a, b = text.index(START), text.index(END)
        old = [ln for ln in text[a + len(START):b].strip().splitlines() if ln.startswith("| ") and
               not ln.startswith("| change") and not ln.startswith("|---")]
        keys = {tuple(c.strip() for c in r.split("|")[1:4]) for r in rows}
        old = [ln for ln in old if tuple(c.strip() for c in ln.split("|")[1:4]) not in keys]
        block = f"{START}\n{HEAD}\n" + "\n".join(old + rows) + f"\n{END}"
        text = text[:a] + block + text[b + len(END):]
    else:
        text = text.rstrip("\n") + f"\n\n{START}\n{HEAD}\n" + "\n".join(rows) + f"\n{END}\n"
    path.write_text(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--ctx", type=int, default=128, help="prompt tokens per row")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-batch-invariant", action="store_true")
    ap.add_argument("--quantization", default=None, help="none|int8|int4|auto (if the build has it)")
    ap.add_argument("--device", default=None, help="cpu|cuda|cuda:N (if the build has it)")
    ap.add_argument("--kernels", default=None, help="auto|fused|torch")
    ap.add_argument("--watch", default="none", help="comma list of between-layers hooks, taking turns step by step: "
                    "none, governor (the serving core's thread governor), every (a look before every layer), "
                    "probe (the stack's looks)")
    ap.add_argument("--hogs", type=int, default=0, help="busy processes beside the timed steps")
    ap.add_argument("--label", default=None, help="write rows under this change label into docs/BENCHMARKS.md")
    ap.add_argument("--out", default=str(ROOT / "docs" / "BENCHMARKS.md"))
    args = ap.parse_args(argv)
    args.rows = [int(x) for x in args.rows.split(",") if x]
    args.watch = [w for w in args.watch.split(",") if w]
    if not args.watch or set(args.watch) - {"none", "governor", "every", "probe"}:
        ap.error(f"--watch {','.join(args.watch)}: expected a comma list of none, governor, every, probe")
    import torch
    ex = build(args)
    rows = []
    print(HEAD)
    hogs = start_hogs(args.hogs)
    for n in args.rows:
        args.rows_now = n
        with torch.inference_mode():
            steps = time_decode(ex, n, args)
        gemm, gemm_c = time_gemms(ex, n, args)
        dev = str(getattr(ex, "device", "cpu"))
        q = getattr(ex, "quantization", "none")
        for w, (step, step_c) in steps.items():
            label = (args.label or "-") + ("" if w == "none" else f" (hook: {w})")
            row = (f"| {label} | {q} | {n} | {step:.1f} ({step_c:.1f}) | {gemm:.1f} ({gemm_c:.1f}) "
                   f"| {step - gemm:.1f} ({step_c - gemm_c:.1f}) | {dev}, "
                   f"{torch.get_num_threads()} "
                   f"| {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} |")
            print(row, flush=True)
            rows.append(row)
    for h in hogs:
        h.terminate()
        h.join(5)
    for n, looks in args.looks.items():
        print(f"probe looks, {n} rows, {args.hogs} hog(s): {look_table(looks)}")
    if "governor" in args.watch:   # a drop would time the rest at one thread: say so
        print(f"governor: {args.governor.mid_step_drops} mid-step drop(s), threads now {args.governor.threads}")
    if args.label:
        write_rows(rows, Path(args.out))
        print(f"written to {args.out}")


if __name__ == "__main__":
    main()
