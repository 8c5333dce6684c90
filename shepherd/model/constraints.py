"""Per-request logit constraints applied before sampling: logit_bias, min_tokens and
grammar masks. Rows without constraints are untouched, so constrained and free
requests share a batch."""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def constrained(reqs: Sequence) -> bool:
    return any(r.params.logit_bias or r.params.min_tokens or r.params.grammar is not None for r in reqs)


def apply_constraints(logits: torch.Tensor, reqs: Sequence, grammar: Optional[object]) -> torch.Tensor:
    """logits [S, V], one row per request; returns a constrained copy."""
    logits = logits.clone()
    V = logits.shape[-1]
    for i, r in enumerate(reqs):
        p = r.params
        if p.logit_bias:
            ids = [t for t in p.logit_bias if 0 <= t < V]
            if ids:
                logits[i, ids] += torch.tensor([float(p.logit_bias[t]) for t in ids], dtype=logits.dtype,
                                            device=logits.device)
        if p.min_tokens and len(r.output_ids) < p.min_tokens:
            ids = [t for t in r.stop_ids if 0 <= t < V]
            if ids:
                logits[i, ids] = float("-inf")
    if grammar is not None:
        grammar.apply(logits, reqs)
    return logits
