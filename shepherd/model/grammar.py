"""Structured outputs: grammars compiled by xgrammar, token masks per request.

A request carries its grammar as a spec, SamplingParams.grammar = (kind, text):
    json_schema  a JSON schema (text)           json_object  any JSON object (text unused)
    regex        a regular expression           choice       a JSON list of strings
    ebnf         a GBNF/EBNF grammar (root ::= ...)

`GrammarCompiler` turns specs into compiled grammars (cached by spec); the
server runs one in a worker process to reject a bad spec, or one over its
time budget, with a 400 before the request is queued (server/grammar_check.py).
`GrammarMasks` is the sampler's hook: `prepare(spec)` compiles a new spec in a
background thread (the engine core keeps the request out of the batch until
it is ready, so no step ever waits for a compile), and it keeps one matcher
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
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

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


def check_schema(schema: Any, path: str = "$") -> None:
    """Raise GrammarError naming the first construct that would not be enforced."""
    stack = [(schema, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):
            stack.extend((x, f"{where}[{i}]") for i, x in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        for key, val in node.items():
            if key in _UNSUPPORTED:
                raise GrammarError(f"unsupported JSON schema construct '{key}' at {where}")
            if key == "$ref" and not (isinstance(val, str) and val.startswith("#")):
                raise GrammarError(f"unsupported JSON schema construct '$ref' to {val!r} at {where} "
                                   "(only local '#/...' references)")
            if key in _DATA_KEYS:
                continue
            if key in _SCHEMA_MAPS and isinstance(val, dict):
                stack.extend((v, f"{where}.{key}.{k}") for k, v in val.items())
            elif isinstance(val, (dict, list)):
                stack.append((val, f"{where}.{key}"))


def encoded_vocab(tokenizer, vocab_size: int) -> list[str]:
    """Token id -> its string in the tokenizer's byte-level alphabet ("" past the tokenizer's ids)."""
    enc = [""] * vocab_size
    for s, i in tokenizer.hf.get_vocab(with_added_tokens=True).items():
        if 0 <= i < vocab_size:
            enc[i] = s
    return enc


class GrammarCompiler:
    """Spec -> compiled grammar, cached; thread-safe. Built from a tokenizer, or from its
    encoded vocabulary (what a worker process receives: a tokenizer does not pickle)."""

    def __init__(self, vocab: list[str], stop_token_ids: Sequence[int], cache_size: int = 256):
        import xgrammar as xgr
        self.xgr = xgr
        self.vocab_size = len(vocab)
        info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=self.vocab_size,
                                 stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._cache: dict[tuple[str, str], Any] = {}
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: Optional[int] = None) -> "GrammarCompiler":
        size = int(vocab_size or tokenizer.vocab_size)
        return cls(encoded_vocab(tokenizer, size), tokenizer.eos_token_ids)

    def cached(self, spec: tuple[str, str]) -> bool:
        with self._lock:
            return spec in self._cache

    def compile(self, spec: tuple[str, str]):
        with self._lock:
            hit = self._cache.get(spec)
        if hit is not None:
            return hit
        compiled = self._compile(*spec)
        with self._lock:
            if len(self._cache) >= self._cache_size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[spec] = compiled
        return compiled

    def _compile(self, kind: str, text: str):
        c = self._compiler
        check_spec((kind, text))
        try:
            if kind == "json_schema":
                return c.compile_json_schema(text, strict_mode=True, any_whitespace=False)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "choice":
                return c.compile_grammar(choice_ebnf(json.loads(text)))
            return c.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(_short(e)) from None


def check_spec(spec: tuple[str, str]) -> None:
    """The checks that need no compiler: a known kind, JSON that parses, no schema construct
    that would be silently ignored. Raises GrammarError."""
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


def choice_ebnf(choices: Sequence) -> str:
    """An EBNF grammar accepting exactly one of `choices`, factored as a trie: xgrammar compiles
    10,000 choices in 0.1 s this way, and in 13 s as 10,000 alternatives of one rule."""
    trie: dict = {}
    for choice in choices:
        node = trie
        for ch in str(choice):
            node = node.setdefault(ch, {})
        node[""] = {}                       # a choice ends here
    rules: list[str] = []
    todo = [(trie, 0)]
    rules.append("")
    while todo:
        node, idx = todo.pop()
        alts = []
        for ch, sub in sorted(node.items()):
            if ch == "":
                alts.append('""')
                continue
            lit = ch
            while len(sub) == 1 and "" not in sub:         # a chain without branches: one literal
                (nxt, sub), = sub.items()
                lit += nxt
            if list(sub) == [""]:
                alts.append(json.dumps(lit))
            else:
                rules.append("")
                todo.append((sub, len(rules) - 1))
                alts.append(f"{json.dumps(lit)} c{len(rules) - 1}")
        rules[idx] = f"c{idx} ::= " + " | ".join(alts)
    return "root ::= c0\n" + "\n".join(rules)


def _short(e: Exception) -> str:
    """xgrammar's messages start with a timestamp and a C++ source location."""
    msg = str(e).strip()
    if "] " in msg[:120] and ": " in msg:
        msg = msg.split(": ", 1)[1] if msg.startswith("[") else msg
        if msg.startswith("/") and ": " in msg:
            msg = msg.split(": ", 1)[1]
    return msg.splitlines()[0] if msg else type(e).__name__


def _lower_priority() -> None:
    """Run this thread at a lower priority (Linux: nice is per thread), so a long compile
    yields the cores to the engine's forward."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (OSError, AttributeError):
        pass


class GrammarMasks:
    """The sampler's hook: masks the logits of constrained rows, in place. The compiler is
    built on first use, for the model's vocabulary width (it may exceed the tokenizer's)."""

    def __init__(self, tokenizer, vocab_size: Optional[int] = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.compiler: Optional[GrammarCompiler] = None
        self._matchers: dict[str, Any] = {}
        self._fed: dict[str, int] = {}
        self.failed: dict[str, str] = {}   # req_id -> error, taken by the executor after sampling
        self._pool: Optional[ThreadPoolExecutor] = None          # compiles, at a lower priority
        self._fill_pool: Optional[ThreadPoolExecutor] = None     # masks beside the forward (fill_async)
        self._pending: dict[tuple[str, str], Future] = {}
        self._build_lock = threading.Lock()

    def _compiler_for(self, vocab_size: Optional[int]) -> GrammarCompiler:
        with self._build_lock:      # the first prepare builds it in the background thread
            if self.compiler is None:
                self.compiler = GrammarCompiler.for_tokenizer(self.tokenizer, self.vocab_size or vocab_size)
            return self.compiler

    def warm_up(self) -> Future:
        """Build the compiler now, in the compile thread, before any request needs it. Its first
        build (xgrammar's TokenizerInfo over the whole vocabulary, ~0.9 s here) holds the GIL for
        up to ~84 ms at a time; built on a grammar request's arrival it stretched a running
        stream's step to 108-120 ms (docs/SERVING.md, "The enum row")."""
        return self._compile_pool().submit(self._compiler_for, None)

    def _compile_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="shepherd-grammar", initializer=_lower_priority)
        return self._pool

    def prepare(self, spec: tuple[str, str]) -> bool:
        """True once `spec` is compiled; else starts (or keeps) its compile in a background
        thread and returns False. Raises GrammarError when the compile failed."""
        fut = self._pending.get(spec)
        if fut is None:
            if self.compiler is not None and self.compiler.cached(spec):
                return True
            self._pending[spec] = fut = self._compile_pool().submit(lambda: self._compiler_for(None).compile(spec))
        if not fut.done():
            return False
        del self._pending[spec]
        fut.result()            # GrammarError (or a bug) surfaces here, to the request that asked
        return True

    def forget(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)
        self._fed.pop(req_id, None)

    def _sync(self, req) -> Any:
        """The request's matcher, advanced over the output tokens it has not seen."""
        rid, out = req.req_id, req.output_ids
        m = self._matchers.get(rid)
        if m is None or self._fed.get(rid, 0) > len(out):   # new, or its tokens were rolled back
            m = self.compiler.xgr.GrammarMatcher(self.compiler.compile(req.params.grammar))
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
