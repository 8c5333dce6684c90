"""Per-request logit constraints applied before sampling: logit_bias, min_tokens and
grammar masks. Rows without constraints are untouched, so constrained and free
requests share a batch."""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Optional, Sequence

import torch

if TYPE_CHECKING:
    from shepherd.model.grammar import GrammarMasks, TokenMask

# A request's logit_bias as index and value tensors, built once and reused every step (a bias
# over the whole vocabulary took ~10 ms a step to rebuild from its dict). Keyed by the dict's
# identity, which the entry keeps alive; bounded by the entries held.
_BIAS_CACHE: "OrderedDict[int, tuple[dict, torch.Tensor, torch.Tensor]]" = OrderedDict()
_BIAS_CACHE_ENTRIES = 1 << 22


def bias_tensors(bias: dict, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    hit = _BIAS_CACHE.get(id(bias))
    if hit is not None and hit[0] is bias:
        _BIAS_CACHE.move_to_end(id(bias))
        return hit[1], hit[2]
    ids = torch.tensor(list(bias.keys()), dtype=torch.long)
    vals = torch.tensor(list(bias.values()), dtype=torch.float32)
    keep = (ids >= 0) & (ids < V)
    ids, vals = ids[keep], vals[keep]
    _BIAS_CACHE[id(bias)] = (bias, ids, vals)
    held = sum(len(e[0]) for e in _BIAS_CACHE.values())
    while held > _BIAS_CACHE_ENTRIES and len(_BIAS_CACHE) > 1:
        _, (old, _, _) = _BIAS_CACHE.popitem(last=False)
        held -= len(old)
    return ids, vals


def constrained(reqs: Sequence) -> bool:
    return any(r.params.logit_bias or r.params.min_tokens or r.params.grammar is not None for r in reqs)


def apply_constraints(logits: torch.Tensor, reqs: Sequence, grammar: Optional["GrammarMasks"],
                      mask: Optional["TokenMask"] = None) -> torch.Tensor:
    """logits [S, V], one row per request; returns a constrained copy. The grammar rows take
    `mask` (a TokenMask of these reqs, filled while the forward ran) or grammar.fill's."""
    logits = logits.clone()
    V = logits.shape[-1]
    for i, r in enumerate(reqs):
        p = r.params
        if p.logit_bias:
            ids, vals = bias_tensors(p.logit_bias, V)
            if len(ids):
                logits[i].index_add_(0, ids.to(logits.device), vals.to(logits.device, logits.dtype))
        if p.min_tokens and len(r.output_ids) < p.min_tokens:
            ids = [t for t in r.stop_ids if 0 <= t < V]
            if ids:
                logits[i, ids] = float("-inf")
    if mask is None and grammar is not None:
        mask = grammar.fill(reqs, V)
    if mask is not None:
        mask.apply(logits)
    return logits
