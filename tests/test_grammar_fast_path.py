"""The grammar's fast path gives the plain path's tokens: the bitmask applied inside the argmax
kernel (no masked copy of the logits), the C kernel that writes the mask, rows whose grammar
allows every token skipped, and the masks filled while the forward runs. The plain path is
xgrammar's own: its matcher fills a row, its apply_token_bitmask_inplace writes -inf, torch's
argmax picks; a finished grammar leaves only the stop tokens."""
from __future__ import annotations

import json

import pytest
import torch

from shepherd.model.grammar import GrammarCompiler, GrammarMasks, TokenMask
from shepherd.model.kernels import apply_bitmask, argmax_masked_rows, argmax_rows, unpack_bitmask
from shepherd.model.loader import load_tokenizer
from shepherd.model.sampler import Sampler, SamplingState
from shepherd.request import SamplingParams
from shepherd.step import NewRequest

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
SPECS = [("json_schema", json.dumps(SCHEMA)), ("regex", r"[a-c]{3}-\d\d"),
         ("choice", json.dumps(["yes", "no", "maybe"])), ("json_object", "")]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def _req(rid, tok, **kw):
    kw.setdefault("temperature", 0.0)
    return SamplingState(NewRequest(req_id=rid, prompt_ids=[1], params=SamplingParams(**kw),
                                    eos_token_ids=tuple(tok.eos_token_ids)))


def _masked_reference(x: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    ref = x.clone()
    keep = unpack_bitmask(bitmask, x.shape[1])
    for r in rows:
        ref[r] = ref[r].masked_fill(~keep[r], float("-inf"))
    return ref


@pytest.mark.parametrize("V", [5, 16, 31, 32, 33, 47, 1000, 49152])
def test_masked_argmax_and_the_mask_kernel_match_masking_then_argmax(V):
    """Ties (first index wins), NaN (allowed or not), all-masked rows, all-allowed rows, tails
    past the last whole word: the kernel's index is argmax_rows' index of the masked row."""
    g = torch.Generator().manual_seed(V)
    S, W = 9, (V + 31) // 32
    for trial in range(24):
        x = torch.randn(S, V, generator=g)
        if trial % 3 == 0:
            x = x.round()                                   # many ties
        if trial % 5 == 1:
            x[0, int(torch.randint(V, (1,), generator=g))] = float("nan")
        if trial % 7 == 2:
            x[1] = float("-inf")
        bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (S, W), generator=g, dtype=torch.int64).to(torch.int32)
        bitmask[2] = 0 if trial % 2 else bitmask[2]         # nothing allowed: index 0, as masking then argmax
        bitmask[3] = -1                                     # everything allowed
        mrow = [i if (i + trial) % 3 else -1 for i in range(S)]
        rows = [r for r in range(S) if mrow[r] >= 0]
        ref = _masked_reference(x, bitmask, rows)
        assert torch.equal(argmax_masked_rows(x, bitmask, mrow), argmax_rows(ref))
        y = x.clone()
        apply_bitmask(y, bitmask, rows)
        assert torch.equal(torch.nan_to_num(y, nan=7.0), torch.nan_to_num(ref, nan=7.0))


def test_mask_kernel_writes_what_xgrammars_own_kernel_writes(tok):
    import xgrammar as xgr
    masks = GrammarMasks(tok)
    reqs = [_req(f"r{i}", tok, grammar=SPECS[i % len(SPECS)]) for i in range(8)]
    V = tok.vocab_size
    mask = masks.fill(reqs, V)
    assert mask is not None and mask.rows == list(range(8))
    x = torch.randn(8, V, generator=torch.Generator().manual_seed(1))
    ours, theirs = x.clone(), x.clone()
    mask.apply(ours)
    xgr.apply_token_bitmask_inplace(theirs, mask.bitmask, indices=mask.rows)
    assert torch.equal(ours, theirs)


class _Plain:
    """The plain path, kept apart from the sampler: one xgrammar matcher per request fed the same
    tokens, xgrammar's apply kernel on a copy, torch's argmax; a finished grammar allows only EOS."""

    def __init__(self, compiler: GrammarCompiler):
        self.c, self.m, self.fed = compiler, {}, {}

    def tokens(self, logits: torch.Tensor, reqs) -> list[int]:
        xgr = self.c.xgr
        x = logits.clone()
        V = x.shape[1]
        bitmask = xgr.allocate_token_bitmask(len(reqs), V)
        live = []
        for i, r in enumerate(reqs):
            if r.params.grammar is None:
                continue
            m = self.m.get(r.req_id)
            if m is None:
                m = self.m[r.req_id] = xgr.GrammarMatcher(self.c.compile(r.params.grammar))
                self.fed[r.req_id] = 0
            for t in r.output_ids[self.fed[r.req_id]:]:
                if not m.is_terminated():
                    assert m.accept_token(t)
            self.fed[r.req_id] = len(r.output_ids)
            if m.is_terminated():
                keep = x[i, list(r.eos_token_ids)].clone()
                x[i] = float("-inf")
                x[i, list(r.eos_token_ids)] = keep
            else:
                m.fill_next_token_bitmask(bitmask, i)
                live.append(i)
        if live:
            xgr.apply_token_bitmask_inplace(x, bitmask, indices=live)
        return x.argmax(-1).tolist()


@pytest.mark.parametrize("prepared", [False, True], ids=["filled-in-sample", "filled-before"])
def test_fast_path_gives_the_plain_paths_tokens_and_is_batch_invariant(tok, prepared):
    """Greedy rows with grammars beside free rows, over random logits until every grammar has
    finished: each step's tokens equal the plain path's; a request with logprobs (which takes the
    masked copy, not the fused argmax) gets the same tokens; and each constrained request alone
    (a batch of one) produces the same tokens as in the batch."""
    V = tok.vocab_size
    fast, logp = Sampler(), Sampler()
    fast.grammar, logp.grammar = GrammarMasks(tok), GrammarMasks(tok)
    compiler = GrammarCompiler.for_tokenizer(tok, V)
    fast.grammar.compiler = logp.grammar.compiler = compiler
    plain = _Plain(compiler)
    names = [f"g{i}" for i in range(len(SPECS))] + ["free0", "free1"]
    specs = SPECS + [None, None]
    a = [_req(n, tok, grammar=s) for n, s in zip(names, specs)]
    b = [_req(n, tok, grammar=s, logprobs=0) for n, s in zip(names, specs)]
    g = torch.Generator().manual_seed(3)
    history = []
    for step in range(40):
        logits = torch.randn(len(a), V, generator=g) * 4
        history.append(logits)
        want = plain.tokens(logits, a)
        mask = fast.grammar.fill(a, V) if prepared else None
        got, _ = fast.sample(logits, a, mask)
        got_lp, lps = logp.sample(logits, b)
        assert got == want, f"step {step}"
        assert got_lp == want, f"step {step} (logprobs path)"
        assert all(lp is not None and lp.token_id == t for lp, t in zip(lps, got_lp))
        for r, rb, t in zip(a, b, got):
            r.output_ids.append(t)
            rb.output_ids.append(t)
    # the regex and the choice finished early: their rows took the stop-tokens-only mask for many steps
    assert a[1].output_ids[-1] in tok.eos_token_ids and a[2].output_ids[-1] in tok.eos_token_ids
    for i, spec in enumerate(SPECS):      # batch invariance: alone, the same logits row, the same tokens
        alone_sampler = Sampler()
        alone_sampler.grammar = GrammarMasks(tok)
        alone_sampler.grammar.compiler = compiler
        alone = _req(names[i], tok, grammar=spec)
        for logits in history:
            t, _ = alone_sampler.sample(logits[i: i + 1].clone(), [alone])
            alone.output_ids.append(t[0])
        assert alone.output_ids == a[i].output_ids


def test_a_row_whose_grammar_allows_every_token_is_skipped():
    """xgrammar says when a row's mask is all ones (need_apply False): that row is not masked,
    and where no row restricts, fill answers None (the sampler then runs its unconstrained
    argmax). A four-token vocabulary whose grammar allows any of its tokens, EOS included."""
    masks = GrammarMasks(tokenizer=None, vocab_size=5)
    masks.compiler = GrammarCompiler(["a", "b", "c", "ab", "</s>"], stop_token_ids=[4])
    every = _FakeReq("every", ("regex", "[abc]*"))
    some = _FakeReq("some", ("regex", "a[bc]*"))
    free = _FakeReq("free", None)
    assert masks.fill([every, free], 5) is None
    mask = masks.fill([every, some, free], 5)
    assert isinstance(mask, TokenMask) and mask.rows == [1]
    x = torch.zeros(3, 5)
    mask.apply(x)
    assert torch.isinf(x[1]).tolist() == [False, True, True, False, True]    # "a" or "ab" first
    assert not torch.isinf(x[0]).any() and not torch.isinf(x[2]).any()


class _FakeReq:
    """The three fields GrammarMasks reads of a request (a unit-test stand-in for SamplingState)."""

    def __init__(self, rid, grammar):
        self.req_id, self.output_ids, self.eos_token_ids = rid, [], (4,)
        self.params = SamplingParams(temperature=0.0, grammar=grammar)


@pytest.mark.model
def test_masks_filled_beside_the_forward_give_the_same_tokens_on_the_real_model(default_model_path):
    """With SHEPHERD_GRAMMAR_OVERLAP=1 the executor fills the grammar rows' masks in a thread while
    the forward runs; with it off (the default: filled in the sampler after the forward) every
    request's tokens are the same, and a constrained request alone gets the tokens it gets in the
    batch."""
    from shepherd.config import EngineConfig, SchedulerConfig
    from shepherd.engine.offline import run_offline
    from shepherd.engine.torch_executor import TorchExecutor
    from shepherd.request import Request
    from shepherd.scheduler.scheduler import Scheduler
    ex = TorchExecutor(EngineConfig(model=default_model_path, dtype="bfloat16", max_total_tokens=4096,
                                    batch_invariant=True))
    ex.masks_beside_forward = True
    tok = ex.tokenizer
    asks = ["Describe a person.", "Give me a shopping list.", "Rate the weather today.", "Name three colours.",
            "Tell me about a painter.", "Write a haiku."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in asks]
    specs = [SPECS[i % len(SPECS)] for i in range(4)] + [None, None]
    runs = [0]

    def serve(which):
        sched = Scheduler(SchedulerConfig(max_total_tokens=ex.kv_capacity, max_batch_size=8),
                          host_kv_capacity=ex.host_kv_capacity, max_model_len=ex.max_model_len)
        runs[0] += 1
        reqs = [Request(f"o{runs[0]}-{i}", list(prompts[i]), SamplingParams(max_tokens=40, temperature=0.0,
                                                                            grammar=specs[i]),
                        eos_token_ids=ex.eos_token_ids) for i in which]
        run_offline(sched, ex, reqs)
        return [r.output_ids for r in reqs]

    every = list(range(len(prompts)))
    beside = serve(every)
    ex.masks_beside_forward = False
    try:
        after = serve(every)
    finally:
        ex.masks_beside_forward = True
    assert beside == after
    for i in range(4):
        assert serve([i]) == [beside[i]]
    assert tok.decode(beside[0]).startswith('{"name"')       # the schema's row follows its grammar


def test_warm_up_builds_the_compiler_in_the_compile_thread_and_compiles_reuse_it(tok):
    # the served core warms up at start: built on a first grammar request instead, the compiler's
    # GIL-bound build stretched a running stream's step to 108-120 ms (docs/SERVING.md)
    masks = GrammarMasks(tok)
    assert masks.compiler is None
    masks.warm_up().result(timeout=120)
    built = masks.compiler
    assert built is not None
    spec = ("json_schema", '{"type": "integer"}')
    assert not masks.prepare(spec)                  # the compile starts in the same thread ...
    masks.warm_up().result(timeout=120)             # ... so a job queued after it ends after it
    assert masks.prepare(spec) and masks.compiler is built
