"""Every input limit of the server, resolved once from the flags and the model.

docs/SERVING.md ("Input limits") lists each with its value and its error.
The defaults that depend on the model follow from what a valid request can
hold: no prompt has more tokens than the context, and no token is longer
than the vocabulary's longest, so a prompt longer than context x longest
token in characters cannot fit and is refused before it is tokenized; the
body cap leaves room for such a prompt escaped twice over.
"""
from __future__ import annotations

from dataclasses import dataclass

from shepherd.config import ServerConfig

MIB = 1 << 20


def longest_token_chars(tokenizer) -> int:
    """Characters of the longest token: a byte-level token's string has one character per byte,
    so this is an upper bound on the characters any token stands for."""
    try:
        return max(len(s) for s in tokenizer.hf.get_vocab(with_added_tokens=True))
    except AttributeError:          # a tokenizer without a vocabulary to read: a generous bound
        return 256


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int        # 413
    max_json_depth: int        # 400
    body_timeout: float        # 408
    max_prompt_chars: int      # 400 context_length_exceeded, before tokenizing
    max_logit_bias: int        # 400: entries; the vocabulary size
    max_grammar_bytes: int     # 400 invalid_grammar
    grammar_timeout: float     # 400 invalid_grammar
    max_logprob_entries: int   # 400 request_too_large: a non-streamed answer's worst case

    @classmethod
    def resolve(cls, cfg: ServerConfig, context_len: int, tokenizer) -> "Limits":
        prompt_chars = max(1, context_len) * longest_token_chars(tokenizer)
        body = cfg.max_body_bytes or min(64 * MIB, max(MIB, 2 * prompt_chars))
        return cls(max_body_bytes=int(body), max_json_depth=int(cfg.max_json_depth),
                   body_timeout=float(cfg.body_timeout), max_prompt_chars=prompt_chars,
                   max_logit_bias=int(tokenizer.vocab_size), max_grammar_bytes=int(cfg.max_grammar_bytes),
                   grammar_timeout=float(cfg.grammar_timeout),
                   max_logprob_entries=int(cfg.max_logprob_entries))
