#!/usr/bin/env python
"""What one decode step of one stream costs the engine core outside the forward's two big
kernels, part by part, in process; with --base, two checkouts taking turns (A B B A ...).

    python benchmarks/core_loop_cost.py [--base REV | --base-tree DIR] [--runs 2] [--requests 4] [--tokens 128] [--docs]

Each run is a fresh process that builds the core as `shepherd serve --admission optimistic`
builds it (serve_cli.build_configs, engine/build.py, the thread governor's hook and its tick
after each send, as engine/core_proc.py installs them) and runs core_loop.run_loop itself over a
real multiprocessing Pipe (core_proc.PipeRecv reads it; the CoreStep goes out with
Connection.send). --requests free-1 questions (the chat template's ids) go in one at a time,
greedy, --tokens output tokens each (EOS ignored). Every part is timed with perf_counter by
wrapping the method that does it (a wrapper costs well under a microsecond); per decode step
(one row, one token) the table gives the mean in microseconds:

    iteration        recv to recv: one turn of the loop
    C layer stack    kernels.c forward_bf16 (the 30 layers)
    LM head GEMM     kernels.c bf16_mm over the LM head's 49,152 rows
    outside          iteration - the two above: what this page is about
    and the parts of `outside`: recv, intake, schedule, build input, forward before the stack
    (embedding, first norm, the stack's scratch), LM head outside its GEMM (final norm, output
    tensor), sample, execute's rest, on_step, outputs, stats, step logger, send (pickle, write,
    governor tick), of which the governor's tick (engine/threads.py, once a step), the loop's rest.

With --base REV the same is run on `git archive REV shepherd` (this script's code, that tree's
shepherd/) and this tree alternately, each --runs times, and B - A is printed per part (--base-tree:
that folder's shepherd/ instead of a revision's). --docs
writes the table into docs/SERVING.md (<!-- core-loop-cost -->).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PARTS = ("recv", "intake", "schedule", "build input", "forward before the stack", "LM head outside its GEMM",
         "sample", "execute's rest", "on_step", "outputs", "stats", "step logger", "send", "governor tick",
         "loop's rest")


def worker(tree: str, requests: int, tokens: int) -> dict:
    """Run the loop in this process on the shepherd/ of `tree`; the per-part means (us) as a dict."""
    sys.path.insert(0, tree)
    sys.path.insert(1, str(ROOT / "benchmarks"))
    from collections import defaultdict
    from multiprocessing import Pipe

    import torch

    from _openai_client import questions
    from shepherd.engine import core_proc
    from shepherd.engine.build import build_served_core
    from shepherd.engine.core_loop import ADD, SHUTDOWN, run_loop
    from shepherd.request import Request, SamplingParams
    from shepherd.server.serve_cli import add_arguments, build_configs

    p = argparse.ArgumentParser()
    add_arguments(p)
    eng, _ = build_configs(p.parse_args(["--admission", "optimistic"]))
    served = build_served_core(eng)
    gov = core_proc.governor(eng, torch.get_num_threads())
    if gov is not None and core_proc.mid_step_rule():
        served.core.executor.watch_layers(gov.between_layers)
    ex, sched = served.core.executor, served.scheduler
    model = ex.model
    kern = model.kernels
    if kern is None or model.layer_ptrs is None:
        raise SystemExit("this measures the one-call layer stack (kernels.layer_stack): not in use here")

    acc: dict[str, float] = defaultdict(float)

    def wrap(obj, name: str, part: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                acc[part] += time.perf_counter() - t0
        setattr(obj, name, timed)

    stack = kern.layer_stack

    def timed_stack(**kw):
        run = stack(**kw)

        def timed_run(*args):
            t0 = time.perf_counter()
            try:
                return run(*args)
            finally:
                acc["C layer stack"] += time.perf_counter() - t0
        return timed_run
    kern.layer_stack = timed_stack
    wrap(kern.lib, "bf16_mm", "LM head GEMM")
    for obj, name, part in ((served, "intake", "intake"), (sched, "schedule", "schedule"),
                            (ex, "build_input", "build input"), (model, "forward", "forward"),
                            (model, "_logits", "logits"), (ex, "_sample", "sample"), (ex, "execute", "execute"),
                            (sched, "on_step", "on_step"), (served, "_outputs", "outputs"), (sched, "stats", "stats"),
                            (served.step_logger, "on_step", "step logger")):
        wrap(obj, name, part)

    core_end, front_end = Pipe()
    recv_pipe = core_proc.PipeRecv(core_end)
    tok = served.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions(requests)]
    left = list(prompts)
    per: dict[str, list[float]] = defaultdict(list)
    state = {"t": None, "decode": False}

    def recv(timeout):
        t = time.perf_counter()
        if state["t"] is not None and state["decode"]:
            acc["iteration"] = t - state["t"]
            for k, v in acc.items():
                per[k].append(v)
        acc.clear()
        state["t"], state["decode"] = t, False
        if timeout is None:      # idle: the next request (or the end) goes into the pipe first
            while front_end.poll(0):
                front_end.recv()
            if left:
                ids = list(left.pop(0))
                front_end.send([(ADD, Request(req_id=f"c{len(left)}", prompt_ids=ids, arrival=time.monotonic(),
                                              params=SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                    ignore_eos=True),
                                              eos_token_ids=tuple(served.info.eos_token_ids)))])
            else:
                front_end.send([(SHUTDOWN, None)])
            state["t"] = None
        t0 = time.perf_counter()
        items = recv_pipe(timeout)
        acc["recv"] += time.perf_counter() - t0
        return items

    if gov is not None:
        wrap(gov, "tick", "governor tick")
    tick = None if gov is None else gov.tick
    if hasattr(core_proc, "pipe_send"):
        loop_send = core_proc.pipe_send(core_end, tick)
    else:     # the send core_proc._serve built before pipe_send
        def loop_send(msg):
            core_end.send(msg)
            if tick is not None:
                tick()

    def send(msg):
        t0 = time.perf_counter()
        loop_send(msg)
        acc["send"] += time.perf_counter() - t0
        st = served.last_step
        state["decode"] = bool(st is not None and st.ran and len(st.batch.seqs) == 1
                               and len(st.batch.seqs[0].token_ids) == 1 and msg.generated == 1 and not msg.answers)

    run_loop(served, recv, send)
    served.close()
    n = len(per["iteration"])
    get = lambda k: [v for v in per.get(k, [])] + [0.0] * (n - len(per.get(k, [])))
    cols = {k: get(k) for k in ("iteration", "C layer stack", "LM head GEMM", "recv", "intake", "schedule",
                                "build input", "forward", "logits", "sample", "execute", "on_step", "outputs",
                                "stats", "step logger", "send", "governor tick")}
    derived = {
        "outside": [i - s - g for i, s, g in zip(cols["iteration"], cols["C layer stack"], cols["LM head GEMM"])],
        "forward before the stack": [f - s - lg for f, s, lg in
                                     zip(cols["forward"], cols["C layer stack"], cols["logits"])],
        "LM head outside its GEMM": [lg - g for lg, g in zip(cols["logits"], cols["LM head GEMM"])],
        "execute's rest": [e - b - f - s for e, b, f, s in
                           zip(cols["execute"], cols["build input"], cols["forward"], cols["sample"])],
    }
    top = ("recv", "intake", "schedule", "execute", "on_step", "outputs", "stats", "step logger", "send")
    derived["loop's rest"] = [cols["iteration"][i] - sum(cols[k][i] for k in top) for i in range(n)]
    cols.update(derived)
    return {"steps": n, "mean": {k: statistics.mean(v) * 1e6 for k, v in cols.items()},
            "median": {k: statistics.median(v) * 1e6 for k, v in cols.items()}}


def run_tree(tree: str, a) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, __file__, "--worker", tree, "--requests", str(a.requests),
                          "--tokens", str(a.tokens)], env=env, cwd=tree, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=None, help="git revision to compare with (A); this tree is B")
    ap.add_argument("--base-tree", default=None, help="or a folder holding the shepherd/ to compare with (A)")
    ap.add_argument("--runs", type=int, default=2, help="runs of each side (alternating A B B A ...)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--docs", action="store_true")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.requests, a.tokens)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"B": str(ROOT)}
        if a.base_tree:
            sides["A"], a.base = str(Path(a.base_tree).resolve()), a.base_tree
        elif a.base:
            from kernel_ab import export_shepherd     # not at the top: it puts this checkout first on sys.path
            export_shepherd(a.base, tmp)
            sides["A"] = tmp
        order = []
        for r in range(a.runs):
            order += (["A", "B"] if r % 2 == 0 else ["B", "A"]) if a.base else ["B"]
        res: dict[str, list[dict]] = {s: [] for s in sides}
        for s in order:
            res[s].append(run_tree(sides[s], a))
            print(f"  {s} run {len(res[s])}: outside {res[s][-1]['mean']['outside']:.1f} us, iteration "
                  f"{res[s][-1]['mean']['iteration']:.1f} us over {res[s][-1]['steps']} steps", flush=True)
    names = ("iteration", "C layer stack", "LM head GEMM", "outside", *PARTS)
    mean = lambda s, k: statistics.mean(r["mean"][k] for r in res[s])
    runs = lambda s, k: "/".join(f"{r['mean'][k]:.0f}" for r in res[s])
    if a.base:
        lines = [f"| per decode step, one row, us (mean of each run) | A = {a.base} | B = this tree | B - A |",
                 "|---|---:|---:|---:|"]
        for k in names:
            lines.append(f"| {k} | {runs('A', k)} | {runs('B', k)} | {mean('B', k) - mean('A', k):+.0f} |")
    else:
        lines = ["| per decode step, one row, us (mean of each run) | this tree |", "|---|---:|"]
        lines += [f"| {k} | {runs('B', k)} |" for k in names]
    med = lambda s: "/".join(f"{r['median']['outside']:.0f}" for r in res[s])
    lines += ["", f"Outside, the median step of each run: {'A ' + med('A') + ', B ' if a.base else ''}{med('B')} us."]
    from _docs import footer, publish
    steps = res["B"][0]["steps"]
    lines += ["", f"{steps} decode steps a run. " + footer(
        f"python benchmarks/core_loop_cost.py{(' --base-tree ' if a.base_tree else ' --base ') + a.base if a.base else ''}"
        f" --runs {a.runs}{f' --requests {a.requests}' if a.requests != 4 else ''}"
        f"{f' --tokens {a.tokens}' if a.tokens != 128 else ''}{' --docs' if a.docs else ''}")]
    publish("\n".join(lines), "SERVING.md", "core-loop-cost", a.docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
