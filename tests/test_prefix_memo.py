"""The waiting queue's prefix matches are remembered (RadixCache.match_memo) and must
change nothing: every remembered answer equals a fresh walk of the tree, and a run with
the memo gives exactly the schedule of a run without it."""
from __future__ import annotations

import pytest

from shepherd.bench import synthetic as S
from shepherd.config import SchedulerConfig
from shepherd.scheduler.kv_pool import KVPool
from shepherd.scheduler.radix_cache import RadixCache
from shepherd.sim.simulator import SimConfig, simulate


def workload(seed: int):
    # shared system prompts, multi-turn sessions (each turn extends the last), bursts: long
    # queues whose matches grow (inserts), shrink (evictions) and end inside nodes (splits)
    spec = S.SyntheticSpec(clients=[
        S.ClientSpec("a", rate=6.0, input_len="lognormal:300:0.8", output_len="lognormal:60:0.7",
                     system_prompt_tokens=200, num_system_prompts=3, turns=3, think_time=0.5),
        S.ClientSpec("b", rate=4.0, input_len="lognormal:500:0.6", output_len="lognormal:40:0.7",
                     arrival="gamma", cv=3.0, system_prompt_tokens=120, num_system_prompts=2)],
        num_requests=220, seed=seed)
    return S.synthetic(spec)


CASES = [
    dict(max_total_tokens=6000),
    dict(max_total_tokens=6000, page_size=4),
    dict(max_total_tokens=5000, policy="lpm", preemption="swap"),
    dict(max_total_tokens=6000, policy="dfs-weight", max_batch_size=8),
    dict(max_total_tokens=6000, policy="vtc", admission="peak", max_batch_size=12),
]


def run(knobs: dict, seed: int, memo: bool, monkeypatch, checked: list):
    orig = RadixCache.match_memo

    def checking(self, m, n, ids):
        got = orig(self, m if memo else None, n, ids)
        fresh = orig(self, None, n, ids)[:2]          # walking the tree from the root
        assert got[:2] == fresh, (got[:2], fresh)     # the remembered answer is the tree's
        checked.append(m is not None and m is got[2])  # answered from the memo
        return got

    monkeypatch.setattr(RadixCache, "match_memo", checking)
    res = simulate(workload(seed), SimConfig(router="round-robin", record_batches=True,
                                             kv_capacity=knobs["max_total_tokens"],
                                             scheduler=SchedulerConfig(**knobs)))
    monkeypatch.setattr(RadixCache, "match_memo", orig)
    return res


@pytest.mark.parametrize("knobs", CASES, ids=["fcfs", "pages", "lpm-swap", "dfs", "vtc-peak"])
def test_remembered_matches_give_the_same_schedule_as_walking_the_tree(knobs, monkeypatch):
    used: list = []
    with_memo = run(knobs, 1, True, monkeypatch, used)
    without = run(knobs, 1, False, monkeypatch, [])
    assert with_memo.batches == without.batches
    assert [(r.first_token, r.finish, r.cached_tokens, r.preemptions) for r in with_memo.records] == \
           [(r.first_token, r.finish, r.cached_tokens, r.preemptions) for r in without.records]
    # the workload does what the memo must follow: hits, evictions
    assert with_memo.prefix_hit_tokens > 0 and with_memo.summary()["cache"]["evicted_tokens"] > 0
    assert sum(used) > len(used) // 4      # the memo did answer (not a test of a walk each time)


def test_memo_follows_inserts_splits_and_evictions_by_hand():
    pool = KVPool(64, 1)
    tree = RadixCache(pool)
    a = list(range(10, 30))                             # 20 tokens
    tree.insert(a, pool.alloc(20))
    q = a[:12] + [99] * 8                               # shares 12 tokens with a, then diverges
    hit, unlocked, m = tree.match_memo(None, len(q) - 1, lambda: q)
    assert (hit, unlocked) == (12, 12) and m.child is not None and m.partial == 12
    # nothing changed: answered without calling ids()
    assert tree.match_memo(m, len(q) - 1, lambda: pytest.fail("walked again"))[:2] == (12, 12)
    # another request's insert splits a's node inside q's match (at 6): q's answer is walked again
    b = a[:6] + [77] * 4
    tree.insert(b, pool.alloc(10))
    assert not m.holds(len(q) - 1)
    hit, unlocked, m = tree.match_memo(m, len(q) - 1, lambda: q)
    assert (hit, unlocked) == (12, 12)
    # q's own continuation cached: the match grows to 19 (n = len - 1)
    tree.insert(q, pool.alloc(20))
    hit, _, m = tree.match_memo(m, len(q) - 1, lambda: q)
    assert hit == 19
    # a lock on the path: same match, fewer unlocked tokens, no walk
    _, node = tree.match_prefix(a[:6], touch=False)
    tree.inc_lock_ref(node)
    assert tree.match_memo(m, len(q) - 1, lambda: pytest.fail("walked again"))[:2] == (19, 13)
    tree.dec_lock_ref(node)
    # evicting everything: the match is gone
    tree.evict(10 ** 6)
    hit, unlocked, m = tree.match_memo(m, len(q) - 1, lambda: q)
    assert (hit, unlocked) == (0, 0)
