"""LoRA adapter policies on the simulated executor (no model, no clock: time is counted in steps).

    PYTHONPATH=. python benchmarks/lora_policies.py [--adapters 100] [--max-loras 8]

Workload: --requests requests over --adapters adapters with Zipf(1) popularity (a few hot
adapters, a long cold tail) plus 10 % for the base model, arriving at a fixed rate that keeps
the batch full; prompt 64 tokens, output 16..48. Each policy runs the same workload (one step
= one time unit; a step that loads adapters is not charged more here). The table says how long
requests waited to be admitted (mean, p99, longest), how many adapter loads that took, how
many adapters ran in a step, and the steps to finish it all (throughput).
"""
from __future__ import annotations

import argparse
import random
import statistics

from shepherd.config import SchedulerConfig
from shepherd.engine import offline
from shepherd.engine.sim_executor import SimExecutor
from shepherd.request import Request, SamplingParams
from shepherd.scheduler.scheduler import Scheduler

POLICIES = {
    "fit (vLLM)": dict(adapter_policy="fit"),
    "fit + vtc over adapters": dict(adapter_policy="fit", policy="vtc", vtc_unit="adapter"),
    "rotate (LoRAX), cycle 20": dict(adapter_policy="rotate", adapter_cycle_time=20.0),
    "rotate (LoRAX), cycle 80": dict(adapter_policy="rotate", adapter_cycle_time=80.0),
}


def workload(n: int, adapters: int, rate: float, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) for k in range(adapters)]
    reqs = []
    for i in range(n):
        a = None if rng.random() < 0.1 else f"ad{rng.choices(range(adapters), weights)[0]}"
        out = rng.randint(16, 48)
        r = Request(f"r{i}", [3 + i % 50] * 64, SamplingParams(max_tokens=out + 4), arrival=i / rate,
                    eos_token_ids=(2,), adapter=a)
        r.sim_output_len = out
        reqs.append(r)
    return reqs


def run(name: str, kw: dict, a) -> dict:
    reqs = workload(a.requests, a.adapters, a.rate)
    s = Scheduler(SchedulerConfig(max_total_tokens=65536, max_batch_size=a.batch, max_loras=a.max_loras,
                                  max_num_tokens=2048, **kw), host_kv_capacity=0, max_model_len=8192)
    ex = SimExecutor(kv_capacity=65536, host_kv_capacity=0, step_time=lambda b: 1.0)
    ex.output_lens.update({r.req_id: r.sim_output_len for r in reqs})
    adapter = {r.req_id: r.adapter for r in reqs}
    per_step, loads = [], [0]

    def obs(batch, outputs, t0, t1):
        per_step.append(len({adapter[x.req_id] for x in batch.seqs} - {None}))
        loads[0] += len(batch.lora_loads)
    done = offline.run_offline(s, ex, reqs, observer=obs)
    waits = sorted(r.admitted_at - r.arrival for r in done.values())
    end = max(r.finished_at for r in done.values())
    return {"name": name, "mean": statistics.mean(waits), "p99": waits[int(0.99 * (len(waits) - 1))],
            "max": waits[-1], "loads": loads[0], "per_step": statistics.mean(per_step), "steps": end}


def table(rows: list[dict], a) -> str:
    out = [f"{a.requests} requests, {a.adapters} adapters (Zipf), --max-loras {a.max_loras}, "
           f"--max-batch-size {a.batch}, one arrival every {1 / a.rate:g} steps; waits in steps "
           "(`python benchmarks/lora_policies.py`, simulated executor)", "",
           "| policy | mean wait | p99 wait | longest wait | adapter loads | adapters per step | steps to finish |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['name']} | {r['mean']:.1f} | {r['p99']:.0f} | {r['max']:.0f} | {r['loads']} | "
                   f"{r['per_step']:.1f} | {r['steps']:.0f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", type=int, default=100)
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rate", type=float, default=1.0, help="arrivals per step")
    a = ap.parse_args()
    print(table([run(n, kw, a) for n, kw in POLICIES.items()], a))   # docs/SCHEDULING.md quotes it


if __name__ == "__main__":
    main()
