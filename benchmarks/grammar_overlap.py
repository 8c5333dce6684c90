#!/usr/bin/env python
"""Grammar masks filled beside the forward or after it, on the engine itself (no HTTP).

    PYTHONPATH=. python benchmarks/grammar_overlap.py [--streams 64] [--tokens 64] [--rounds 2] [--write]

One TorchExecutor (the real model, bf16, the engine's threads) decodes `streams` chat prompts
greedily for `tokens` tokens each (EOS ignored) through run_offline, three ways, alternated
round by round (the order rotates): `free` (no grammar), `json, after` (every request with
benchmarks/_openai_client's json_schema, masks filled in the sampler after the forward: the
default) and `json, beside` (the same, masks filled in the grammar hook's thread while the
forward runs: SHEPHERD_GRAMMAR_OVERLAP=1). Prints output tok/s per way (median over
the rounds) and each json way over free; --write puts the table into docs/BENCHMARKS.md (block
`grammar-overlap`). The first round's compile of the schema is outside the timing (a warm-up).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _docs import write_block  # noqa: E402
from _openai_client import STORY_SCHEMA, questions  # noqa: E402
from grammar_served import cpu_name  # noqa: E402
from shepherd.config import EngineConfig, SchedulerConfig  # noqa: E402
from shepherd.engine.offline import run_offline  # noqa: E402
from shepherd.engine.torch_executor import TorchExecutor  # noqa: E402
from shepherd.request import Request, SamplingParams  # noqa: E402
from shepherd.scheduler.scheduler import Scheduler  # noqa: E402

WAYS = ("free", "json, after", "json, beside")
SPEC = ("json_schema", json.dumps(STORY_SCHEMA))


def run(ex: TorchExecutor, prompts: list[list[int]], way: str, tokens: int, tag: str) -> float:
    ex.masks_beside_forward = way == "json, beside"
    sched = Scheduler(SchedulerConfig(max_total_tokens=ex.kv_capacity, max_batch_size=len(prompts)),
                      host_kv_capacity=ex.host_kv_capacity, max_model_len=ex.max_model_len)
    grammar = None if way == "free" else SPEC
    reqs = [Request(f"{tag}-{i}", list(p), SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                                          grammar=grammar), eos_token_ids=ex.eos_token_ids)
            for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    run_offline(sched, ex, reqs)
    wall = time.perf_counter() - t0
    return sum(len(r.output_ids) for r in reqs) / wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    ex = TorchExecutor(EngineConfig(max_total_tokens=max(8192, a.streams * (a.tokens + 128))))
    tok = ex.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions(a.streams)]
    run(ex, prompts[:2], "json, after", 4, "warm")          # compile the schema, build the kernels: untimed
    got: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(a.rounds):
        order = WAYS[r % 3:] + WAYS[: r % 3]
        for w in order:
            got[w].append(run(ex, prompts, w, a.tokens, f"r{r}-{WAYS.index(w)}"))
        print(f"[grammar_overlap] round {r + 1}: " + ", ".join(f"{w} {got[w][-1]:.1f}" for w in WAYS),
              file=sys.stderr, flush=True)
    med = {w: statistics.median(v) for w, v in got.items()}
    cmd = "python benchmarks/grammar_overlap.py " + " ".join(sys.argv[1:])
    out = [f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {cpu_name()}, the engine without "
           f"HTTP ({a.streams} streams, {a.tokens} tokens each, greedy); `{cmd}`.", "",
           "| way | output tok/s (median) | rounds | / free |", "|---|---:|---|---:|"]
    for w in WAYS:
        out.append(f"| {w} | {med[w]:.1f} | {' / '.join(f'{x:.1f}' for x in got[w])} | {med[w] / med['free']:.3f} |")
    md = "\n".join(out)
    print(md)
    if a.write:
        print(f"wrote {write_block('BENCHMARKS.md', 'grammar-overlap', md)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
