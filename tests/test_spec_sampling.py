"""Rejection sampling keeps the request's distribution: the tokens a verify step emits are
distributed as decoding one token at a time would draw them (chi-square tests on fixed seeds,
so the run is deterministic), and greedy verification keeps exactly the drafts that are the
argmax."""
from __future__ import annotations

import math

import torch

from shepherd.model.rejection import greedy_accept
from shepherd.model.sampler import Sampler
from shepherd.request import SamplingParams
from shepherd.step import NewRequest

V = 6
CHI2_DF5_P001 = 20.52      # chi-square critical value, 5 degrees of freedom, p = 0.001


def chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def target(logits: torch.Tensor, temperature: float, top_k: int) -> list[float]:
    """The distribution one decode step samples from: temperature, then top-k (written out here,
    not taken from the sampler)."""
    x = logits / temperature
    kth = sorted(x.tolist(), reverse=True)[top_k - 1]
    x = torch.where(x >= kth, x, torch.full_like(x, -math.inf))
    return torch.softmax(x, -1).tolist()


def run(rows: torch.Tensor, drafts: list[int], n: int, **params):
    """n verify steps of one request whose fed tokens are [7, *drafts]: the emitted token lists."""
    s = Sampler(seed=1)
    st = s.add(NewRequest("r", [1, 2, 3], SamplingParams(max_tokens=100, seed=1234, **params), (99,)))
    out = []
    for _ in range(n):
        st.output_ids[:] = [7, *drafts]
        toks, _ = s.verify(rows, [st], [drafts], [0])
        out.append(toks[0])
        assert st.output_ids == [7, *toks[0][:-1]]     # the rejected drafts dropped from its record
    return out


def test_rejection_sampling_keeps_the_distribution():
    torch.manual_seed(0)
    rows = torch.randn(3, V) * 1.5
    drafts = [2, 4]                 # row 0's draft is likely, row 1's less so
    rows[0, 2] += 1.0
    params = dict(temperature=0.8, top_k=5)
    p0 = target(rows[0], 0.8, 5)
    p1 = target(rows[1], 0.8, 5)
    p2 = target(rows[2], 0.8, 5)
    outs = run(rows, drafts, 12000, **params)
    first = [0] * V
    second = [0] * V          # given the first was draft 0
    third = [0] * V           # given both drafts were kept
    for toks in outs:
        first[toks[0]] += 1
        if toks[0] == drafts[0]:
            second[toks[1]] += 1
            if toks[1] == drafts[1]:
                third[toks[2]] += 1
    assert chi2(first, p0) < CHI2_DF5_P001, (first, p0)
    assert chi2(second, p1) < CHI2_DF5_P001, (second, p1)
    assert chi2(third, p2) < CHI2_DF5_P001, (third, p2)
    assert all(c == 0 for c, p in zip(first, p0) if p == 0)          # top-k held
    kept = sum(1 for t in outs if t[0] == drafts[0]) / len(outs)
    assert abs(kept - p0[2]) < 0.03        # a draft is kept with its probability under the target


def test_an_unlikely_draft_is_replaced_from_the_residual():
    """A draft the target never samples (p = 0 after top-k) is never kept, and the replacement
    is drawn from the target itself."""
    torch.manual_seed(1)
    rows = torch.randn(2, V)
    low = int(rows[0].argmin())
    outs = run(rows, [low], 6000, temperature=1.0, top_k=5)
    assert all(t[0] != low and len(t) == 1 for t in outs)
    counts = [0] * V
    for t in outs:
        counts[t[0]] += 1
    p = target(rows[0], 1.0, 5)
    assert chi2(counts, p) < CHI2_DF5_P001


def test_greedy_keeps_drafts_while_they_are_the_argmax():
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]     # all kept, one more
    assert greedy_accept([5, 9, 7, 8], [5, 6, 7]) == [5, 9]           # second differs: its argmax instead
    assert greedy_accept([4, 6, 7, 8], [5, 6, 7]) == [4]
    rows = torch.full((3, V), -1.0)
    rows[0, 3] = rows[1, 1] = rows[2, 0] = 2.0
    s = Sampler(seed=0)
    st = s.add(NewRequest("g", [1], SamplingParams(temperature=0.0, logprobs=1), ()))
    st.output_ids[:] = [7, 3, 2]
    toks, lps = s.verify(rows, [st], [[3, 2]], [0])
    assert toks == [[3, 1]] and st.output_ids == [7, 3]
    assert [lp.token_id for lp in lps[0]] == [3, 1]


def test_penalties_and_min_tokens_apply_per_row():
    """Row j sees the drafts before it as output, as decoding one at a time would."""
    rows = torch.zeros(3, V)
    rows[:, 4] = 1.0
    rows[:, 5] = 0.9
    s = Sampler(seed=0)
    st = s.add(NewRequest("p", [1], SamplingParams(temperature=0.0, repetition_penalty=2.0), ()))
    st.output_ids[:] = [7, 4, 4]
    toks, _ = s.verify(rows, [st], [[4, 4]], [0])
    assert toks == [[4, 5]]         # row 0 has not seen a 4 yet; row 1 has, and turns it down
    rows = torch.zeros(3, V)
    rows[:, 3] = 2.0
    rows[:, 4] = 1.0
    st = s.add(NewRequest("m", [1], SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3]), ()))
    st.output_ids[:] = [7, 4, 4]
    toks, _ = s.verify(rows, [st], [[4, 4]], [0])
    assert toks == [[4, 4, 3]]      # the stop token is masked after 1 and 2 tokens out, not after 3
