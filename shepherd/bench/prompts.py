"""Deterministic prompts of an exact token length, built with the target's tokenizer.

A prompt is a run of "safe" words: vocabulary entries that decode to a space
plus a few lowercase letters and re-encode to exactly themselves. With a
byte-level BPE that splits on whitespace (Llama, Qwen2, SmolLM), a run of such
words re-encodes to one token per word, so the length is exact; the builder
still re-encodes every prompt and trims or pads until the count is right.

* Unique text per request is drawn from a seeded RNG keyed by (seed, request
  index), so two runs with the same seed send byte-identical prompts and no
  two requests share a prefix by accident.
* Mooncake `hash_ids`: each id maps to one fixed block of `block_size` tokens
  (keyed by (seed, id)), so equal ids give equal prefixes and the trace's
  prefix sharing survives the replay.
* A shared system prompt (`--shared-prefix N`, or a TraceRequest's
  `prefix_group`) is a fixed block of N tokens per group.

Without a tokenizer (`--tokenizer none`) words are counted as one token each:
the lengths are then approximate, and the server's `usage` is what counts.
"""
from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from shepherd.bench.records import TraceRequest

_WORD = re.compile(r"^ [a-z]{3,9}$")

# Used when there is no tokenizer: plain words, roughly one token each.
_FALLBACK_WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education"
).split()


class TokenizerAdapter:
    """encode(text) -> ids without special tokens, decode(ids) -> text, vocab_size,
    over a `tokenizers.Tokenizer`, a transformers tokenizer or shepherd's own."""

    def __init__(self, tok: Any):
        self.tok = tok
        self._encode_kw: Optional[dict] = None

    def encode(self, text: str) -> list[int]:
        tok = self.tok
        if self._encode_kw is None:
            for kw in ({"add_special_tokens": False}, {"add_bos": False}, {}):
                try:
                    out = tok.encode(text, **kw)
                    self._encode_kw = kw
                    break
                except TypeError:
                    continue
            else:  # pragma: no cover - a tokenizer without encode()
                raise TypeError(f"cannot call encode() on {type(tok).__name__}")
        else:
            out = tok.encode(text, **self._encode_kw)
        ids = getattr(out, "ids", out)
        return list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        try:
            return self.tok.decode(list(ids), skip_special_tokens=False)
        except TypeError:
            return self.tok.decode(list(ids))

    def candidate_ids(self) -> list[int]:
        """Token ids worth testing as safe words, ascending: from the vocabulary's
        byte-level spelling ("Ġword") when it is at hand, else every id."""
        hf = getattr(self.tok, "hf", None) or self.tok
        vocab = None
        for obj in (hf, self.tok):
            gv = getattr(obj, "get_vocab", None)
            if callable(gv):
                try:
                    vocab = gv()
                    break
                except Exception:
                    pass
        if vocab:
            pat = re.compile(r"^(\u0120|\u2581| )[a-z]{3,9}$")
            ids = sorted(i for t, i in vocab.items() if isinstance(t, str) and pat.match(t))
            if len(ids) >= 256:
                return ids
        return list(range(self.vocab_size))

    @property
    def vocab_size(self) -> int:
        tok = self.tok
        for name in ("vocab_size", "n_vocab"):
            v = getattr(tok, name, None)
            if callable(v):
                v = v()
            if isinstance(v, int) and v > 0:
                return v
        if hasattr(tok, "get_vocab_size"):
            return int(tok.get_vocab_size())
        return len(tok)


def load_tokenizer(spec: Optional[str]) -> Optional[TokenizerAdapter]:
    """`spec` None: the default model's tokenizer; "none": no tokenizer;
    a path: a tokenizer.json, a GGUF file or a model folder."""
    if spec is not None and spec.lower() == "none":
        return None
    if spec is not None and spec.endswith(".json"):
        from tokenizers import Tokenizer

        return TokenizerAdapter(Tokenizer.from_file(spec))
    from shepherd.model.loader import load_tokenizer as _load

    return TokenizerAdapter(_load(spec))


@dataclass
class BuiltPrompt:
    text: str                 # the whole prompt
    prefix: str               # the shared part (system prompt / leading hash blocks), may be ""
    tokens: int               # its token count under the tokenizer (or the word count)


class PromptBuilder:
    def __init__(self, tokenizer: Optional[TokenizerAdapter], seed: int = 0,
                 block_size: int = 512, shared_prefix: int = 0):
        self.tok = tokenizer
        self.seed = seed
        self.block_size = block_size
        self.shared_prefix = shared_prefix
        self.words = self._safe_words()
        self._blocks: dict[Any, list[str]] = {}

    # -- vocabulary ---------------------------------------------------------
    def _safe_words(self) -> list[str]:
        if self.tok is None:
            return [" " + w for w in _FALLBACK_WORDS]
        words = []
        for i in self.tok.candidate_ids():
            try:
                s = self.tok.decode([i])
            except Exception:
                continue
            if _WORD.match(s) and self.tok.encode(s) == [i]:
                words.append(s)
                if len(words) >= 4096:
                    break
        if len(words) < 64:
            raise RuntimeError(f"tokenizer has only {len(words)} safe words; cannot build prompts")
        words.sort()
        random.Random(self.seed).shuffle(words)
        return words[:4096]

    def _draw(self, key: Any, n: int) -> list[str]:
        rng = random.Random(f"{self.seed}:{key}")
        w = self.words
        return [w[rng.randrange(len(w))] for _ in range(n)]

    def _block(self, key: Any, n: int) -> list[str]:
        k = (key, n)
        b = self._blocks.get(k)
        if b is None:
            b = self._blocks[k] = self._draw(("block", key), n)
        return b

    def count(self, text: str) -> int:
        if self.tok is None:
            return len(text.split())
        return len(self.tok.encode(text))

    def _fit(self, head: list[str], tail: list[str], n: int, key: Any) -> tuple[str, int]:
        """Join head + tail, then trim or pad the tail until it encodes to n tokens."""
        extra = 0
        words = head + tail
        for _ in range(32):
            text = "".join(words)
            got = self.count(text)
            if got == n:
                return text, got
            if got > n:
                drop = got - n
                keep = max(len(head), len(words) - drop)  # never cut into the shared head
                if keep == len(words):
                    return text, got
                words = words[:keep]
            else:
                extra += 1
                words = words + self._draw(("pad", key, extra), n - got)
        text = "".join(words)
        return text, self.count(text)

    # -- public -------------------------------------------------------------
    def build(self, tr: TraceRequest, index: int) -> BuiltPrompt:
        n = max(1, int(tr.prompt_tokens))
        if tr.prompt_ids:
            text = self.tok.decode(tr.prompt_ids) if self.tok is not None else " ".join(map(str, tr.prompt_ids))
            return BuiltPrompt(text, "", len(tr.prompt_ids))
        head: list[str] = []
        if tr.hash_ids:
            for h in tr.hash_ids:
                if len(head) >= n:
                    break
                head += self._block(("hash", h), self.block_size)
            head = head[:n]
        elif tr.chunks:
            for cid, k in tr.chunks:
                if len(head) >= n:
                    break
                head += self._block(("chunk", cid), k)
            head = head[:n]
        elif self.shared_prefix > 0 or tr.prefix_tokens:
            # a trace's own shared prefix (a synthetic spec's system prompt) wins over --shared-prefix
            group = tr.prefix_group if tr.prefix_group is not None else "shared"
            plen = tr.prefix_tokens or self.shared_prefix
            head = self._block(("prefix", zlib.crc32(str(group).encode())), min(plen, n))
        tail = self._draw(("req", index), n - len(head))
        text, got = self._fit(head, tail, n, index)
        return BuiltPrompt(text, "".join(head), got)
