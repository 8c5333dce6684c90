"""Grammar masks, logit constraints, tool-call parsing and the body guard, without a model:
the real tokenizer and xgrammar, random logits standing in for the model."""
from __future__ import annotations

import json
import sys

import jsonschema
import pytest
import torch

from shepherd.model.constraints import bias_tensors, apply_constraints
from shepherd.model.grammar import (ENUM_TRIE_CHARS, GrammarCompiler, GrammarError, GrammarMasks, check_schema,
                                    choice_ebnf, encoded_vocab, enum_trie_ebnf, large_string_enum, trie_rules)
from shepherd.model.loader import load_tokenizer
from shepherd.model.sampler import Sampler, SamplingState
from shepherd.request import SamplingParams
from shepherd.step import ExecutorFull, NewRequest
from shepherd.server import tools
from shepherd.server.guard import Refusal, json_depth, parse_body
from shepherd.server.protocol import ChatCompletionRequest
from shepherd.server.tool_stream import ToolCallScanner

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"kind": {"enum": ["a", "b"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                               "maxItems": 3}},
     "required": ["kind", "tags"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def _req(rid, tok, **kw):
    """The sampler's record of a request (what it keeps from the step contract)."""
    return SamplingState(NewRequest(req_id=rid, prompt_ids=[1], params=SamplingParams(temperature=0.0, **kw),
                                    eos_token_ids=tuple(tok.eos_token_ids)))


def _run(sampler, reqs, vocab, steps, seed=0):
    """Greedy decoding over random logits until every request emitted EOS (or `steps`)."""
    g = torch.Generator().manual_seed(seed)
    live = list(reqs)
    for _ in range(steps):
        if not any(r.params.grammar is not None for r in live):
            break
        logits = torch.randn(len(live), vocab, generator=g) * 5
        toks, _ = sampler.sample(logits, live)
        for r, t in zip(live, toks):
            r.output_ids.append(t)
        live = [r for r in live if r.output_ids[-1] not in r.eos_token_ids]
    return reqs


def test_json_schema_masks_make_random_logits_valid_beside_a_free_request(tok):
    sampler = Sampler()
    sampler.grammar = GrammarMasks(tok)
    for k, schema in enumerate(SCHEMAS):
        cons = _req(f"c{k}", tok, grammar=("json_schema", json.dumps(schema)))
        free = _req(f"f{k}", tok)
        _run(sampler, [cons, free], tok.vocab_size, 300, seed=k)
        assert cons.output_ids[-1] in tok.eos_token_ids
        jsonschema.validate(json.loads(tok.decode(cons.output_ids[:-1])), schema)
        # the free row was never masked: random text, not JSON
        assert not tok.decode(free.output_ids).lstrip().startswith(("{", "["))


@pytest.mark.parametrize("spec,check", [
    (("regex", r"[a-c]{3}-\d\d"), lambda s: len(s) == 6 and s[3] == "-" and s[4:].isdigit()),
    (("choice", json.dumps(["yes", "no", "maybe"])), lambda s: s in ("yes", "no", "maybe")),
    (("ebnf", 'root ::= "x" ("y" | "z")'), lambda s: s in ("xy", "xz")),
    (("json_object", ""), lambda s: s.startswith('{"')),   # random logits never close a string
])
def test_regex_choice_ebnf_json_object(tok, spec, check):
    sampler = Sampler()
    sampler.grammar = GrammarMasks(tok)
    r = _run(sampler, [_req("r", tok, grammar=spec)], tok.vocab_size, 40)[0]
    out = r.output_ids[:-1] if r.output_ids[-1] in tok.eos_token_ids else r.output_ids
    assert check(tok.decode(out)), tok.decode(r.output_ids)


def test_matcher_state_is_rebuilt_from_tokens_after_rollback_and_on_a_fresh_executor(tok):
    spec = ("json_schema", json.dumps(SCHEMAS[0]))
    a = GrammarMasks(tok)
    r = _run_partial = _req("p", tok, grammar=spec)
    sampler = Sampler()
    sampler.grammar = a
    _run(sampler, [r], tok.vocab_size, 6)
    prefix = list(r.output_ids)
    logits = torch.randn(1, tok.vocab_size)
    masked_a = logits.clone()
    a.apply(masked_a, [r])
    # a fresh hook (a restarted executor) sees only the tokens and masks the same way
    b = GrammarMasks(tok)
    masked_b = logits.clone()
    b.apply(masked_b, [r])
    assert torch.equal(torch.isinf(masked_a), torch.isinf(masked_b))
    # recompute preemption: tokens rolled back, then regenerated
    r.output_ids = prefix[:2]
    rolled = logits.clone()
    a.apply(rolled, [r])
    fresh = logits.clone()
    GrammarMasks(tok).apply(fresh, [_run_partial])
    assert torch.equal(torch.isinf(rolled), torch.isinf(fresh))


def _accepts(compiled, tok, text: str) -> bool:
    """A matcher of `compiled` takes `text`'s tokens and then a stop token (the text is complete)."""
    import xgrammar as xgr
    m = xgr.GrammarMatcher(compiled)
    return all(m.accept_token(t) for t in tok.encode(text)) and m.accept_token(tok.eos_token_ids[0])


def test_choice_trie_accepts_exactly_the_choices(tok):
    # the emoji: a JSON surrogate pair in the EBNF (json.dumps' default) is read by xgrammar as two
    # code points, and the choice could never be written
    choices = ["yes", "no", "yesterday", "n", "caf\u00e9 \"q\"", "\U0001F600 ok", "yes sir"] + [f"item {i}" for i in range(300)]
    ebnf = choice_ebnf(choices)
    assert ebnf.count("::=") < 120                 # shared prefixes are factored, not 307 alternatives
    compiled = GrammarCompiler.for_tokenizer(tok).compile(("choice", json.dumps(choices)))
    for text, ok in [(c, True) for c in choices[:9]] + [("ye", False), ("yess", False), ("item 3000", False)]:
        assert _accepts(compiled, tok, text) == ok, text


def test_a_trie_of_5000_values_allocates_no_object_per_character():
    """The engine core builds the trie in its compile thread, beside the step's thread: a trie of one
    dict per character (13.5 MB for the enum row's 5,000 values) made Python's collector hold the GIL
    ~100 ms, a gap in every stream (docs/SERVING.md, "Large enums")."""
    import tracemalloc
    values = [f'"value-{i}-of-the-list"' for i in range(5000)]
    tracemalloc.start()
    try:
        rules = trie_rules(values, "root", "t")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(rules) == 501 and peak < 3_000_000, peak


# values a trie must keep apart: prefixes of each other ("a", "ab", "abc"), JSON escapes (quote,
# backslash, tab, DEL), non-ASCII (an emoji, U+2028), the empty string, values holding the text
# between two literals of xgrammar's EBNF (`") | ("`); then enough plain values
# for the enum to pass ENUM_TRIE_CHARS (and stay under the size where xgrammar's flat alternation
# turns slow, so the flat reference compiles fast here)
TRICKY = ["a", "ab", "abc", "caf\u00e9 \"q\"", "back\\slash", "tab\there", "del\x7f", "\U0001F600", "\u2028",
          "x/y", "it's", "", 'q") | ("r', "\\\") | (\""]
ENUM = TRICKY + [f"value-{i}-of-the-list" for i in range(2400)]


def test_large_string_enum_compiles_as_a_trie_that_accepts_exactly_the_enum(tok):
    """Issue 31's enum row: a 5,000-value enum took 3.3-6.5 s to compile as xgrammar's one flat
    alternation, at the server's 5 s budget. A large string enum is compiled as a trie of the same
    JSON-encoded literals, wherever it sits (a property, $defs through $ref, array items, anyOf),
    and accepts exactly what the flat one accepts."""
    schema = {"type": "object", "additionalProperties": False, "required": ["v"], "$defs": {"E": {"enum": ENUM}},
              "properties": {"v": {"enum": ENUM}, "w": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/E"}},
                             "x": {"anyOf": [{"enum": ENUM}, {"type": "integer"}]}}}
    assert sum(len(json.dumps(v)) for v in ENUM) >= ENUM_TRIE_CHARS
    text = json.dumps(schema)
    ebnf = enum_trie_ebnf(text)
    # no rule is the 2,412-way alternation any more: each trie node branches a few ways
    assert ebnf is not None and max(line.count(" | ") for line in ebnf.splitlines()) < 40
    spec = ("json_schema", text)
    trie = GrammarCompiler.for_tokenizer(tok).compile(spec)
    flat = GrammarCompiler(encoded_vocab(tok, tok.vocab_size), tok.eos_token_ids, enum_trie_chars=sys.maxsize).compile(spec)
    assert "_trie" in str(trie.grammar) and "_trie" not in str(flat.grammar)

    def obj(**kw):       # as xgrammar writes JSON: non-ASCII raw, DEL escaped
        return json.dumps(kw, ensure_ascii=False, separators=(", ", ": ")).replace("\x7f", "\\u007f")
    members = TRICKY + ENUM[len(TRICKY)::173]
    cases = [(obj(v=v), True) for v in members] + [
        (obj(v="a", w=["ab", "\U0001F600"], x="abc"), True),
        (obj(v="a", x=12), True),
        (obj(v="value-99999-of-the-list"), False),           # not a member
        (obj(v="value-12-of-the"), False),                   # a member's prefix that is not a member
        (obj(v="abcd"), False), (obj(v="ab "), False),       # a member and more
        (obj(v="a", w=["abx"]), False), (obj(v="a", x="value-1"), False),
        ('{"v": "\\u0061"}', False),                        # "a" spelled with an escape: not how JSON encodes it
        ('{"v": "caf\u00e9 "q""}', False),                   # the quote not escaped
        ('{"v": "tab\there"}', False),                       # a raw tab: JSON escapes it
    ]
    for case, ok in cases:
        assert (_accepts(trie, tok, case), _accepts(flat, tok, case)) == (ok, ok), case


def test_enums_left_to_xgrammar_small_or_not_all_strings(tok):
    """A small enum, or one with a value that is not a string, is compiled from the schema as before."""
    mixed = {"type": "object", "properties": {"v": {"enum": ENUM + [7]}}}
    assert not large_string_enum(mixed) and enum_trie_ebnf(json.dumps(mixed)) is None
    assert not large_string_enum(SCHEMAS[2]) and large_string_enum({"items": {"enum": ENUM}})
    assert not large_string_enum({"default": {"enum": ENUM}})        # data, not a schema
    compiler = GrammarCompiler.for_tokenizer(tok)
    assert "_trie" not in str(compiler.compile(("json_schema", json.dumps(SCHEMAS[2]))).grammar)


def test_the_compiled_grammars_a_compiler_holds_are_bounded_in_bytes(tok):
    """A client sending one distinct large schema after another must not grow the server's memory
    without bound: xgrammar's own cache, unbounded by default, held 70.8 MB after three distinct
    5,001-value enums. Ours keeps at most cache_bytes (the newest always), xgrammar's holds no
    large spec."""
    def spec(i):
        return ("json_schema", json.dumps({"type": "object", "properties": {
            f"v{i}": {"enum": [f"value-{k}-of-the-list" for k in range(1000)] + [0]}}}))
    vocab = encoded_vocab(tok, tok.vocab_size)
    one = GrammarCompiler(vocab, tok.eos_token_ids).compile(spec(0)).memory_size_bytes
    limit = int(2.5 * one)
    compiler = GrammarCompiler(vocab, tok.eos_token_ids, cache_bytes=limit)
    for i in range(6):
        compiler.compile(spec(i))
        assert compiler.cache_bytes <= limit
    assert compiler.get(spec(5)) is not None and compiler.get(spec(4)) is not None and compiler.get(spec(0)) is None
    assert compiler.compile(spec(5)) is compiler.compile(spec(5))


def test_the_engines_reuse_cache_is_within_max_grammar_memory(tok):
    """--max-grammar-memory bounds what requests hold; the engine's cache of compiled grammars for
    reuse is kept within it too (it was CACHE_BYTES, 256 MB, whatever the flag said), so one client
    cycling distinct specs leaves at most the flag's bytes cached beside what is held."""
    def spec(i):
        return ("json_schema", json.dumps({"type": "object", "properties": {
            f"v{i}": {"enum": [f"value-{k}-of-the-list" for k in range(1000)] + [0]}}}))
    one = GrammarCompiler(encoded_vocab(tok, tok.vocab_size), tok.eos_token_ids).compile(spec(0)).memory_size_bytes
    bound = int(2.5 * one)
    masks = GrammarMasks(tok, max_held_bytes=bound)
    for i in range(6):
        while not masks.prepare(spec(i)):       # compiled in the background thread, held by nobody
            masks._pending[spec(i)].result()
        assert masks.compiler.cache_bytes <= bound
    assert masks.compiler.get(spec(5)) is not None and masks.compiler.get(spec(0)) is None
    assert masks.held_bytes == 0


def test_requests_of_a_held_spec_share_it_when_the_cache_has_let_it_go(tok):
    """Under a bound that small the reuse cache keeps one grammar; a second request of a spec that
    a running request holds still shares that grammar (it was compiled again, counted twice and
    refused with 429), while another spec is refused."""
    masks = GrammarMasks(tok, max_held_bytes=1)

    def ready(spec, rid):
        while not masks.prepare(spec, rid):
            masks._pending[spec].result()
    held, other = ("regex", "[a-z]+"), ("regex", "[0-9]+")
    ready(held, "a")
    size = masks.held_bytes
    with pytest.raises(ExecutorFull):
        ready(other, "b")                           # compiled, refused; the cache now keeps it alone
    assert masks.compiler.get(held) is None
    ready(held, "c")
    assert masks.held_bytes == size and masks._held["c"] is masks._held["a"]
    masks.forget("a"), masks.forget("c")
    assert masks.held_bytes == 0
    ready(other, "d")


def test_a_prepared_grammar_evicted_from_the_cache_is_never_compiled_in_a_step(tok):
    """prepare() compiles off the step; the request's first mask and its matcher's rebuild after
    a rollback come later, inside steps, after other grammars may have pushed its spec out of the
    compiler's cache (here a cache of one grammar). They use the grammar held for the request."""
    masks = GrammarMasks(tok)
    masks.compiler = GrammarCompiler(encoded_vocab(tok, tok.vocab_size), tok.eos_token_ids, cache_size=1)
    compiles = []
    real = masks.compiler._compile
    masks.compiler._compile = lambda *spec: compiles.append(spec) or real(*spec)

    def ready(spec, rid):
        if not masks.prepare(spec, rid):        # the compile started in the background thread
            masks._pending[spec].result()
            assert masks.prepare(spec, rid)

    a, b = ("regex", r"[a-c]{3}-\d\d"), ("json_schema", json.dumps(SCHEMAS[0]))
    ready(a, "ra")
    ready(b, "rb")                  # evicts a from the cache
    assert masks.compiler.get(a) is None and len(compiles) == 2
    ra = _req("ra", tok, grammar=a)
    sampler = Sampler()
    sampler.grammar = masks
    _run(sampler, [ra], tok.vocab_size, 4)
    ra.output_ids = ra.output_ids[:1]                   # rolled back (recompute preemption)
    logits = torch.randn(1, tok.vocab_size)
    masks.apply(logits, [ra])
    assert len(compiles) == 2, compiles                 # neither the first mask nor the rebuild compiled
    assert torch.isinf(logits).sum() > 0
    masks.forget("ra")
    masks.forget("rb")
    assert not masks._held


def test_the_grammars_requests_hold_are_bounded_in_bytes_each_distinct_one_once(tok):
    """A client's distinct large grammars, each held while its request lives, must not fill the
    memory (a 113 KB guided_choice of random strings compiles to ~40 MB): past max_held_bytes the
    next distinct grammar is refused as overload (ExecutorFull: 429), while requests of a grammar
    already held share it, and a grammar given back makes room."""
    a, b = ("regex", r"[a-c]{3}-\d\d"), ("json_schema", json.dumps(SCHEMAS[0]))
    compiler = GrammarCompiler(encoded_vocab(tok, tok.vocab_size), tok.eos_token_ids)
    size_a, size_b = compiler.compile(a).memory_size_bytes, compiler.compile(b).memory_size_bytes
    masks = GrammarMasks(tok, max_held_bytes=size_a + size_b - 1)
    masks.compiler = compiler

    assert masks.prepare(a, "r1") and masks.prepare(a, "r2") and masks.held_bytes == size_a   # held once
    with pytest.raises(ExecutorFull, match="--max-grammar-memory"):
        masks.prepare(b, "r3")
    masks.forget("r1")
    with pytest.raises(ExecutorFull):
        masks.prepare(b, "r3")             # r2 still holds a
    masks.forget("r2")
    assert masks.held_bytes == 0 and masks.prepare(b, "r3") and masks.held_bytes == size_b
    masks.forget("r3")
    masks.forget("r3")                     # a second forget (batch.finished after the core's drop) is a no-op
    assert masks.held_bytes == 0 and not masks._held
    one = GrammarMasks(tok, max_held_bytes=1)      # the first grammar is taken, however large
    one.compiler = compiler
    assert one.prepare(b, "r4") and one.held_bytes == size_b
    with pytest.raises(ExecutorFull):
        one.prepare(a, "r5")


def test_grammar_check_budgets_and_cached_verdicts(tok):
    """Over the size budget: refused without compiling. Over the time budget: refused after it, and
    at once the next time (the verdict is cached); a good spec compiles in the worker process."""
    import asyncio
    import time

    from shepherd.server.common import APIError
    from shepherd.server.grammar_check import GrammarCheck
    from test_stall import SLOW_REGEX
    slow = ("regex", SLOW_REGEX)                 # seconds to compile with any xgrammar tried

    async def main():
        gc = GrammarCheck(tok, timeout=0.5, max_bytes=150_000)
        try:
            with pytest.raises(APIError, match="--max-grammar-bytes"):
                await gc.check(("choice", json.dumps([f"c{i}" for i in range(40000)])), "p")
            await gc.check(("regex", "[a-c]{3}"), "p")                 # starts the worker, compiles
            with pytest.raises(APIError, match="'not'"):
                await gc.check(("json_schema", json.dumps({"not": {}})), "p")
            t0 = time.perf_counter()
            with pytest.raises(APIError, match="--grammar-timeout"):
                await gc.check(slow, "p")
            assert time.perf_counter() - t0 < 5
            t0 = time.perf_counter()
            with pytest.raises(APIError, match="--grammar-timeout"):
                await gc.check(slow, "p")
            assert time.perf_counter() - t0 < 0.05
            await gc.check(("regex", "[x-z]{2}"), "p")                 # a fresh worker after the kill
        finally:
            gc.stop()
    asyncio.run(main())


def test_grammar_check_sends_a_spec_larger_than_the_socket_buffer_under_uvloop(tok):
    """uvloop makes the worker's pipe non-blocking; a spec larger than the socket buffer (~210 KB) goes
    out in pieces from the loop (engine/pipe_io.py) and its verdict comes back whole."""
    import asyncio

    import uvloop

    from shepherd.server.grammar_check import GrammarCheck
    big = ("json_schema", json.dumps({"type": "object", "description": "d" * 400_000,
                                      "properties": {"a": {"type": "integer"}}}))

    async def main():
        gc = GrammarCheck(tok, timeout=60, max_bytes=1 << 20)
        try:
            assert await gc.verdict(big) is None
            await gc.check(("regex", "[a-c]{3}"), "p")         # the same worker, the next message
        finally:
            gc.stop()
    uvloop.run(main())


def test_unsupported_schema_constructs_are_named(tok):
    with pytest.raises(GrammarError, match="'not'"):
        check_schema({"type": "object", "properties": {"a": {"not": {"type": "string"}}}})
    with pytest.raises(GrammarError, match=r"\$ref"):
        check_schema({"$ref": "http://example.com/s.json"})
    check_schema({"type": "object", "properties": {"not": {"type": "string"}}})   # a property named "not"
    c = GrammarCompiler.for_tokenizer(tok)
    with pytest.raises(GrammarError, match="banana"):
        c.compile(("json_schema", '{"type": "banana"}'))
    with pytest.raises(GrammarError):
        c.compile(("regex", "[a-"))


def test_logit_bias_and_min_tokens(tok):
    eos = tok.eos_token_ids[0]
    logits = torch.zeros(2, tok.vocab_size)
    logits[:, eos] = 10.0
    r1 = _req("a", tok, logit_bias={42: 100.0})
    r2 = _req("b", tok, min_tokens=2)
    out = apply_constraints(logits, [r1, r2], None)
    assert int(out[0].argmax()) == 42
    assert out[1, eos] == float("-inf") and torch.equal(logits[1, :eos], out[1, :eos])
    r2.output_ids = [5, 6]
    assert apply_constraints(logits, [r2], None)[0, eos] == 10.0
    # a vocabulary-wide bias: built into tensors once, reused every step
    big = _req("c", tok, logit_bias={t: (-1.0 if t % 2 else 1.0) for t in range(tok.vocab_size)})
    first = apply_constraints(torch.zeros(1, tok.vocab_size), [big], None)
    assert first[0, 0] == 1.0 and first[0, 1] == -1.0
    ids_a = bias_tensors(big.params.logit_bias, tok.vocab_size)[0]
    assert bias_tensors(big.params.logit_bias, tok.vocab_size)[0] is ids_a


def _chat(**kw):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], **kw})


STREAMED = [
    ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "x": [1, {"a": "}"}]}}\n'
     '</tool_call>\nDone <tool', "hermes"),
    ('<tool_call>{"arguments": {"a": 1}, "name": "get_weather"}</tool_call>\n<tool_call>{"name": "get_weather", '
     '"arguments": {"city": "Rome"}}</tool_call>', "hermes"),
    ('<tool_call>{"name": "other", "arguments": {}}</tool_call> hi', "hermes"),
    ('Plain <b>text</b> with < and <tool not a tag', "hermes"),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "hermes"),      # cut by max_tokens
    ('[{"name":"get_weather","arguments":{"city":"Paris"}} , {"name":"get_weather","arguments":{}}]', "json"),
    ('  {"name":"get_weather","arguments":"{\\"q\\": 1}"}', "json"),
    ("Just text, no call.", "json"),
]


@pytest.mark.parametrize("text,framing", STREAMED)
def test_tool_scanner_streams_what_it_parses_whole(text, framing):
    """However the text is cut into pieces, the scanner's events reassemble to what it finds in the
    whole text: the same calls, argument text and (stripped) content."""
    import random
    whole = ToolCallScanner({"get_weather"}, framing)
    whole.feed(text)
    whole.finish()
    for seed in range(25):
        rnd, scan, events, i = random.Random(seed), ToolCallScanner({"get_weather"}, framing), [], 0
        while i < len(text):
            n = rnd.randint(1, 5)
            events += scan.feed(text[i:i + n])
            i += n
        events += scan.finish()
        calls: dict = {}
        for ev in events:
            if ev[0] == "call":
                calls[ev[1]] = [ev[2], ""]
            elif ev[0] == "args":
                calls[ev[1]][1] += ev[2]
        content = "".join(ev[1] for ev in events if ev[0] == "content")
        assert (content or None) == whole.content and [tuple(c) for c in calls.values()] == whole.tool_calls()
    if text.startswith("Sure."):
        assert whole.content == "Sure.\n\nDone <tool"
        assert whole.tool_calls() == [("get_weather", '{"city": "Pa\\"ris", "x": [1, {"a": "}"}]}')]


def test_tool_output_parsers():
    body = _chat()
    content, calls = tools.parse_output(
        'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', body, "hermes")
    assert content == "Sure." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    content, calls = tools.parse_output('{"name": "get_weather", "parameters": {"city": "Rome"}}', body, "json")
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    assert tools.parse_output('{"name": "other", "arguments": {}}', body, "json") == (
        '{"name": "other", "arguments": {}}', [])
    named = _chat(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert tools.tool_grammar(named)[0] == "json_schema"
    _, calls = tools.parse_output('{"city": "Oslo"}', named, "hermes")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_required_tool_calls_keep_their_parameters_refs(tok):
    """A tool whose parameters use "$ref" to their own $defs (a recursive node, "#" itself) is
    served with tool_choice required as it is with a named choice or as response_format: the
    refs are moved with the parameters into the call list's schema (they were refused, 400
    "Cannot find field $defs", since the parameters' root is nested there)."""
    import xgrammar as xgr
    node = {"type": "object", "properties": {"v": {"type": "integer"}, "next": {
        "anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["v", "next"]}
    listy = {"type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#"}}},
             "required": ["items"]}
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "walk", "parameters": {"$defs": {"node": node},
                                                                              "$ref": "#/$defs/node"}}},
            {"type": "function", "function": {"name": "tree", "parameters": listy}},
            {"type": "function", "function": {"name": "plain", "parameters": {"type": "object"}}}]})
    spec = tools.tool_grammar(body)
    compiled = GrammarCompiler.for_tokenizer(tok).compile(spec)

    def accepts(calls) -> bool:
        m = xgr.GrammarMatcher(compiled)
        return all(m.accept_token(t) for t in tok.encode(json.dumps(calls))) and m.is_terminated() is False \
            and m.accept_token(tok.eos_token_ids[0])
    assert accepts([{"name": "walk", "arguments": {"v": 1, "next": {"v": 2, "next": None}}}])
    assert accepts([{"name": "tree", "arguments": {"items": [{"items": []}]}}])
    assert not accepts([{"name": "walk", "arguments": {"v": 1, "next": {"v": "two", "next": None}}}])
    jsonschema.validate([{"name": "walk", "arguments": {"v": 1, "next": None}}], json.loads(spec[1]))


def test_tool_history_round_trips_into_the_prompt(tok):
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]})
    msgs, extra = tools.render_messages(body, tools.template_takes_tools(tok.chat_template))
    text = tok.apply_chat_template(msgs, **extra)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text and "<tools>" in text


def test_body_guard_finds_depth_and_lone_surrogates():
    def refusal(raw: bytes) -> str:
        with pytest.raises(Refusal) as e:
            parse_body(raw, 64)
        return e.value.message
    assert "nested deeper than 64" in refusal(b"[" * 70 + b"]" * 70)
    # brackets inside strings do not count; escaped quotes do not end a string
    assert json_depth(b'{"a": "[[[[\\"{{{{", "b": [[1]]}') == 3
    assert parse_body(b'{"p": "' + b"[" * 500 + b'"}', 64) == {"p": "[" * 500}
    assert "surrogate" in refusal(b'{"messages": [{"content": "a\\ud800b"}]}')
    assert "surrogate" in refusal(b'{"a\\udfff": 1}')
    assert "surrogate" in refusal(b'{"p": "a\xed\xa0\x80b"}')          # raw UTF-8 of U+D800
    assert parse_body('{"prompt": "fine \u00e9 \U0001F600"}'.encode(), 64) == {"prompt": "fine \u00e9 \U0001F600"}
    assert parse_body(b'{"prompt": "pair \\ud83d\\ude00"}', 64) == {"prompt": "pair \U0001F600"}
    assert "not valid JSON" in refusal(b'{"prompt": "a",')


TOOLS_TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
                  "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                  "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}{% endfor %}\n{% endfor %}")


def test_chat_template_flag_renders_tools_natively(tmp_path, tok):
    import argparse

    from shepherd.server import serve_cli
    f = tmp_path / "tools.jinja"
    f.write_text(TOOLS_TEMPLATE)
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    _, srv = serve_cli.build_configs(p.parse_args(["--chat-template", str(f), "--tool-call-parser", "json"]))
    assert srv.chat_template == TOOLS_TEMPLATE and srv.tool_call_parser == "json"
    with pytest.raises(serve_cli.ConfigError, match="--chat-template"):
        serve_cli.build_configs(p.parse_args(["--chat-template", str(tmp_path / "missing.jinja")]))
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "tools": [{"type": "function", "function": {"name": "get_weather"}}]})
    assert tools.template_takes_tools(TOOLS_TEMPLATE)
    msgs, extra = tools.render_messages(body, True)
    from jinja2 import Template
    text = Template(TOOLS_TEMPLATE).render(messages=msgs, **extra)
    assert text.startswith("TOOLS:get_weather;") and "CALL get_weather" in text and "[tool]sunny" in text
