"""With the real model (greedy, batch-invariant), a request's tokens do not depend
on being preempted (recompute or swap), on chunked prefill, or on the prefix
cache: every run below must produce exactly the undisturbed run's tokens."""
from __future__ import annotations

import pytest

from shepherd.config import EngineConfig, SchedulerConfig
from greedy_runs import serve_greedy

pytestmark = pytest.mark.model

CAP = 2048
NEW = 8


@pytest.fixture(scope="module")
def ex(default_model_path):
    from shepherd.engine.torch_executor import TorchExecutor
    e = TorchExecutor(EngineConfig(model=default_model_path, dtype="bfloat16", max_total_tokens=CAP,
                                   host_kv_tokens=CAP, batch_invariant=True))
    assert e.host_kv_capacity >= CAP
    return e


@pytest.fixture(scope="module")
def prompts(ex):
    tok = ex.tokenizer
    system = "You are a careful assistant. Answer in one short paragraph."
    qs = ["What is a comet?", "Name a river in Africa.", "Why is the sky blue?"]
    return [tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                                {"role": "user", "content": q}])) for q in qs]


def serve(ex, prompts, **kw):
    cfg = SchedulerConfig(max_total_tokens=ex.kv_capacity, max_batch_size=8, max_num_tokens=kw.pop("chunk", 48),
                          admission="optimistic", **kw)
    return serve_greedy(ex, prompts, cfg, NEW, [0.0 if i < 2 else 0.05 * i for i in range(len(prompts))])


@pytest.fixture(scope="module")
def reference(ex, prompts):
    out, st = serve(ex, prompts, prefix_cache=False, chunk=4096)
    assert all(len(o) == NEW for o in out)
    return out


@pytest.mark.parametrize("mode,prefix", [("recompute", True), ("swap", False)])
def test_forced_preemption_does_not_change_tokens(ex, prompts, reference, mode, prefix):
    out, st = serve(ex, prompts, preemption=mode, prefix_cache=prefix,
                    debug_preempt_every=3)
    assert st.preemptions >= 3
    if mode == "swap":
        assert st.swap_out_tokens > 0 and st.swap_in_tokens == st.swap_out_tokens
    assert out == reference


def test_prefix_cache_on_equals_off(ex, prompts, reference):
    # the 4th request repeats the 1st: all but its last prompt token come from the cache
    out, st = serve(ex, prompts + prompts[:1], prefix_cache=True, chunk=32)
    assert st.prefix_hit_tokens >= len(prompts[0]) - 1   # shared system prompt + the repeat
    assert out[:len(prompts)] == reference and out[-1] == reference[0]
