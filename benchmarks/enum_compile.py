"""A large json_schema string enum: compile time and per-step mask cost, flat vs trie.

    PYTHONPATH=. python benchmarks/enum_compile.py [--sizes 1000 3000 4000 5000 20000] [--rounds 2] [--docs]

The schema is benchmarks/stall_attacks.py's enum row, {"type": "object", "properties": {"v": {"enum":
[N strings "value-{i}-of-the-list"]}}}, compiled by shepherd's GrammarCompiler (the server's grammar
worker and the engine core both use it):
- "flat": what xgrammar compiles from the schema (one alternation of N literals), i.e. the
  compiler with enum_trie_chars=sys.maxsize; main before the trie;
- "trie": the default, the same language with the enum as a trie (model/grammar.py, enum_trie_ebnf)
  when its values take ENUM_TRIE_CHARS characters or more; the "default" column says which of
  the two the default compiler picks for N.
Each timed compile uses strings no compile before it saw (the first letter changes, the length
does not), so neither shepherd's cache nor xgrammar's answers it. Mask cost: GrammarMasks.fill of
ten requests (the enum row's ten), each at a different token inside its value's string (where the
old enum row spent ~3 ms a row), median over --steps fills. Longest pause: of a thread waking every
1 ms while the compile runs (the engine core compiles in a thread beside its step: a pause there,
the GIL held, is a gap in every stream), the largest over the rounds. Prints a markdown table; --docs writes
it into docs/SERVING.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

from shepherd.bench.loadgen import exit_on_sigterm
from shepherd.model.grammar import ENUM_TRIE_CHARS, GrammarCompiler, GrammarMasks, encoded_vocab
from shepherd.model.loader import load_tokenizer
from shepherd.request import Request, SamplingParams

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _docs import footer, publish  # noqa: E402

ROWS = 10


def schema(n: int, first: str = "v") -> str:
    return json.dumps({"type": "object", "properties": {"v": {"enum": [f"{first}alue-{i}-of-the-list"
                                                                      for i in range(n)]}}})


def compile_s(compiler: GrammarCompiler, text: str) -> tuple[float, float]:
    """(seconds, the longest pause of a thread that wakes every 1 ms meanwhile): in the engine core
    the compile runs in a thread beside the step's, and a pause there is a pause of every stream."""
    stop, worst = threading.Event(), [0.0]

    def tick():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            worst[0], last = max(worst[0], now - last), now
    ticker = threading.Thread(target=tick)
    ticker.start()
    t0 = time.perf_counter()
    compiler.compile(("json_schema", text))
    took = time.perf_counter() - t0
    stop.set()
    ticker.join()
    return took, worst[0]


def fill_ms(tok, compiler: GrammarCompiler, n: int, steps: int) -> float:
    """Median ms of one GrammarMasks.fill over ROWS requests, each stopped inside its value's string."""
    masks = GrammarMasks(tok)
    masks.compiler = compiler
    spec = ("json_schema", schema(n))
    eos = tuple(tok.eos_token_ids)
    reqs = []
    for k in range(ROWS):
        head = tok.encode('{"v": "')
        value = tok.encode(f"value-{(k * 977) % n}-of-the-list")
        cut = 1 + k % (len(value) - 1)            # 1..len-1 tokens of the value: inside the string
        reqs.append(Request(req_id=f"r{k}", prompt_ids=[1], params=SamplingParams(temperature=0.0, grammar=spec),
                            eos_token_ids=eos, output_ids=head + value[:cut]))
    V = tok.vocab_size
    masks.fill(reqs, V)                           # matchers built and fed: untimed
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        masks.fill(reqs, V)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 3000, 4000, 5000, 20000])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--docs", action="store_true", help="write the table into docs/SERVING.md")
    a = ap.parse_args()
    exit_on_sigterm()
    tok = load_tokenizer(None)
    vocab, stops = encoded_vocab(tok, tok.vocab_size), tok.eos_token_ids
    flat = GrammarCompiler(vocab, stops, enum_trie_chars=sys.maxsize)
    trie = GrammarCompiler(vocab, stops, enum_trie_chars=1)
    firsts = iter("wxyzabcdefghijklmnopqrstu")
    rows = ["| values | characters | flat compile (s) | trie compile (s) | flat / trie | default | "
            f"mask fill, {ROWS} rows, flat | trie | longest pause beside the compile, flat | trie |",
            "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for n in a.sizes:
        times, pauses = {"flat": [], "trie": []}, {"flat": [], "trie": []}
        for r in range(a.rounds):
            for name, comp in (("flat", flat), ("trie", trie)) if r % 2 == 0 else (("trie", trie), ("flat", flat)):
                took, pause = compile_s(comp, schema(n, next(firsts) if r or name == "trie" else "v"))
                times[name].append(took)
                pauses[name].append(pause)
        f, t = statistics.median(times["flat"]), statistics.median(times["trie"])
        chars = sum(len(json.dumps(v)) for v in json.loads(schema(n))["properties"]["v"]["enum"])
        picks = "trie" if chars >= ENUM_TRIE_CHARS else "flat"
        mf, mt = fill_ms(tok, flat, n, a.steps), fill_ms(tok, trie, n, a.steps)
        rows.append(f"| {n:,} | {chars:,} | {', '.join(f'{x:.3f}' for x in times['flat'])} | "
                    f"{', '.join(f'{x:.3f}' for x in times['trie'])} | {f / t:.1f}x | {picks} | {mf:.2f} ms | {mt:.2f} ms | "
                    f"{max(pauses['flat']) * 1e3:.1f} ms | {max(pauses['trie']) * 1e3:.1f} ms |")
        print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n\n" + footer("python benchmarks/enum_compile.py " + " ".join(sys.argv[1:]),
                                             f", ENUM_TRIE_CHARS {ENUM_TRIE_CHARS:,}")
    publish(text, "SERVING.md", "enum-compile", a.docs)


if __name__ == "__main__":
    main()
