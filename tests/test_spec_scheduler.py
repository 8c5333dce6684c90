"""Speculative decoding, the scheduler's half, on the simulated executor (no model): drafts
count against max_num_tokens and the KV budget, rejected drafts give their slots back, the
tokens are the ones decoding one at a time gives, and speculation turns off above
disable_by_batch_size and under admission=peak."""
from __future__ import annotations

import random

import pytest

from shepherd.config import ConfigError, SchedulerConfig, SpeculativeConfig
from shepherd.engine.sim_executor import SimExecutor
from shepherd.request import FinishReason, Request, RequestState, SamplingParams
from shepherd.scheduler.scheduler import Scheduler
from sim_targets import run_offline

EOS = 2


def mk(rid, n=12, max_tokens=40, out=None, base=100, **kw):
    r = Request(rid, [base + (i * 7 + len(rid)) % 97 for i in range(n)], SamplingParams(max_tokens=max_tokens, **kw),
                eos_token_ids=(EOS,))
    if out is not None:
        r.sim_output_len = out
    return r


def spec(k=3, acc=0.7, off_above=0, **kw):
    return SpeculativeConfig(num_speculative_tokens=k, acceptance_rate=acc, disable_by_batch_size=off_above, **kw)


def run(reqs, sp=None, acc=None, **kw):
    """Run reqs to the end with the referee executor; every batch recorded, integrity checked every step."""
    host = kw.pop("host", 0)
    s = Scheduler(SchedulerConfig(speculative=sp, **kw), host_kv_capacity=host, max_model_len=8192)
    ex = SimExecutor(kv_capacity=s.capacity, host_kv_capacity=s.host_kv_capacity, check=True,
                     acceptance_rate=sp.acceptance_rate if sp else 0.0)
    batches = []

    def obs(b, o, t0, t1):
        batches.append(b)
        s.check_integrity()
    done = run_offline(s, ex, reqs, observer=obs)
    s.check_integrity()
    return s, done, batches


def outputs(done):
    return {rid: (list(r.output_ids), r.finish_reason) for rid, r in done.items()}


def workload(seed, n=12):
    rng = random.Random(seed)
    return [mk(f"r{i}", n=rng.randint(3, 40), max_tokens=rng.randint(1, 60),
               out=rng.choice([None, rng.randint(1, 60)])) for i in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_tokens_fewer_steps(seed):
    """Speculation changes how many steps a request takes, never its tokens."""
    _, plain, pb = run(workload(seed), max_total_tokens=2048, max_num_tokens=64)
    s, fast, fb = run(workload(seed), spec(), max_total_tokens=2048, max_num_tokens=64)
    assert outputs(fast) == outputs(plain)
    st = s.stats()
    assert st.spec_draft_tokens > 0 and 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    assert len(fb) < len(pb)
    assert st.generated_tokens == sum(len(r.output_ids) for r in plain.values())


def test_prefill_cap_beside_verify_rows_counts_prompt_tokens_only():
    """max_prefill_tokens_with_decodes caps the prompt tokens beside decodes; a decode's drafts are
    not prompt tokens, and the tokens come out as without speculation."""
    reqs = workload(3)
    s = Scheduler(SchedulerConfig(speculative=spec(), max_total_tokens=2048, max_num_tokens=64,
                                  max_prefill_tokens_with_decodes=8), max_model_len=8192)
    ex = SimExecutor(kv_capacity=s.capacity, check=True, acceptance_rate=0.7)
    beside = []

    def obs(b, o, t0, t1):
        st = s.stats()
        if st.last_decode_seqs:
            beside.append((st.last_prefill_tokens, sum(q.num_draft for q in b.seqs)))
        s.check_integrity()
    fast = run_offline(s, ex, reqs, observer=obs)
    assert max(p for p, _ in beside) == 8 and any(d for _, d in beside)
    _, plain, _ = run(workload(3), max_total_tokens=2048, max_num_tokens=64)
    assert outputs(fast) == outputs(plain)


def test_acceptance_all_and_none():
    s1, done1, _ = run([mk("a", max_tokens=30)], spec(k=4, acc=1.0), max_total_tokens=512)
    st = s1.stats()
    assert st.spec_accepted_tokens == st.spec_draft_tokens > 0      # every draft kept
    assert len(done1["a"].output_ids) == 30
    s0, done0, b0 = run([mk("a", max_tokens=30)], spec(k=4, acc=0.0), max_total_tokens=512)
    st = s0.stats()
    assert st.spec_accepted_tokens == 0 and st.spec_draft_tokens > 0
    assert done0["a"].output_ids == done1["a"].output_ids
    assert all(s.num_draft <= 1 for b in b0 for s in b.seqs)        # a wrong token is all it drafts


def test_drafts_count_against_max_num_tokens():
    """4 decoders, k = 3: 16 rows wanted, 6 allowed: each decoder's own token first, drafts share the rest."""
    reqs = [mk(f"r{i}", n=4, max_tokens=50) for i in range(4)]
    s, done, batches = run(reqs, spec(k=3, acc=1.0), max_total_tokens=1024, max_num_tokens=6)
    assert all(b.num_tokens <= 6 for b in batches)
    verify = [b for b in batches if any(x.num_draft for x in b.seqs)]
    assert verify and all(sum(x.num_draft for x in b.seqs) <= 6 - len(b.seqs) for b in verify)
    assert all(len(done[r.req_id].output_ids) == 50 for r in reqs)


def test_drafts_never_past_the_length_limit():
    reqs = [mk(f"r{i}", max_tokens=m) for i, m in enumerate((1, 2, 3, 5, 9))]
    _, done, batches = run(reqs, spec(k=4, acc=1.0), max_total_tokens=1024)
    final = {r.req_id: len(r.prompt_ids) + r.params.max_tokens - 1 for r in reqs}
    for b in batches:
        for x in b.seqs:
            assert x.end_pos <= final[x.req_id]
    for r in reqs:
        assert len(done[r.req_id].output_ids) == r.params.max_tokens
        assert done[r.req_id].finish_reason is FinishReason.LENGTH


def test_stop_token_in_accepted_drafts_ends_the_request():
    reqs = [mk("a", max_tokens=60, out=7), mk("b", max_tokens=60, out=13)]
    _, done, _ = run(reqs, spec(k=4, acc=1.0), max_total_tokens=1024)
    assert len(done["a"].output_ids) == 7 and done["a"].output_ids[-1] == EOS
    assert len(done["b"].output_ids) == 13 and done["b"].finish_reason is FinishReason.STOP


def test_drafts_take_free_kv_only_and_rejected_slots_come_back():
    s = Scheduler(SchedulerConfig(max_total_tokens=64, speculative=spec(k=3, acc=0.0)), max_model_len=8192)
    ex = SimExecutor(kv_capacity=64, check=True, acceptance_rate=0.0)
    r = mk("a", n=10, max_tokens=40)
    s.add(r, 0.0)
    ex.output_lens = {}
    b = s.schedule(0.0)                                   # the prefill (asks for drafts)
    assert b.seqs[0].propose == 3
    s.on_step(b, ex.execute(b), 0.0)
    e = s.queues.get("a")
    e.drafts = [5, 6, 7]
    held = s.kv.pool.alloc(s.kv.pool.free_pages - 2)      # another owner takes all but 2 pages
    b = s.schedule(0.0)
    x = b.seqs[0]
    assert x.num_draft == 1 and len(r.slots) == r.num_computed + 2    # its own token, one draft: no preemption
    assert s.stats().preemptions == 0
    s.on_step(b, ex.execute(b), 0.0)
    assert len(r.slots) == r.num_computed and s.kv.pool.free_pages == 1   # the rejected draft's slot is free again
    s.kv.pool.free(held)
    s.check_integrity()


def test_off_above_disable_by_batch_size():
    """Five decoders: no drafts asked or fed; once one finishes (four left), drafts again."""
    reqs = [mk(f"r{i}", n=5, max_tokens=6 if i == 0 else 30) for i in range(5)]
    _, done, batches = run(reqs, spec(k=3, acc=1.0, off_above=4), max_total_tokens=2048)
    five = [b for b in batches if sum(not x.is_prefill for x in b.seqs) == 5]
    assert five and not any(x.num_draft or x.propose for b in five for x in b.seqs)
    after = batches[batches.index(five[-1]) + 1:]
    assert any(x.num_draft for b in after for x in b.seqs)
    assert all(len(done[r.req_id].output_ids) == r.params.max_tokens for r in reqs)


def test_peak_admission_never_speculates():
    reqs = [mk(f"r{i}", max_tokens=20) for i in range(3)]
    _, done, batches = run(reqs, spec(k=3, acc=1.0), admission="peak", max_total_tokens=2048)
    assert not any(x.num_draft or x.propose for b in batches for x in b.seqs)
    assert all(len(done[r.req_id].output_ids) == 20 for r in reqs)


@pytest.mark.parametrize("seed", [3, 4])
def test_under_preemption_prefix_cache_and_pages(seed):
    """Tight KV (optimistic admission preempts), forced preemptions, shared prefixes, pages of 4:
    the referee checks every position's KV, integrity holds every step, tokens as without drafts."""
    def wl():
        rng = random.Random(seed)
        shared = [300 + i for i in range(16)]
        out = []
        for i in range(14):
            p = (shared if i % 2 else []) + [400 + rng.randint(0, 50) for _ in range(rng.randint(2, 20))]
            r = Request(f"r{i}", p, SamplingParams(max_tokens=rng.randint(5, 40)), eos_token_ids=(EOS,))
            r.sim_output_len = rng.choice([None, rng.randint(2, 40)])
            out.append(r)
        return out
    kw = dict(max_total_tokens=160, page_size=4, max_num_tokens=24, debug_preempt_every=7)
    _, plain, _ = run(wl(), **kw)
    s, fast, _ = run(wl(), spec(k=3, acc=0.8), **kw)
    assert outputs(fast) == outputs(plain)
    assert s.stats().preemptions > 0 and s.stats().spec_accepted_tokens > 0
    s, fast2, _ = run(wl(), spec(k=3, acc=0.8), preemption="swap", host=1024, **kw)
    assert outputs(fast2) == outputs(plain)
    assert s.stats().swap_out_tokens > 0


def test_speculative_config_json():
    assert SpeculativeConfig.from_json(None) is None
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert c.num_speculative_tokens == 5 and c.prompt_lookup_max == 4
    for bad in ('{"method": "eagle"}', '{"num_speculative_tokens": 0}', '{"bogus": 1}', '[1]', 'nope',
                '{"method": "draft_model"}', '{"prompt_lookup_min": 5, "prompt_lookup_max": 2}'):
        with pytest.raises(ConfigError):
            SpeculativeConfig.from_json(bad)
