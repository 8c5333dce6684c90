"""Structured outputs: grammars compiled by xgrammar, token masks per request.

A request carries its grammar as a spec, SamplingParams.grammar = (kind, text):
    json_schema  a JSON schema (text)           json_object  any JSON object (text unused)
    regex        a regular expression           choice       a JSON list of strings
    ebnf         a GBNF/EBNF grammar (root ::= ...)

`GrammarCompiler` turns specs into compiled grammars (cached by spec); the
server runs one in a worker process to reject a bad spec, or one over its
time budget, with a 400 before the request is queued (server/grammar_check.py).
`GrammarMasks` is the sampler's hook: `prepare(spec, req_id)` compiles a new spec
in a background thread (the engine core keeps the request out of the batch until
it is ready, so no step ever waits for a compile) and then holds the compiled
grammar for the request until it is forgotten, and it keeps one matcher
per request, fed from the request's own output tokens before every step, so
a request that was preempted and recomputed (or resumed on a fresh executor)
rebuilds its matcher state from the tokens alone.

JSON has fixed separators (", " and ": ", xgrammar's default without any_whitespace)
and no other whitespace: small models otherwise loop on newlines inside an object
until max_tokens.

Why xgrammar: its masks are precomputed per grammar state (adaptive token
mask cache), so a step costs tens of microseconds per stream on this CPU;
see docs/SERVING.md for the measurement at 1 and 64 streams.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from shepherd.step import ExecutorFull

if TYPE_CHECKING:
    import torch

log = logging.getLogger("shepherd.grammar")

KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf")

# JSON-schema keywords xgrammar would silently ignore: refuse them rather than return output
# that does not meet the schema
_UNSUPPORTED = ("not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies",
                "uniqueItems", "contains", "minContains", "maxContains", "propertyNames",
                "unevaluatedItems", "unevaluatedProperties", "$dynamicRef", "$recursiveRef")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_DATA_KEYS = ("const", "enum", "default", "examples", "description", "title")


class GrammarError(ValueError):
    """The spec cannot be compiled or uses a construct the engine does not enforce."""


def _schema_nodes(schema: Any, path: str = "$"):
    """Every schema object in `schema` (dicts, with where they are), not the data inside const,
    enum, default, examples, description or title, and a property named like a keyword is a name."""
    stack = [(schema, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):
            stack.extend((x, f"{where}[{i}]") for i, x in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        yield node, where
        for key, val in node.items():
            if key in _DATA_KEYS:
                continue
            if key in _SCHEMA_MAPS and isinstance(val, dict):
                stack.extend((v, f"{where}.{key}.{k}") for k, v in val.items())
            elif isinstance(val, (dict, list)):
                stack.append((val, f"{where}.{key}"))


def check_schema(schema: Any, path: str = "$") -> None:
    """Raise GrammarError naming the first construct that would not be enforced."""
    for node, where in _schema_nodes(schema, path):
        for key, val in node.items():
            if key in _UNSUPPORTED:
                raise GrammarError(f"unsupported JSON schema construct '{key}' at {where}")
            if key == "$ref" and not (isinstance(val, str) and val.startswith("#")):
                raise GrammarError(f"unsupported JSON schema construct '$ref' to {val!r} at {where} "
                                   "(only local '#/...' references)")


def encoded_vocab(tokenizer, vocab_size: int) -> list[str]:
    """Token id -> its string in the tokenizer's byte-level alphabet ("" past the tokenizer's ids)."""
    enc = [""] * vocab_size
    for s, i in tokenizer.hf.get_vocab(with_added_tokens=True).items():
        if 0 <= i < vocab_size:
            enc[i] = s
    return enc


# Specs of this many characters or more compile with no xgrammar cache (GrammarCompiler.__init__):
# at and above it the cache never made a compile faster (mixed enums of 1,000-4,000 values, 25,000-
# 103,000 characters: the uncached compile as fast or faster), and past ~110,000 characters it made one 5x slower.
LARGE_SPEC_CHARS = 20_000
XGR_CACHE_BYTES = 32 << 20     # xgrammar's cache of the small specs' pieces
CACHE_BYTES = 256 << 20        # our cache of compiled grammars, beside its count (at least the newest is kept)


class GrammarCompiler:
    """Spec -> compiled grammar, cached; thread-safe. Built from a tokenizer, or from its
    encoded vocabulary (what a worker process receives: a tokenizer does not pickle)."""

    def __init__(self, vocab: list[str], stop_token_ids: Sequence[int], cache_size: int = 256,
                 enum_trie_chars: Optional[int] = None, cache_bytes: int = CACHE_BYTES):
        import xgrammar as xgr
        self.xgr = xgr
        # a json_schema string enum this large compiles as a trie (benchmarks pass sys.maxsize: flat)
        self.enum_trie_chars = ENUM_TRIE_CHARS if enum_trie_chars is None else enum_trie_chars
        self.vocab_size = len(vocab)
        info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=self.vocab_size,
                                 stop_token_ids=list(stop_token_ids))
        # Two xgrammar compilers. xgrammar's own cache makes the next small schema compile in 0.7 ms
        # instead of 6 ms, but it grows without bound by default (+22.5 MB for each distinct
        # 5,000-value enum: one client could fill the server's memory) and makes a large grammar
        # compile ~5x slower (a 4,500-value mixed enum 2.9 s against 0.62 s). So small specs go
        # through a cache of XGR_CACHE_BYTES, large ones through no cache (docs/SERVING.md).
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=XGR_CACHE_BYTES)
        self._large = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: dict[tuple[str, str], Any] = {}     # ours, by spec: count and bytes bounded
        self._cache_size, self._cache_bytes, self._held_bytes = cache_size, int(cache_bytes), 0
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: Optional[int] = None,
                      cache_bytes: int = CACHE_BYTES) -> "GrammarCompiler":
        size = int(vocab_size or tokenizer.vocab_size)
        return cls(encoded_vocab(tokenizer, size), tokenizer.eos_token_ids, cache_bytes=cache_bytes)

    def get(self, spec: tuple[str, str]):
        """The compiled grammar of `spec` if this compiler holds it, else None (never compiles)."""
        with self._lock:
            return self._cache.get(spec)

    def compile(self, spec: tuple[str, str]):
        with self._lock:
            hit = self._cache.get(spec)
        if hit is not None:
            return hit
        compiled = self._compile(*spec)
        size = compiled.memory_size_bytes
        with self._lock:
            if spec not in self._cache:
                while self._cache and (len(self._cache) >= self._cache_size
                                       or self._held_bytes + size > self._cache_bytes):
                    self._held_bytes -= self._cache.pop(next(iter(self._cache))).memory_size_bytes
                self._cache[spec] = compiled
                self._held_bytes += size
        return compiled

    @property
    def cache_bytes(self) -> int:
        """Bytes held by the compiled grammars in this compiler's caches (ours and xgrammar's)."""
        with self._lock:
            return self._held_bytes + self._compiler.get_cache_size_bytes()

    def _compile(self, kind: str, text: str):
        c = self._compiler if len(text) < LARGE_SPEC_CHARS else self._large
        value = check_spec((kind, text))
        try:
            if kind == "json_schema":
                # a large string enum: the same grammar with the enum as a trie; every other schema
                # is compiled as it always was
                big = large_string_enum(value, self.enum_trie_chars)
                ebnf = enum_trie_ebnf(text, self.enum_trie_chars) if big else None
                if ebnf is not None:
                    return c.compile_grammar(ebnf)
                return c.compile_json_schema(text, strict_mode=True, any_whitespace=False)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "choice":
                return c.compile_grammar(choice_ebnf(value))
            return c.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(_short(e)) from None


def check_spec(spec: tuple[str, str]) -> Any:
    """The checks that need no compiler: a known kind, JSON that parses, no schema construct
    that would be silently ignored. Raises GrammarError; returns the parsed JSON (None for the
    kinds that are not JSON)."""
    kind, text = spec
    if kind not in KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}; one of {', '.join(KINDS)}")
    if kind in ("json_schema", "choice"):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise GrammarError(f"the {'JSON schema' if kind == 'json_schema' else 'choice list'} is not valid "
                               f"JSON: {e}") from None
        if kind == "json_schema":
            check_schema(value)
        elif not isinstance(value, list) or not value:
            raise GrammarError("choice must be a non-empty list of strings")
        return value
    return None


def trie_rules(strings: Sequence[str], root: str, prefix: str) -> list[str]:
    """EBNF rules accepting exactly one of `strings`, factored as a trie: `root ::= ...` first, the
    rest named `{prefix}N`. xgrammar compiled 10,000 guided_choice strings in 0.1 s this way, and
    in 13 s as 10,000 alternatives of one rule. Literals keep every character but JSON's escapes raw:
    xgrammar reads a JSON surrogate pair (\\ud83d\\ude00) as two code points, not one emoji.
    Built from the sorted strings, a list per branching node and no object per character: a
    dict-per-character trie of 5,000 enum values made the engine core's collector hold the GIL for
    ~100 ms, a gap in every stream (this runs in the core's compile thread)."""
    rules: list[str] = [""]
    todo = [(sorted(set(strings)), 0, 0)]       # (strings of a node, sorted; characters consumed; rule)
    while todo:
        group, depth, idx = todo.pop()
        alts, i = [], 0
        if len(group[0]) == depth:              # a string ends here (it sorts first)
            alts.append('""')
            i = 1
        while i < len(group):
            ch, j = group[i][depth], i + 1
            while j < len(group) and group[j][depth] == ch:
                j += 1
            branch = group[i:j]                 # the strings that go on with `ch`
            stem = os.path.commonprefix([branch[0], branch[-1]])    # sorted: first and last bound it
            lit = json.dumps(stem[depth:], ensure_ascii=False)
            if len(branch) == 1:
                alts.append(lit)
            else:
                rules.append("")
                todo.append((branch, len(stem), len(rules) - 1))
                alts.append(f"{lit} {prefix}{len(rules) - 1}")
            i = j
        rules[idx] = f"{root if idx == 0 else prefix + str(idx)} ::= " + " | ".join(alts)
    return rules


def choice_ebnf(choices: Sequence) -> str:
    """An EBNF grammar accepting exactly one of `choices` (a trie, trie_rules)."""
    return "\n".join(trie_rules([str(c) for c in choices], "root", "c"))


# A json_schema string enum whose values take at least this many characters (JSON-encoded, quotes
# included) compiles as a trie (enum_trie_ebnf). xgrammar compiles one flat alternation of literals
# a little faster than the trie up to ~95,000 characters (4,000 values: 0.11 s against 0.13 s) and
# falls off a cliff past it (5,000 values, 119,000 characters: 3.3-3.5 s against 0.18-0.23 s; and its
# masks inside the string cost 0.15 ms a row against 0.002 ms): benchmarks/enum_compile.py, docs/SERVING.md.
# Half the cliff, for margin: where it lies is xgrammar's, not ours.
ENUM_TRIE_CHARS = 50_000

# xgrammar's EBNF text: a rule body that is only string literals is (("lit") | ("lit") | ...), and
# a literal's text has no quote but an escaped one
_LITERAL_TEXT = re.compile(r'(?:[^"\\]|\\.)*', re.S)
_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|(.))", re.S)
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "'": "'", "n": "\n", "r": "\r", "t": "\t", "b": "\b", "f": "\f",
                   "v": "\v", "a": "\a", "0": "\0"}


def large_string_enum(schema: Any, min_chars: int = ENUM_TRIE_CHARS) -> bool:
    """Whether some schema object in `schema` is an enum of strings only whose JSON-encoded values
    take at least `min_chars` characters."""
    return any(isinstance(e := node.get("enum"), list) and all(isinstance(v, str) for v in e)
               and sum(len(json.dumps(v, ensure_ascii=False)) for v in e) >= min_chars
               for node, _ in _schema_nodes(schema))


def enum_trie_ebnf(schema_text: str, min_chars: int = ENUM_TRIE_CHARS) -> Optional[str]:
    """xgrammar's own EBNF for a JSON schema (strict, no free whitespace: what compile_json_schema
    compiles), each rule made only of JSON-string literals (a string enum, each value already
    encoded as xgrammar writes it) of `min_chars` characters or more replaced by a trie of the
    same literals: the same language (benchmarks/enum_compile.py: the time). None when no rule
    qualifies."""
    import xgrammar as xgr
    text = str(xgr.Grammar.from_json_schema(schema_text, strict_mode=True, any_whitespace=False))
    lines = text.splitlines()
    names = {ln.split(" ::= ", 1)[0] for ln in lines}
    out, tries, changed = [], [], False
    for ln in lines:
        name, _, body = ln.partition(" ::= ")
        lits = _string_literals(body) if len(body) >= min_chars else None     # the text bounds the values
        if lits is None or sum(map(len, lits)) < min_chars:
            out.append(ln)
            continue
        prefix = f"{name}_trie"
        while any(n.startswith(prefix) for n in names):     # never a name xgrammar already uses
            prefix += "_"
        rules = trie_rules(lits, name, prefix)
        out.append(rules[0])
        tries.extend(rules[1:])
        changed = True
    return "\n".join(out + tries) if changed else None


def _string_literals(body: str) -> Optional[list[str]]:
    """The literals of a rule body made only of JSON-string literals (each starting and ending with
    a quote), unescaped; None for any other body, or for an escape this reader does not know."""
    if not (body.startswith('(("') and body.endswith('"))')):
        return None
    # cut at every `") | ("`, then each piece must be a whole literal's text (no unescaped quote):
    # one regex over a 20,000-value body held the GIL 33 ms, one call per piece lets it go
    raws = body[3:-3].split('") | ("')
    if not all(_LITERAL_TEXT.fullmatch(raw) for raw in raws):
        return None
    try:
        lits = [_ESCAPE.sub(_unescape, raw) for raw in raws]
        for lit in lits:
            lit.encode("utf-8")         # a lone surrogate would not reach xgrammar intact
    except (KeyError, UnicodeEncodeError):
        return None
    return lits if all(len(lit) >= 2 and lit[0] == lit[-1] == '"' for lit in lits) else None


def _unescape(m: "re.Match") -> str:
    """One escape of xgrammar's EBNF text (KeyError: one this reader does not know)."""
    code = m.group(1) or m.group(2) or m.group(3)
    return chr(int(code, 16)) if code else _SIMPLE_ESCAPES[m.group(4)]


def _short(e: Exception) -> str:
    """xgrammar's messages start with a timestamp and a C++ source location."""
    msg = str(e).strip()
    if "] " in msg[:120] and ": " in msg:
        msg = msg.split(": ", 1)[1] if msg.startswith("[") else msg
        if msg.startswith("/") and ": " in msg:
            msg = msg.split(": ", 1)[1]
    return msg.splitlines()[0] if msg else type(e).__name__


def lower_thread_priority(nice: int = 10) -> None:
    """Run the calling thread at a lower priority (Linux: nice is per thread), so that long work
    in it (a compile here, the server's large tokenizing jobs) yields the cores to the forward."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError):
        pass


class GrammarMasks:
    """The sampler's hook: masks the logits of constrained rows, in place. The compiler is
    built on first use, for the model's vocabulary width (it may exceed the tokenizer's)."""

    def __init__(self, tokenizer, vocab_size: Optional[int] = None, max_held_bytes: int = 0):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.compiler: Optional[GrammarCompiler] = None
        self._matchers: dict[str, Any] = {}
        self._fed: dict[str, int] = {}
        # req_id -> its compiled grammar, from prepare's True until forget: the compiler's cache
        # may evict it meanwhile (other grammars, its byte bound), and then the request's first
        # step, or its matcher's rebuild after a rollback, would compile inside the step
        self._held: dict[str, Any] = {}
        # The held grammars' bytes, each distinct grammar once (requests of one spec share it),
        # bounded by max_held_bytes (0: no bound). Without it one client's distinct large specs
        # held ~40 MB each (a 113 KB guided_choice of 4,000 random strings) for as long as their
        # requests lived, up to --max-concurrency of them.
        self.max_held_bytes = int(max_held_bytes)
        self._holders: dict[int, list] = {}    # id(compiled) -> [requests holding it, its bytes, its spec]
        # spec -> its compiled grammar while requests hold it: a request of the same spec shares that
        # one, even when the compiler's cache (small under a small bound) no longer has it
        self._by_spec: dict[tuple[str, str], Any] = {}
        self.failed: dict[str, str] = {}   # req_id -> error, taken by the executor after sampling
        self._pool: Optional[ThreadPoolExecutor] = None          # compiles, at a lower priority
        self._fill_pool: Optional[ThreadPoolExecutor] = None     # masks beside the forward (fill_async)
        self._pending: dict[tuple[str, str], Future] = {}
        self._build_lock = threading.Lock()

    def _compiler_for(self, vocab_size: Optional[int]) -> GrammarCompiler:
        with self._build_lock:      # the first prepare builds it in the background thread
            if self.compiler is None:
                # the reuse cache is within the bound too: held grammars plus cached ones stay
                # under twice --max-grammar-memory, whatever it is set to
                cache = min(CACHE_BYTES, self.max_held_bytes) if self.max_held_bytes else CACHE_BYTES
                self.compiler = GrammarCompiler.for_tokenizer(self.tokenizer, self.vocab_size or vocab_size,
                                                              cache_bytes=cache)
            return self.compiler

    def warm_up(self) -> Future:
        """Build the compiler now, in the compile thread, before any request needs it. Its first
        build (xgrammar's TokenizerInfo over the whole vocabulary, ~0.9 s here) holds the GIL for
        up to ~84 ms at a time; built on a grammar request's arrival it stretched a running
        stream's step to 108-120 ms (docs/SERVING.md, "The enum row")."""
        return self._compile_pool().submit(self._compiler_for, None)

    def _compile_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="shepherd-grammar", initializer=lower_thread_priority)
        return self._pool

    def prepare(self, spec: tuple[str, str], req_id: Optional[str] = None) -> bool:
        """True once `spec` is compiled, and then the compiled grammar is held for `req_id` until
        forget(req_id); else starts (or keeps) its compile in a background thread and returns
        False. Raises GrammarError when the compile failed, ExecutorFull when holding it would pass
        max_held_bytes."""
        fut = self._pending.get(spec)
        if fut is None:
            compiled = self._by_spec.get(spec)
            if compiled is None and self.compiler is not None:
                compiled = self.compiler.get(spec)
            if compiled is None:
                self._pending[spec] = fut = self._compile_pool().submit(
                    lambda: self._compiler_for(None).compile(spec))
        if fut is not None:
            if not fut.done():
                return False
            self._pending.pop(spec, None)
            compiled = fut.result()     # GrammarError (or a bug) surfaces here, to the request that asked
        if req_id is not None and req_id not in self._held:
            self._hold(req_id, spec, compiled, bounded=True)
        return True

    @property
    def held_bytes(self) -> int:
        """Bytes of the grammars held for requests, each distinct grammar once."""
        return sum(size for _, size, _ in self._holders.values())

    def _hold(self, req_id: str, spec: tuple[str, str], compiled: Any, bounded: bool) -> None:
        h = self._holders.get(id(compiled))
        if h is None:
            size, held = compiled.memory_size_bytes, self.held_bytes
            # the first grammar is always taken, however large, as the compiler's cache keeps its newest
            if bounded and self.max_held_bytes and held and held + size > self.max_held_bytes:
                raise ExecutorFull(f"compiled grammars held by requests in flight are at the server's bound "
                                   f"({held / 2**20:.0f} MiB held, this one {size / 2**20:.1f} MiB; "
                                   f"--max-grammar-memory {self.max_held_bytes / 2**20:.0f} MiB)")
            h = self._holders[id(compiled)] = [0, size, spec]
            self._by_spec.setdefault(spec, compiled)
        h[0] += 1
        self._held[req_id] = compiled

    def forget(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)
        self._fed.pop(req_id, None)
        compiled = self._held.pop(req_id, None)
        if compiled is not None:
            h = self._holders[id(compiled)]
            h[0] -= 1
            if h[0] == 0:
                del self._holders[id(compiled)]
                if self._by_spec.get(h[2]) is compiled:
                    del self._by_spec[h[2]]

    def _sync(self, req) -> Any:
        """The request's matcher, advanced over the output tokens it has not seen."""
        rid, out = req.req_id, req.output_ids
        m = self._matchers.get(rid)
        if m is None or self._fed.get(rid, 0) > len(out):   # new, or its tokens were rolled back
            g = self._held.get(rid)
            if g is None:       # not prepared (a caller without the core's parking): compiled here
                g = self.compiler.compile(req.params.grammar)
                self._hold(rid, req.params.grammar, g, bounded=False)
            m = self.compiler.xgr.GrammarMatcher(g)
            self._matchers[rid], self._fed[rid] = m, 0
        for tid in out[self._fed[rid]:]:
            if not m.is_terminated():
                m.accept_token(int(tid))
        self._fed[rid] = len(out)
        return m

    def fill(self, reqs: Sequence, vocab_size: int) -> Optional["TokenMask"]:
        """This step's masks of the constrained rows of `reqs` (one row per request), or None
        where no row restricts anything. A row whose grammar allows every token is left out
        (xgrammar says so when it fills it: `need_apply`); a finished grammar allows only the
        request's stop tokens. Reads only the requests' tokens, so it may run while the forward
        that produces this step's logits runs (fill_async)."""
        rows = [i for i, r in enumerate(reqs) if r.params.grammar is not None]
        if not rows:
            return None
        V = vocab_size
        xgr = self._compiler_for(V).xgr
        bitmask = xgr.allocate_token_bitmask(len(reqs), V)
        restrict = []
        for i in rows:
            try:
                m = self._sync(reqs[i])
            except GrammarError as e:
                # the server compiled this spec before queueing it, so this is a bug: that request
                # ends with an error (never unconstrained text), the others keep running
                log.exception("grammar of %s failed on the executor", reqs[i].req_id)
                self.failed[reqs[i].req_id] = f"structured output failed on the engine: {e}"
                continue
            if m.is_terminated():       # complete: only a stop token may follow
                bitmask[i] = 0
                for t in reqs[i].eos_token_ids:
                    if 0 <= t < V:
                        w, b = divmod(t, 32)
                        bitmask[i, w] |= (1 << b) if b < 31 else -(1 << 31)
                restrict.append(i)
            elif m.fill_next_token_bitmask(bitmask, i):
                restrict.append(i)
        return TokenMask(bitmask, restrict) if restrict else None

    def fill_async(self, reqs: Sequence, vocab_size: int) -> Future:
        """fill in the hook's own thread, at the engine's priority (not the compiles' lower one):
        the executor starts it before the forward and takes the result after."""
        if self._fill_pool is None:
            self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="shepherd-masks")
        return self._fill_pool.submit(self.fill, list(reqs), vocab_size)

    def apply(self, logits, reqs: Sequence) -> None:
        """logits: a torch tensor [S, V], one row per request; masked in place."""
        mask = self.fill(reqs, logits.shape[-1])
        if mask is not None:
            mask.apply(logits)


@dataclass
class TokenMask:
    """One step's grammar masks: bitmask row i (int32 words, xgrammar's layout: bit b of word w
    set = token 32 w + b allowed) belongs to request i of the step; only the rows listed restrict
    (the others carry no grammar, or allow every token this step)."""
    bitmask: "torch.Tensor"     # int32 [S, ceil(V / 32)], on the CPU (where xgrammar fills it)
    rows: list[int]

    def apply(self, logits) -> None:
        """Masked tokens of the listed rows -> -inf, in place (kernels.bitmask_apply_rows)."""
        # imported here: the server's grammar checker imports this module and never needs torch
        from shepherd.model.kernels import apply_bitmask
        apply_bitmask(logits, self.bitmask, self.rows)

    def argmax(self, logits) -> list[int]:
        """The greedy token of every row of logits [S, V] as if masked first, without writing
        them (kernels.argmax_masked_rows: the bitmask is applied inside the argmax)."""
        from shepherd.model.kernels import argmax_masked_rows
        mrow = [-1] * logits.shape[0]
        for i in self.rows:
            mrow[i] = i
        return argmax_masked_rows(logits, self.bitmask, mrow).tolist()
