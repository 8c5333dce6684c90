"""Scheduler CPU per step with a deep waiting queue of long prompts (issue 30, item 3).

The engine's Scheduler alone (no model, no executor: each step's tokens are made up), in
a state where admission is tried every step and fails: 8 running requests, each the
latest turn of a conversation (a cached history of H tokens plus 1,000 new ones, decoding
400 tokens); Q waiting requests, each another turn of one of those conversations (the same
history, locked in the prefix cache by the running turn, plus 3,000 new tokens), with too
little KV left for any of them. Every step the scheduler examines the head of the queue
(the look-ahead) and the simulator's fast path (`decode_horizon`) examines up to the
batch's room; each examined request is matched against the radix tree. Before issue 30
every examination compared the prompt against the tree again (a partial match inside a
13k-token node copies slices of it); now the match is remembered until the tree changes
where it ended (RadixCache.match_memo).

Per step: `schedule()` + `on_step()` (what the engine pays) and `decode_horizon()` (what
the simulator adds), median over 150 steps, in microseconds.

    .venv/bin/python benchmarks/scheduler_queue.py --json after.json          # this checkout
    .venv/bin/python benchmarks/scheduler_queue.py --compare before.json after.json   # the table -> docs
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

RUNNING = 8
NEW_RUNNING = 1000
NEW_WAITING = 3000
OUT_RUNNING = 400
STEPS = 150
CASES = [(policy, q, h) for policy in ("fcfs", "lpm") for q in (100, 1000) for h in (1000, 10000)]


def one_case(policy: str, queue: int, history: int) -> dict:
    from shepherd.config import SchedulerConfig
    from shepherd.request import Request, SamplingParams
    from shepherd.scheduler.scheduler import Scheduler
    from shepherd.step import StepResult

    cap = RUNNING * (history + NEW_RUNNING + OUT_RUNNING) + 1000
    s = Scheduler(SchedulerConfig(max_total_tokens=cap, max_batch_size=256, max_num_tokens=2048, policy=policy,
                                  max_queue=10 ** 6, max_concurrency=10 ** 6), max_model_len=1 << 20)
    base = 1000
    hist = [list(range(base + i * 100_000, base + i * 100_000 + history)) for i in range(RUNNING)]
    now = 0.0

    def step():
        nonlocal now
        b = s.schedule(now)
        toks = {q.req_id: [5] for q in b.seqs if q.sample}
        s.on_step(b, StepResult(tokens=toks), now)
        now += 0.01
        return b

    for i in range(RUNNING):
        turn = list(range(base + i * 100_000 + 50_000, base + i * 100_000 + 50_000 + NEW_RUNNING))
        s.add(Request(f"run{i}", hist[i] + turn, SamplingParams(max_tokens=OUT_RUNNING), eos_token_ids=(2,)), now)
    while any(e.in_prefill() for e in s.queues.running) or s.queues.waiting:
        step()
    for j in range(queue):
        i = j % RUNNING
        turn = list(range(10 ** 7 + j * NEW_WAITING, 10 ** 7 + (j + 1) * NEW_WAITING))
        s.add(Request(f"w{j}", hist[i] + turn, SamplingParams(max_tokens=100), eos_token_ids=(2,)), now)
    sched_us, horizon_us = [], []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        s.decode_horizon(now, finishing=True)
        t1 = time.perf_counter()
        b = step()
        t2 = time.perf_counter()
        horizon_us.append((t1 - t0) * 1e6)
        sched_us.append((t2 - t1) * 1e6)
        assert len(b.seqs) == RUNNING and len(s.queues.waiting) == queue, "the state must stay put"
    return {"policy": policy, "queue": queue, "prompt": history + NEW_WAITING,
            "schedule_us": statistics.median(sched_us), "horizon_us": statistics.median(horizon_us)}


def measure() -> dict:
    rows = [one_case(*c) for c in CASES]
    import subprocess

    import shepherd
    try:     # the checkout whose scheduler was measured (PYTHONPATH may name another than this script's)
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(shepherd.__file__).resolve().parent).stdout.strip()
    except OSError:
        rev = "?"
    return {"rows": rows, "commit": rev, "machine": platform.processor() or platform.machine()}


def table(before: dict, after: dict) -> str:
    out = [f"| policy | waiting | prompt tokens | schedule + on_step, before | after | ratio | "
           f"decode_horizon, before | after | ratio |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for b, a in zip(before["rows"], after["rows"]):
        out.append(f"| {a['policy']} | {a['queue']:,} | {a['prompt']:,} | {b['schedule_us']:,.0f} us | "
                   f"{a['schedule_us']:,.0f} us | {b['schedule_us'] / a['schedule_us']:.1f}x | "
                   f"{b['horizon_us']:,.0f} us | {a['horizon_us']:,.0f} us | "
                   f"{b['horizon_us'] / a['horizon_us']:.1f}x |")
    out.append("")
    out.append(f"Medians over {STEPS} steps; before: commit {before['commit']}, after: commit {after['commit']}. "
               f"`python benchmarks/scheduler_queue.py --json F` on each, then `--compare BEFORE AFTER`; "
               f"machine: {after['machine']}, in /work/bin/quiet.")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="measure this checkout, write the figures here")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="the table of two --json files")
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args()
    if a.compare:
        before, after = (json.loads(Path(p).read_text()) for p in a.compare)
        text = table(before, after)
        print(text)
        if not a.no_docs:
            from _docs import write_block
            print(f"wrote {write_block('SIMULATION.md', 'scheduler-queue', text)}")
        return 0
    res = measure()
    for r in res["rows"]:
        print(f"{r['policy']:5} queue {r['queue']:5} prompt {r['prompt']:6}: schedule+on_step "
              f"{r['schedule_us']:9,.0f} us  decode_horizon {r['horizon_us']:9,.0f} us")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
