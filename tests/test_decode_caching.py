"""A running request's decoded blocks go into the prefix cache as they fill (vLLM's full blocks;
KVManager.cache_decoded), on the simulated executor: a request that shares a running one's
prompt and partial answer hits it; the KV events announce those blocks while it runs; the cache
stays exact (the referee executor checks every position's KV, the tree holds only true
prefixes, never a rejected draft) under preemption, swap, speculation and page sizes; and the
simulator's fast path leaves the state one-by-one stepping leaves."""
from __future__ import annotations

import random

import pytest

from shepherd.config import SchedulerConfig, SpeculativeConfig
from shepherd.engine.sim_executor import SimExecutor
from shepherd.kv_events.hashing import BLOCK_SIZE, chain_hashes
from shepherd.kv_events.tracker import BlockTracker
from shepherd.request import Request, RequestState, SamplingParams
from shepherd.scheduler.cache_events import DECODE_CACHE_BLOCK
from shepherd.scheduler.scheduler import Scheduler
from shepherd.step import StepResult
from sim_targets import run_offline
from test_kv_events import _Consumer  # the event-stream checker: no block twice, parents known, full blocks

try:
    from kv_fakes import cached_hashes
    from test_scheduler_fast_forward import drive
except ImportError:  # pragma: no cover - when tests/ is a package
    from tests.kv_fakes import cached_hashes
    from tests.test_scheduler_fast_forward import drive

EOS = 2


def _req(rid, prompt, max_tokens=100, **kw):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw),
                   eos_token_ids=(EOS,))


def _step(s: Scheduler, ex: SimExecutor, now: float) -> float:
    b = s.schedule(now)
    res = ex.execute(b) if not b.empty else StepResult()
    s.on_step(b, res, now + 1.0)
    s.check_integrity()
    return now + 1.0


def test_decode_block_size_is_the_kv_events_block():
    assert DECODE_CACHE_BLOCK == BLOCK_SIZE


@pytest.mark.parametrize("page", [1, 4, 16])
def test_a_request_sharing_a_running_answer_hits_it(page):
    s = Scheduler(SchedulerConfig(max_total_tokens=4096, page_size=page, max_num_tokens=256))
    ex = SimExecutor(kv_capacity=s.capacity, check=True)
    a = _req("a", [100 + i for i in range(40)])
    s.add(a, 0.0)
    now = 0.0
    while a.num_computed < 70:
        now = _step(s, ex, now)
    # a has computed 70 positions: its sequence up to the last 16-token boundary (64) is cached,
    # the 40 prompt tokens and 24 of its answer, while it still runs
    assert a.state is RequestState.RUNNING
    assert s.kv.tree.match_len(a.all_ids[:70]) == 64
    b = _req("b", a.all_ids[:60] + [900 + i for i in range(10)], max_tokens=4)
    s.add(b, now)
    while b.state is not RequestState.FINISHED:
        now = _step(s, ex, now)
    assert b.num_cached == 60 - 60 % page          # not just a's 40-token prompt
    # b's tokens are those of b alone (the referee checked every position's KV on the way)
    s2 = Scheduler(SchedulerConfig(max_total_tokens=4096, page_size=page, max_num_tokens=256))
    b2 = _req("b", b.prompt_ids, max_tokens=4)
    run_offline(s2, SimExecutor(kv_capacity=4096, check=True), [b2])
    assert b2.output_ids == b.output_ids and b2.num_cached == 0


def test_no_insert_per_token_with_pages_of_one():
    """Pages of 1: the cache takes the answer in 16-token blocks, not token by token."""
    s = Scheduler(SchedulerConfig(max_total_tokens=4096, page_size=1, max_num_tokens=256))
    log = s.kv.record_cache_events()
    ex = SimExecutor(kv_capacity=s.capacity, check=True)
    a = _req("a", [100 + i for i in range(20)], max_tokens=60)
    s.add(a, 0.0)
    now, added = 0.0, []
    while a.state is RequestState.RUNNING or a.state is RequestState.WAITING:
        now = _step(s, ex, now)
        added += [len(r.tokens) for r in log.drain() if type(r).__name__ == "NodeAdded"]
    # the prompt (20) at its first token; then at computed lengths 32, 48, 64; the rest at the end
    assert added == [20, 12, 16, 16, 15]



def _tree_paths(tree):
    out = []
    stack = [(c, list(c.key)) for c in tree.root.children.values()]
    while stack:
        node, path = stack.pop()
        if not node.children:
            out.append(path)
        stack.extend((c, path + list(c.key)) for c in node.children.values())
    return out


def _workload(seed, n=16, dup=True):
    """Conversations in miniature: shared system prompts, and later requests that extend an
    earlier one's prompt (so they may arrive while its answer is still being decoded)."""
    rng = random.Random(seed)
    systems = [[300 + rng.randrange(500) for _ in range(rng.randint(10, 40))] for _ in range(2)]
    reqs = []
    for i in range(n):
        if reqs and dup and rng.random() < 0.3:
            base = rng.choice(reqs)
            p = list(base.prompt_ids)     # a retry: the same prompt, the same (greedy) answer
        else:
            p = rng.choice(systems) + [900 + rng.randrange(500) for _ in range(rng.randint(1, 30))]
        r = Request(f"r{i}", p, SamplingParams(max_tokens=rng.randint(5, 70)), arrival=float(i * rng.choice([0, 2, 5])),
                    eos_token_ids=(EOS,))
        r.sim_output_len = rng.choice([None, rng.randint(3, 70)])
        reqs.append(r)
    return reqs


CASES = [
    dict(page_size=1),
    dict(page_size=4),
    dict(page_size=16),
    dict(page_size=1, debug_preempt_every=5),
    dict(page_size=4, preemption="swap", debug_preempt_every=6, host=2048),
    dict(page_size=1, speculative=SpeculativeConfig(num_speculative_tokens=3, acceptance_rate=0.6)),
    dict(page_size=4, speculative=SpeculativeConfig(num_speculative_tokens=4, acceptance_rate=0.5),
         debug_preempt_every=7),
]


@pytest.mark.parametrize("case", CASES, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items() if k != "speculative")
                         + ("-spec" if "speculative" in d else ""))
@pytest.mark.parametrize("seed", [0, 1])
def test_events_match_the_cache_and_the_cache_holds_only_true_prefixes(case, seed):
    case = dict(case)
    host = case.pop("host", 0)
    s = Scheduler(SchedulerConfig(max_total_tokens=384, max_num_tokens=48, max_batch_size=6, **case),
                  host_kv_capacity=host, max_model_len=512)
    tr, cons = BlockTracker(), _Consumer()
    log = s.kv.record_cache_events()
    sp = case.get("speculative")
    ex = SimExecutor(kv_capacity=s.capacity, host_kv_capacity=host, check=True,
                     acceptance_rate=sp.acceptance_rate if sp else 0.0)
    reqs = _workload(seed)
    decoded_blocks_seen = 0

    def obs(b, o, t0, t1):
        nonlocal decoded_blocks_seen
        s.check_integrity()
        cons.apply(tr.apply(log.drain()))
        assert cons.held == cached_hashes(s.kv.tree)
        # every cached path is a prefix of what some request has computed or will compute:
        # a rejected draft (a token the request did not take) is never cached
        seqs = [r.prompt_ids + r.output_ids for r in reqs]
        for path in _tree_paths(s.kv.tree):
            assert any(q[:len(path)] == path for q in seqs), "the cache holds a sequence no request has"
        for e in s.queues.running:
            r = e.req
            if r.num_computed - len(r.prompt_ids) >= 2 * BLOCK_SIZE:
                # a running request's answer is announced while it runs
                full = (r.num_computed // BLOCK_SIZE) * BLOCK_SIZE
                if set(chain_hashes(r.all_ids[:full])) <= cons.held:
                    decoded_blocks_seen += 1
    done = run_offline(s, ex, reqs, observer=obs)
    s.check_integrity()
    assert all(r.finish_reason is not None for r in done.values())
    assert decoded_blocks_seen > 0
    # the same tokens as with the cache off (speculation and preemption change steps, not tokens)
    s_off = Scheduler(SchedulerConfig(max_total_tokens=384, max_num_tokens=48, max_batch_size=6, prefix_cache=False,
                                      **{k: v for k, v in case.items() if k != "speculative"}),
                      host_kv_capacity=host, max_model_len=512)
    plain = _workload(seed)
    run_offline(s_off, SimExecutor(kv_capacity=384, host_kv_capacity=host, check=True), plain)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("finishing", [False, True])
def test_fast_forward_with_decode_inserts_equals_stepping(page, seed, finishing):
    """Retries (identical prompts decode identical answers: their inserts find each other's
    blocks and swap slots) and long answers across many blocks: fast-forward windows give
    exactly the states stepping gives."""
    cfg = SchedulerConfig(max_total_tokens=1024, max_batch_size=8, max_num_tokens=64, page_size=page,
                          new_token_ratio_decay_steps=50, aging_steps=60)

    def wl():
        rng = random.Random(seed)
        out = []
        t = 0.0
        for i in range(20):
            t += rng.choice([0, 0, 1, 5, 30])
            if out and rng.random() < 0.35:
                p = list(rng.choice(out).prompt_ids)
            else:
                p = [7] * rng.choice([0, 24]) + [rng.randint(3, 90) for _ in range(rng.randint(1, 40))]
            r = Request(f"r{i}", p, SamplingParams(max_tokens=rng.randint(20, 120)), arrival=t, eos_token_ids=(EOS,))
            if rng.random() < 0.5:
                r.sim_output_len = rng.randint(10, 120)
            out.append(r)
        return out
    a, b = wl(), wl()
    _, slow, _ = drive(cfg, a, fast=False)
    s, fast, ff = drive(cfg, b, fast=True, finishing=finishing)
    assert ff > 0
    slow_at = dict(slow)
    for steps, snap in fast:
        assert snap == slow_at[steps], f"diverged at step {steps}"
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert [r.num_cached for r in a] == [r.num_cached for r in b]
