#!/usr/bin/env python
"""Quality of the int8 / int4 / w8a8 paths against the unquantised (bf16) forward:
perplexity on a fixed text (teacher-forced, one prefill, all rows' logits) and greedy
agreement with bf16 on the 8 parity prompts of tests/test_model_parity.py.

Writes a table into docs/MODEL.md between <!-- quant:start --> and <!-- quant:end -->.

    python benchmarks/quant_quality.py
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

START, END = "<!-- quant:start -->", "<!-- quant:end -->"

# a fixed English text (public-domain style prose written for this test), ~400 tokens
TEXT = (
    "The river town woke before the sun. Bakers lit their ovens, fishermen checked their nets, and the first "
    "ferry of the day pushed away from the wooden pier with a low horn. Children walked to school along the "
    "embankment, counting the boats that passed and arguing about which one was the fastest. In the market "
    "square, farmers unloaded crates of apples, cabbages and potatoes, while the clock on the town hall "
    "struck seven. The mayor, an old man who had lived in the town all his life, liked to say that nothing "
    "important ever happened there, and that this was exactly why people were happy. Yet the town had a "
    "long history. Two hundred years earlier, engineers had built a stone bridge across the river, and "
    "merchants had used it to carry wool, salt and timber to the cities in the south. When the railway "
    "arrived, the bridge lost its importance, and many families moved away to find work in the factories. "
    "Those who stayed opened small shops, repaired boats, and grew vegetables on the fertile land near the "
    "water. Today, visitors come in the summer to walk along the river, to eat fresh fish in the small "
    "restaurants, and to photograph the old bridge at sunset. Scientists from the university also visit, "
    "because the river is home to rare birds and insects that live nowhere else in the region. They measure "
    "the water, count the birds, and write reports that nobody in the town reads, but everyone is proud of "
    "them anyway. In the evening, when the last ferry returns, the lights come on in the windows, and the "
    "town goes quiet again, waiting for another ordinary day."
)


def perplexity(ex, ids: list[int]) -> float:
    """exp(mean NLL) of ids[1:] given the prefix, from one prefill of the whole text."""
    import torch
    from shepherd.request import SamplingParams
    from shepherd.step import NewRequest, ScheduledSeq
    ex.add(NewRequest("ppl", list(ids), SamplingParams(max_tokens=1, temperature=0.0)))
    with torch.inference_mode():
        inp, _ = ex.build_input([ScheduledSeq("ppl", list(ids), 0, True, 0, list(range(len(ids))))])
        inp.logits_index = None
        logits = ex.model.forward(inp, ex.kv_pool)[: len(ids) - 1]
        nll = torch.nn.functional.cross_entropy(logits.float().cpu(), torch.tensor(ids[1:]))
    return math.exp(float(nll))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--modes", default="none,int8,int4,w8a8")
    ap.add_argument("--out", default=str(ROOT / "docs" / "MODEL.md"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    from shepherd.config import EngineConfig
    from shepherd.engine.torch_executor import TorchExecutor
    from shepherd.model.loader import default_model_path
    model = args.model or default_model_path()
    rows = []
    base = None
    for q in args.modes.split(","):
        ex = TorchExecutor(EngineConfig(model=model, dtype="bfloat16", quantization=q, max_total_tokens=2048))
        ppl = perplexity(ex, ex.tokenizer.encode(TEXT))
        base = base or ppl
        rows.append(f"| {q} ({ex.quantization}) | {ppl:.3f} | {100 * (ppl / base - 1):+.2f} % |")
        print(rows[-1], flush=True)
    section = "\n".join([
        f"Perplexity of `benchmarks/quant_quality.py`'s fixed text ({len(ex.tokenizer.encode(TEXT))} tokens), "
        f"model {Path(model).name}, bfloat16 activations; measured {time.strftime('%Y-%m-%d', time.gmtime())} "
        "with `python benchmarks/quant_quality.py`.", "",
        "| weights | perplexity | vs none |", "|---|---|---|", *rows])
    if not args.no_write:
        p = Path(args.out)
        text = p.read_text()
        block = f"{START}\n{section}\n{END}"
        if START in text and END in text:
            text = text[:text.index(START)] + block + text[text.index(END) + len(END):]
        else:
            text = text.rstrip("\n") + "\n\n" + block + "\n"
        p.write_text(text)


if __name__ == "__main__":
    main()
