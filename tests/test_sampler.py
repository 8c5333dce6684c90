"""Sampler: greedy, seeds, top-k/top-p/min-p masks, penalties, logprobs."""
import math

import pytest
import torch

from shepherd.model.sampler import Sampler, SamplingState, apply_penalties, filter_logits
from shepherd.request import SamplingParams
from shepherd.step import NewRequest

V = 50


def req(rid="a", prompt=(1, 2, 3), out=(), **kw):
    """The sampler's record of a request (what it keeps from the step contract)."""
    r = SamplingState(NewRequest(req_id=rid, prompt_ids=list(prompt), params=SamplingParams(**kw)))
    r.output_ids = list(out)
    return r


def logits(seed=0, n=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 3


def test_greedy_is_argmax():
    lg = logits(n=4)
    toks, lps = Sampler(seed=0).sample(lg, [req(str(i), temperature=0.0) for i in range(4)])
    assert toks == lg.argmax(-1).tolist()
    assert lps == [None] * 4


def test_seed_reproducible_and_independent_of_batch():
    lg = logits(1, n=1).repeat(3, 1)
    def run(reqs, rows):
        s = Sampler()
        out = []
        for _ in range(20):
            t, _ = s.sample(rows, reqs)
            out.append(t)
        return out
    alone = run([req("x", temperature=1.0, seed=42)], lg[:1])
    again = run([req("x", temperature=1.0, seed=42)], lg[:1])
    batched = run([req("y", temperature=1.0), req("x", temperature=1.0, seed=42),
                   req("z", temperature=0.7, seed=7)], lg)
    assert alone == again
    assert [a[0] for a in alone] == [b[1] for b in batched]
    other = run([req("x", temperature=1.0, seed=43)], lg[:1])
    assert alone != other
    assert len(set(a[0] for a in alone)) > 1       # it really samples


def test_sampling_follows_the_distribution():
    lg = torch.tensor([[math.log(0.7), math.log(0.2), math.log(0.1)] + [-1e9] * (V - 3)])
    s = Sampler(seed=0)
    r = req("a", temperature=1.0)
    counts = torch.zeros(V)
    for _ in range(2000):
        t, _ = s.sample(lg, [r])
        counts[t[0]] += 1
    freq = counts[:3] / 2000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)
    assert counts[3:].sum() == 0


def test_top_k_mask():
    lg = logits(2)[0]
    out = filter_logits(lg, top_k=5)
    kept = torch.isfinite(out).nonzero().flatten()
    assert set(kept.tolist()) == set(torch.topk(lg, 5).indices.tolist())


def test_top_p_mask():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04] + [0.0] * (V - 5)) + 1e-12
    lg = probs.log()
    kept = torch.isfinite(filter_logits(lg, top_p=0.8)).nonzero().flatten().tolist()
    assert kept == [0, 1, 2]           # 0.5+0.25 < 0.8, the token that crosses it is kept
    kept = torch.isfinite(filter_logits(lg, top_p=0.45)).nonzero().flatten().tolist()
    assert kept == [0]
    kept = torch.isfinite(filter_logits(lg, top_p=0.01)).nonzero().flatten().tolist()
    assert kept == [0]                 # always keeps the best


def test_min_p_mask():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04] + [0.0] * (V - 5)) + 1e-12
    kept = torch.isfinite(filter_logits(probs.log(), min_p=0.15)).nonzero().flatten().tolist()
    assert kept == [0, 1, 2]           # threshold 0.075


def test_top_k_sampling_only_draws_kept_tokens():
    lg = torch.zeros(1, V)
    lg[0, 10:13] = 0.5
    s = Sampler(seed=1)
    seen = {s.sample(lg, [req("a", temperature=1.0, top_k=3)])[0][0] for _ in range(200)}
    assert seen == {10, 11, 12}


def test_repetition_penalty():
    lg = torch.zeros(V)
    lg[1], lg[2], lg[7] = 2.0, -2.0, 2.0
    p = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(lg, [1, 2], [], p)
    assert out[1] == 1.0 and out[2] == -4.0 and out[7] == 2.0
    # greedy flips to the unpenalised token
    lg2 = torch.zeros(1, V)
    lg2[0, 1], lg2[0, 7] = 2.0, 1.5
    t, _ = Sampler().sample(lg2, [req("a", prompt=[1], temperature=0.0, repetition_penalty=2.0)])
    assert t == [7]


def test_frequency_and_presence_penalties():
    lg = torch.zeros(V)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    out = apply_penalties(lg, [4, 4], [3, 3, 3, 5], p)
    assert out[3] == pytest.approx(-(3 * 0.5 + 1.0))
    assert out[5] == pytest.approx(-(0.5 + 1.0))
    assert out[4] == 0.0               # prompt tokens are not penalised by frequency/presence
    # the penalised distribution puts less mass on repeated tokens
    assert out.softmax(-1)[3] < lg.softmax(-1)[3]


def test_logprobs_top_n():
    lg = logits(3, n=2)
    s = Sampler(seed=0)
    toks, lps = s.sample(lg, [req("a", temperature=0.0, logprobs=5), req("b", temperature=0.0)])
    assert lps[1] is None
    lp = lps[0]
    ref = torch.log_softmax(lg[0], -1)
    assert lp.token_id == toks[0]
    assert lp.logprob == pytest.approx(float(ref[toks[0]]), abs=1e-5)
    assert len(lp.top) == 5
    vals = [v for _, v in lp.top]
    assert vals == sorted(vals, reverse=True)
    assert lp.top[0][0] == toks[0]          # greedy token is the best
    assert all(v <= 0 for v in vals)
    assert math.isclose(sum(math.exp(v) for v in ref.tolist()), 1.0, rel_tol=1e-4)
    assert [i for i, _ in lp.top] == torch.topk(ref, 5).indices.tolist()


def test_logprobs_zero_returns_only_the_sampled_token():
    toks, lps = Sampler(seed=0).sample(logits(4), [req("a", temperature=1.0, seed=1, logprobs=0)])
    assert lps[0].top == [] and lps[0].token_id == toks[0]


def test_forget_resets_seeded_generator():
    s = Sampler()
    lg = logits(5)
    r = req("a", temperature=1.0, seed=3)
    first = [s.sample(lg, [r])[0][0] for _ in range(10)]
    s.forget("a")
    again = [s.sample(lg, [r])[0][0] for _ in range(10)]
    assert first == again
