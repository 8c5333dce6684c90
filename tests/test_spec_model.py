"""Speculative decoding on the real model (greedy, batch-invariant): the tokens are exactly the
ones decoding one token at a time gives, alone or batched, chunked, preempted (recompute or
swap) or served from the prefix cache, while the drafts (prompt lookup) are really verified and
kept."""
from __future__ import annotations

import pytest

from shepherd.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from greedy_runs import serve_greedy

pytestmark = pytest.mark.model

CAP = 4096
NEW = 28
SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1,
                         disable_by_batch_size=0)


@pytest.fixture(scope="module")
def ex(default_model_path):
    from shepherd.engine.torch_executor import TorchExecutor
    # the drafter answers only the schedulers that ask (ScheduledSeq.propose): one executor serves both
    return TorchExecutor(EngineConfig(model=default_model_path, dtype="bfloat16", max_total_tokens=CAP,
                                      host_kv_tokens=CAP, batch_invariant=True,
                                      scheduler=SchedulerConfig(speculative=SPEC)))


@pytest.fixture(scope="module")
def prompts(ex):
    tok = ex.tokenizer
    text = ("The quick brown fox jumps over the lazy dog. The dog sleeps under the old oak tree, "
            "and the fox runs into the forest before the farmer wakes up.")
    asks = [f"Repeat this text exactly, word for word:\n{text}",
            f"Rewrite this text with 'cat' in place of 'fox':\n{text}",
            "Write a short poem about rivers.",
            "List the days of the week, one per line."]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in asks]


def serve(ex, prompts, spec, arrivals=None, **kw):
    cfg = SchedulerConfig(max_total_tokens=ex.kv_capacity, max_batch_size=kw.pop("batch", 8),
                          max_num_tokens=kw.pop("chunk", 4096), speculative=spec, **kw)
    return serve_greedy(ex, prompts, cfg, NEW, arrivals)


@pytest.fixture(scope="module")
def reference(ex, prompts):
    """Each prompt alone, no speculation, one chunk."""
    out = [serve(ex, [p], None, prefix_cache=False)[0][0] for p in prompts]
    assert all(len(o) == NEW for o in out)
    return out


def test_alone_with_drafts_is_exact_and_drafts_are_kept(ex, prompts, reference):
    out, st = serve(ex, prompts[:1], SPEC, prefix_cache=False)
    assert out[0] == reference[0]
    assert st.spec_accepted_tokens >= NEW // 2      # a copy: prompt lookup drafts most of the answer


def test_batched_staggered_chunked_is_exact(ex, prompts, reference):
    out, st = serve(ex, prompts, SPEC, arrivals=[0.0, 0.0, 0.03, 0.07], chunk=23)
    assert out == reference
    assert st.spec_accepted_tokens > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_through_preemption_is_exact(ex, prompts, reference, mode):
    out, st = serve(ex, prompts, SPEC, preemption=mode, debug_preempt_every=5, chunk=31)
    assert out == reference
    assert st.preemptions > 0 and st.spec_accepted_tokens > 0


def test_prefix_cache_hit_is_exact(ex, prompts, reference):
    """The second request arrives after the first is prefilled: the chat template and the
    shared text come from the cache, in pages of 4."""
    out, st = serve(ex, prompts[:2], SPEC, arrivals=[0.0, 0.2], page_size=4)
    assert out == reference[:2]
    assert st.prefix_hit_tokens > 0 and st.spec_accepted_tokens > 0


def test_draft_model_self_speculation_is_exact(default_model_path, prompts, reference):
    """The target's own int4 weights draft for bf16: drafts are kept (they mostly agree) and
    the tokens are still exactly the bf16 model's."""
    from shepherd.engine.torch_executor import TorchExecutor
    spec = SpeculativeConfig(method="draft_model", quantization="int4", num_speculative_tokens=3,
                             disable_by_batch_size=0)
    ex2 = TorchExecutor(EngineConfig(model=default_model_path, dtype="bfloat16", max_total_tokens=CAP,
                                     host_kv_tokens=CAP, batch_invariant=True,
                                     scheduler=SchedulerConfig(speculative=spec)))
    out, st = serve(ex2, prompts[1:3], spec, arrivals=[0.0, 0.05], chunk=29)
    assert out == reference[1:3]
    assert st.spec_draft_tokens > 0 and st.spec_accepted_tokens > NEW // 4
