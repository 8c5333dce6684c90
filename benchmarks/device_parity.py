#!/usr/bin/env python
"""Greedy tokens of one model on two devices (cpu and cuda), and within each device alone vs batched.

Each of `--prompts` chat prompts is decoded greedily for `--tokens` tokens (EOS ignored, top-2
logprobs kept) through the real executor and scheduler (run_offline), once alone and once with all
prompts in flight together, on every device of `--devices`. Prints one row per prompt:

  * alone == batched on each device (batch invariance within a device; batch-invariant mode on);
  * the first position where the devices' greedy tokens part (alone runs), and the top-2 logprob gap
    at that position on each device: a gap of a few thousandths is a near-tie that two bf16 forwards
    summing in different orders may break either way, a large one is a bug;
  * |delta| of the first generated token's logprob between the devices (the prefill's numerics).

    python benchmarks/device_parity.py --model DIR --devices cpu,cuda --prompts 8 --tokens 32   # each device vs the last
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _openai_client import questions  # noqa: E402


def run(ex, prompts: list[list[int]], tokens: int, together: bool, tag: str) -> list[tuple[list[int], list]]:
    """(tokens, per-token logprob records) per prompt, served alone one after another or all at once."""
    from shepherd.config import SchedulerConfig
    from shepherd.engine.offline import run_offline
    from shepherd.request import Request, SamplingParams
    from shepherd.scheduler.scheduler import Scheduler

    lps: dict[str, list] = {}

    def observe(_batch, outputs, _t0, _t1):
        for o in outputs:
            lps.setdefault(o.req_id, []).extend(o.logprobs)

    def reqs_of(idx):
        return [Request(f"{tag}-{i}", list(prompts[i]), SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                        ignore_eos=True, logprobs=2),
                        eos_token_ids=ex.eos_token_ids) for i in idx]
    cfg = SchedulerConfig(max_batch_size=max(64, len(prompts)))
    groups = [list(range(len(prompts)))] if together else [[i] for i in range(len(prompts))]
    out = {}
    for idx in groups:
        sched = Scheduler(cfg, host_kv_capacity=ex.host_kv_capacity, max_model_len=ex.max_model_len)
        for r in run_offline(sched, ex, reqs_of(idx), observer=observe).values():
            out[r.req_id] = r.output_ids
    return [(out[f"{tag}-{i}"], lps.get(f"{tag}-{i}", [])) for i in range(len(prompts))]


def gap(lp) -> float:
    """The top-2 logprob gap of one position's record (inf where only one alternative came back)."""
    return lp.top[0][1] - lp.top[1][1] if len(lp.top) > 1 else float("inf")


def first_diff(a: list[int], b: list[int]):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--devices", default="cpu,cuda", help="DEVICE[/KERNELS], comma list: cpu,cuda or cpu/fused,cpu/torch")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args(argv)
    from shepherd.config import EngineConfig
    from shepherd.engine.torch_executor import TorchExecutor
    from shepherd.model.loader import load_tokenizer

    tok = load_tokenizer(args.model)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True),
                          add_special_tokens=False) for q in questions(args.prompts)]
    devices = [d for d in args.devices.split(",") if d]
    res = {}
    for d in devices:
        t0 = time.perf_counter()
        dev, _, kernels = d.partition("/")
        ex = TorchExecutor(EngineConfig(model=args.model, dtype=args.dtype, device=dev, batch_invariant=True,
                                        kernels=kernels or "auto",
                                        max_total_tokens=len(prompts) * (max(map(len, prompts)) + args.tokens) + 1024))
        res[d] = (run(ex, prompts, args.tokens, False, f"{d}-alone"), run(ex, prompts, args.tokens, True, f"{d}-batch"))
        print(f"{d}: kernels {ex.kernels}, {ex.kv_capacity} KV tokens, {time.perf_counter() - t0:.1f} s", flush=True)
        del ex
    ref = devices[-1]                    # every other device is compared with the last one
    others = devices[:-1]
    print(f"\n{len(prompts)} chat prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.tokens} greedy tokens each, {args.dtype}, batch-invariant mode")
    head = ["prompt"] + [f"{d} alone==batched" for d in devices]
    for d in others:
        head += [f"{d} vs {ref}: first differing position (top-2 gap there {d}/{ref})", "|dlogprob| token 0"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    same = {d: 0 for d in devices}
    agree = {d: 0 for d in others}
    for i in range(len(prompts)):
        row = [str(i)]
        for d in devices:
            (ta, _), (tb, _) = res[d][0][i], res[d][1][i]
            same[d] += ta == tb
            row.append("yes" if ta == tb else f"NO (from {first_diff(ta, tb)})")
        (xb, lb) = res[ref][0][i]
        for d in others:
            (xa, la) = res[d][0][i]
            k = first_diff(xa, xb)
            agree[d] += k is None
            row.append("equal" if k is None else f"{k} ({gap(la[k]):.4f}/{gap(lb[k]):.4f})")
            row.append(f"{abs(la[0].logprob - lb[0].logprob):.4f}" if la and lb else "-")
        print("| " + " | ".join(row) + " |")
    print("\n" + ", ".join(f"{d}: alone==batched {same[d]}/{len(prompts)}" for d in devices)
          + "".join(f"; {d} == {ref} on {agree[d]}/{len(prompts)} prompts over {args.tokens} tokens" for d in others))


if __name__ == "__main__":
    main()
