"""Verifying drafted tokens: which of them a request keeps, with its distribution intact.

A verify step computes a request's logits after its last known token and after
each of its k drafts (rows 0..k). Row j is the distribution of the token at
draft j's position given the drafts before it, so it is only used while every
earlier draft was kept.

  - greedy: keep draft j while it is row j's argmax; the first row whose argmax
    differs gives the token in its place (all kept: row k gives one more).
    The tokens are exactly the ones decoding one at a time would give.
  - sampling (Leviathan et al. 2023, Chen et al. 2023): a draft d proposed by
    a deterministic drafter (prompt lookup, a greedy draft model) has proposal
    probability q(d) = 1, so it is kept with probability p(d); when it is not,
    the token comes from p with d removed, renormalised (the residual
    max(0, p - q)). Every emitted token is then distributed exactly as p:
    P(d) = p(d), P(x != d) = (1 - p(d)) p(x) / (1 - p(d)) = p(x).
"""
from __future__ import annotations

from typing import Optional

import torch


def greedy_accept(targets: list[int], drafts: list[int]) -> list[int]:
    """targets[j]: row j's argmax (len(drafts) + 1 of them). The kept drafts and the token after."""
    out: list[int] = []
    for j, t in enumerate(targets):
        out.append(t)
        if j >= len(drafts) or t != drafts[j]:
            break
    return out


def sample_row(probs: torch.Tensor, gen: Optional[torch.Generator]) -> int:
    """One token from probs [V] (the exponential race: argmax p / E, E ~ Exp(1))."""
    q = torch.empty_like(probs).exponential_(1.0, generator=gen)
    return int((probs / q).argmax())


def rejection_accept(probs: torch.Tensor, drafts: list[int], gen: Optional[torch.Generator]) -> list[int]:
    """probs [k+1, V]: the request's sampling distribution at each row (after penalties,
    temperature and filters). Deterministic drafts (q one-hot): draft j kept with
    probability p_j(d_j); else a token from p_j without d_j; all kept: one more from p_k."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        p = probs[j]
        pd = float(p[d])
        u = float(torch.rand((), generator=gen))
        if u < pd:
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        if float(residual.sum()) <= 0.0:      # p(d) == 1 within rounding: d is the only token left
            out.append(d)
            continue
        out.append(sample_row(residual, gen))
        return out
    out.append(sample_row(probs[len(drafts)], gen))
    return out
