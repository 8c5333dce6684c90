"""Per-step cost of structured-output masks (xgrammar) at 1 and 64 streams, on this CPU.

    PYTHONPATH=. python benchmarks/grammar_mask_cost.py [--steps 60] [--write docs/SERVING.md]

Every stream carries a JSON schema (the kind a tool call or response_format brings). One
step = what the engine does with a step's logits [S, V]: `Sampler.sample` (greedy), which
advances each stream's matcher over its last token, builds the streams' masks and picks
the masked argmax; beside it the same call on the same logits for S unconstrained streams.
Their difference is what the grammar costs a step. Only `Sampler.sample(logits, reqs)` is
called, so the script times any tree's sampler (PYTHONPATH=that tree): before and after a
change, on the same machine. Tokens are either replayed from a valid object ("replay": what
a model that writes the object emits) or the masked argmax of random logits ("random": odd
but legal states, a pessimistic case). Prints a markdown table; --write replaces the table
between the markers in the file.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import torch

from shepherd.model.grammar import GrammarMasks
from shepherd.model.loader import load_tokenizer
from shepherd.model.sampler import Sampler
from shepherd.request import Request, SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "city"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
                         "city": {"type": "string", "maxLength": 40}}}
BEGIN, END = "<!-- grammar-mask-cost:begin -->", "<!-- grammar-mask-cost:end -->"


DOC = {"name": "Ada Lovelace of London", "age": 36, "tags": ["math", "poetry", "engines"],
       "city": "London, England"}


def measure(tok, streams: int, steps: int, walk: str) -> dict:
    sampler = Sampler(seed=0)
    sampler.grammar = GrammarMasks(tok)
    spec = ("json_schema", json.dumps(SCHEMA))
    eos = tuple(tok.eos_token_ids)
    reqs = [Request(req_id=f"r{i}", prompt_ids=[1], params=SamplingParams(temperature=0.0, grammar=spec),
                    eos_token_ids=eos) for i in range(streams)]
    free = [Request(req_id=f"f{i}", prompt_ids=[1], params=SamplingParams(temperature=0.0), eos_token_ids=eos)
            for i in range(streams)]
    g = torch.Generator().manual_seed(0)
    sampler.sample(torch.randn(streams, tok.vocab_size, generator=g), reqs)   # compile, build matchers: untimed
    doc = tok.encode(json.dumps(DOC, separators=(",", ":"))) + [tok.eos_token_ids[0]]
    for i, r in enumerate(reqs):                  # streams at different places in the object
        r.output_ids = doc[:(i * 3) % (len(doc) - 1)] if walk == "replay" else []
    masked_t, free_t = [], []
    for _ in range(steps):
        logits = torch.randn(streams, tok.vocab_size, generator=g)
        t0 = time.perf_counter()
        sampler.sample(logits, free)
        t1 = time.perf_counter()
        toks, _ = sampler.sample(logits, reqs)
        t2 = time.perf_counter()
        if walk == "replay":                      # what a model writing a valid object would emit
            toks = [doc[len(r.output_ids) % len(doc)] for r in reqs]
        free_t.append(t1 - t0)
        masked_t.append(t2 - t1)
        for r, t in zip(reqs, toks):
            if t in r.eos_token_ids:              # a finished object starts over, like a new request
                r.output_ids = []
                sampler.grammar.forget(r.req_id)
            else:
                r.output_ids.append(t)
    med = statistics.median(masked_t)
    free_med = statistics.median(free_t)
    return {"walk": walk, "streams": streams, "step_ms": med * 1e3, "free_ms": free_med * 1e3,
            "grammar_ms": (med - free_med) * 1e3, "per_stream_us": (med - free_med) / streams * 1e6,
            "p90_ms": sorted(masked_t)[int(0.9 * len(masked_t))] * 1e3}


def table(rows: list[dict]) -> str:
    out = ["| tokens | streams | constrained sample (median) | p90 | unconstrained sample, same logits "
           "| the grammar's cost a step | per stream |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['walk']} | {r['streams']} | {r['step_ms']:.2f} ms | {r['p90_ms']:.2f} ms | "
                   f"{r['free_ms']:.2f} ms | {r['grammar_ms']:.2f} ms | {r['per_stream_us']:.0f} us |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--write", default=None, help="markdown file with the begin/end markers")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's, as the engine)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    tok = load_tokenizer(None)
    md = table([measure(tok, s, a.steps, w) for w in ("replay", "random") for s in (1, 64)])
    print(md)
    if a.write:
        text = open(a.write, encoding="utf-8").read()
        block = f"{BEGIN}\n{md}\n{END}"
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
        open(a.write, "w", encoding="utf-8").write(text)


if __name__ == "__main__":
    main()
