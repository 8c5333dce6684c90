"""Per-step cost of structured-output masks (xgrammar) at 1 and 64 streams, on this CPU.

    PYTHONPATH=. python benchmarks/grammar_mask_cost.py [--steps 60] [--write docs/SERVING.md]

Every stream carries a JSON schema (the kind a tool call or response_format brings). One
step = what the sampler hook does per step: advance each stream's matcher over its last
token, fill the stream's bitmask row, and apply the masks to the logits [S, V]; the
time of a free (unconstrained) argmax over the same logits is given beside it. Tokens are
either replayed from a valid object ("replay": what a model that writes
the object emits) or drawn from masked random logits ("random": odd but legal
states, a pessimistic case). Prints a markdown
table; --write replaces the table between the markers in the file.
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
from shepherd.request import Request, SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "city"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
                         "city": {"type": "string", "maxLength": 40}}}
BEGIN, END = "<!-- grammar-mask-cost:begin -->", "<!-- grammar-mask-cost:end -->"


class _TimedApply:
    """Wraps xgrammar's apply so the step splits into matcher work and the logits write."""

    def __init__(self, xgr):
        self.xgr, self.inner, self.spent = xgr, xgr.apply_token_bitmask_inplace, 0.0
        xgr.apply_token_bitmask_inplace = self

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        self.inner(*a, **kw)
        self.spent += time.perf_counter() - t0


DOC = {"name": "Ada Lovelace of London", "age": 36, "tags": ["math", "poetry", "engines"],
       "city": "London, England"}


def measure(tok, streams: int, steps: int, walk: str) -> dict:
    import xgrammar
    masks = GrammarMasks(tok)
    spec = ("json_schema", json.dumps(SCHEMA))
    reqs = [Request(req_id=f"r{i}", prompt_ids=[1], params=SamplingParams(temperature=0.0, grammar=spec),
                    eos_token_ids=tuple(tok.eos_token_ids)) for i in range(streams)]
    g = torch.Generator().manual_seed(0)
    logits0 = torch.randn(streams, tok.vocab_size, generator=g)
    masks.apply(logits0.clone(), reqs)            # compile and build matchers outside the timing
    timed = _TimedApply(xgrammar)
    doc = tok.encode(json.dumps(DOC, separators=(",", ":"))) + [tok.eos_token_ids[0]]
    for i, r in enumerate(reqs):                  # streams at different places in the object
        r.output_ids = doc[:(i * 3) % (len(doc) - 1)] if walk == "replay" else []
    masked_t, free_t, apply_t = [], [], []
    for _ in range(steps):
        logits = torch.randn(streams, tok.vocab_size, generator=g)
        t0 = time.perf_counter()
        free = logits.argmax(-1)
        t1 = time.perf_counter()
        timed.spent = 0.0
        masks.apply(logits, reqs)
        toks = logits.argmax(-1).tolist()
        t2 = time.perf_counter()
        if walk == "replay":                      # what a model writing a valid object would emit
            toks = [doc[len(r.output_ids) % len(doc)] for r in reqs]
        apply_t.append(timed.spent)
        free_t.append(t1 - t0)
        masked_t.append(t2 - t1 + (t1 - t0))
        del free
        for r, t in zip(reqs, toks):
            if t in r.eos_token_ids:              # a finished object starts over, like a new request
                r.output_ids = []
                masks.forget(r.req_id)
            else:
                r.output_ids.append(t)
    xgrammar.apply_token_bitmask_inplace = timed.inner
    med = statistics.median(masked_t)
    return {"walk": walk, "apply_ms": statistics.median(apply_t) * 1e3,"streams": streams, "step_ms": med * 1e3, "free_ms": statistics.median(free_t) * 1e3,
            "per_stream_us": med / streams * 1e6, "p90_ms": sorted(masked_t)[int(0.9 * len(masked_t))] * 1e3}


def table(rows: list[dict]) -> str:
    out = ["| tokens | streams | masked step (median) | p90 | per stream | of which: writing the mask into the logits "
           "| free argmax, same logits |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['walk']} | {r['streams']} | {r['step_ms']:.2f} ms | {r['p90_ms']:.2f} ms | "
                   f"{r['per_stream_us']:.0f} us | {r['apply_ms']:.2f} ms | {r['free_ms']:.2f} ms |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--write", default=None, help="markdown file with the begin/end markers")
    a = ap.parse_args()
    torch.set_num_threads(1)
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
