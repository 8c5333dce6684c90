"""Unit tests of the routing policies on fake replica states (no I/O)."""
from __future__ import annotations

import collections

import pytest

from shepherd.routing import (
    POLICY_NAMES, ApproxRadixTree, BlockPrefixIndex, CacheAwarePolicy, NoReplicaAvailable,
    PrefixAwarePolicy, ReplicaState, RouteRequest, SessionAffinityPolicy, VTCBasicPolicy,
    WeightedPolicy, block_hashes, make_policy, parse_knobs, parse_weights, policy_knobs,
)


def reps(*loads, **kw):
    return [ReplicaState(index=i, url=f"http://r{i}", in_flight=l, **kw) for i, l in enumerate(loads)]


def req(text="", **kw):
    return RouteRequest(text=text, **kw)


PREFIX = "You are a helpful assistant. " * 20      # 580 characters: 4 blocks of 128


# --- registry and knobs -----------------------------------------------------------

def test_every_policy_builds_and_routes():
    rs = reps(0, 0, 0)
    for name in POLICY_NAMES:
        p = make_policy(name)
        r = p.choose(req(PREFIX, user="u", session="s"), rs)
        assert r in rs
        assert p.last_reason


def test_make_policy_converts_string_knobs_and_rejects_unknown():
    p = make_policy("prefix-aware", **parse_knobs(["block-size=64", "imbalance_abs_count=16",
                                                    "standard_deviation_factor=2"]))
    assert (p.block_size, p.imbalance_abs_count, p.standard_deviation_factor) == (64, 16, 2.0)
    with pytest.raises(ValueError):
        make_policy("prefix-aware", nope=1)
    with pytest.raises(ValueError):
        make_policy("no-such-policy")
    assert make_policy("rr").name == "round-robin"
    assert "block_size" in policy_knobs("prefix-aware")


def test_unhealthy_replicas_are_never_chosen():
    rs = reps(5, 0, 5)
    rs[1].healthy = False
    for name in POLICY_NAMES:
        p = make_policy(name)
        for _ in range(10):
            assert p.choose(req(PREFIX, user="u"), rs).index != 1
    for r in rs:
        r.healthy = False
    with pytest.raises(NoReplicaAvailable):
        make_policy("least-request").choose(req(), rs)


# --- load policies -----------------------------------------------------------------

def test_round_robin_cycles():
    p = make_policy("round-robin")
    rs = reps(0, 0, 0)
    assert [p.choose(req(), rs).index for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_least_request_and_tie_breaking_round_robin():
    p = make_policy("least-request")
    assert p.choose(req(), reps(3, 1, 2)).index == 1
    # ties share the work in turn instead of the first replica taking everything
    rs = reps(1, 0, 0, 0)
    assert [p.choose(req(), rs).index for _ in range(6)] in ([1, 2, 3, 1, 2, 3], [2, 3, 1, 2, 3, 1],
                                                              [3, 1, 2, 3, 1, 2])


def test_load_uses_metrics_when_larger_than_in_flight():
    rs = reps(0, 0)
    rs[0].running, rs[0].waiting = 4, 2
    assert rs[0].load == 6
    assert make_policy("least-request").choose(req(), rs).index == 1


def test_shortest_queue_counts_in_flight_only_and_rr_ties():
    rs = reps(2, 2, 1)
    rs[2].running = 50          # SGLang's controller looks at its own counts only
    p = make_policy("shortest-queue")
    assert p.choose(req(), rs).index == 2
    rs = reps(0, 0)
    assert [p.choose(req(), rs).index for _ in range(4)] in ([0, 1, 0, 1], [1, 0, 1, 0])


def test_power_of_two_never_picks_the_worst_of_two_and_is_seeded():
    rs = reps(10, 0)
    p = make_policy("power-of-two", seed=1)
    assert all(p.choose(req(), rs).index == 1 for _ in range(20))
    a = make_policy("power-of-two", seed=7)
    b = make_policy("power-of-two", seed=7)
    rs = reps(1, 2, 3, 4, 5)
    assert [a.choose(req(), rs).index for _ in range(30)] == [b.choose(req(), rs).index for _ in range(30)]
    # the most loaded of 5 can never win a pair
    assert 4 not in {a.choose(req(), rs).index for _ in range(200)}


def test_random_is_seeded_and_covers_all():
    rs = reps(0, 0, 0)
    a, b = make_policy("random", seed=3), make_policy("random", seed=3)
    sa = [a.choose(req(), rs).index for _ in range(50)]
    assert sa == [b.choose(req(), rs).index for _ in range(50)]
    assert set(sa) == {0, 1, 2}


def test_least_kv():
    rs = reps(0, 0, 9)
    rs[0].kv_usage, rs[1].kv_usage, rs[2].kv_usage = 0.8, 0.5, 0.1
    assert make_policy("least-kv").choose(req(), rs).index == 2
    rs[2].kv_usage = 0.5      # tie on KV -> fewer requests
    assert make_policy("least-kv").choose(req(), rs).index == 1


# --- prefix-aware (AIBrix) -----------------------------------------------------------

def test_block_hashes_chain_and_full_blocks_only():
    a = block_hashes(req("x" * 300), "character", 128)
    assert len(a) == 2                                   # the 44-character tail is not hashed
    b = block_hashes(req("x" * 128 + "y" * 128), "character", 128)
    assert a[0] == b[0] and a[1] != b[1]
    # same block content at a different position hashes differently (chained)
    c = block_hashes(req("y" * 128 + "x" * 128), "character", 128)
    assert c[1] != a[1]
    t = block_hashes(req(token_ids=list(range(40))), "tokens", 16)
    assert len(t) == 2 and t == block_hashes(req(token_ids=list(range(32)) + [7]), "tokens", 16)
    assert block_hashes(req("abc", hash_ids=[5, 6]), "character", 128) == [5, 6]


def test_prefix_aware_sticks_to_the_replica_with_the_prefix():
    p = PrefixAwarePolicy()
    rs = reps(0, 0, 0, 0)
    first = p.choose(req(PREFIX + "question one"), rs)
    assert p.last_reason == "miss"
    first.in_flight += 1
    for q in ("question two", "another one", "third"):
        r = p.choose(req(PREFIX + q), rs)
        assert r is first and p.last_reason == "hit"
    # an unrelated prompt goes to the least loaded, not to `first`
    other = p.choose(req("Z" * 600), rs)
    assert other is not first and p.last_reason == "miss"


def test_prefix_aware_longest_match_wins():
    p = PrefixAwarePolicy(block_size=4)
    rs = reps(0, 0, 0)
    p.index.record(block_hashes(req("aaaabbbb"), "character", 4), rs[0].key, 0)
    p.index.record(block_hashes(req("aaaabbbbcccc"), "character", 4), rs[1].key, 0)
    assert p.choose(req("aaaabbbbccccdddd"), rs) is rs[1]
    assert p.last_match == pytest.approx(3 / 4)


def test_prefix_aware_imbalance_falls_back_to_least_request():
    p = PrefixAwarePolicy(imbalance_abs_count=8)
    rs = reps(0, 0, 0)
    home = p.choose(req(PREFIX), rs)
    home.in_flight = 9                       # max - min = 9 > 8
    r = p.choose(req(PREFIX + "more"), rs)
    assert r is not home and p.last_reason == "imbalance"
    home.in_flight = 8                       # exactly the threshold is not imbalanced
    assert p.choose(req(PREFIX + "more"), rs).index in (home.index, r.index)


def test_prefix_aware_std_guard():
    # home has the prefix but sits above mean + k*std: the guard sends the request elsewhere
    p = PrefixAwarePolicy(imbalance_abs_count=100, standard_deviation_factor=1.0)
    rs = reps(0, 0, 0, 0)
    home = p.choose(req(PREFIX), rs)
    home.in_flight = 6                        # loads [6,0,0,0]: mean 1.5, std 2.6 -> limit 4.1
    r = p.choose(req(PREFIX + "x"), rs)
    assert r is not home and p.last_reason == "hot"
    # with k = 2 the limit is 6.7 and the prefix wins
    p = PrefixAwarePolicy(imbalance_abs_count=100, standard_deviation_factor=2.0)
    rs = reps(0, 0, 0, 0)
    home = p.choose(req(PREFIX), rs)
    home.in_flight = 6
    assert p.choose(req(PREFIX + "y"), rs) is home and p.last_reason == "hit"


def test_prefix_aware_guard_is_inclusive_when_all_equal():
    # std = 0: the seed's strict `<` would reject every replica and lose affinity when idle
    p = PrefixAwarePolicy()
    rs = reps(2, 2, 2)
    home = p.choose(req(PREFIX), rs)
    for _ in range(3):
        assert p.choose(req(PREFIX + "q"), rs) is home and p.last_reason == "hit"


def test_prefix_index_lru_eviction():
    idx = BlockPrefixIndex(capacity=3)
    idx.record([1, 2], "a", 0)
    idx.record([3], "b", 1)
    idx.record([1], "a", 2)          # touch 1: now 2 is the least recently used
    idx.record([4], "b", 3)
    assert 2 not in idx and all(h in idx for h in (1, 3, 4))
    assert idx.match([1, 2], ["a", "b"]) == {"a": 1}
    idx.forget("a")
    assert 1 not in idx


def test_prefix_aware_tokens_mode_and_hash_ids():
    p = make_policy("prefix-aware", tokenizer_type="tokens")
    assert p.block_size == 16
    rs = reps(0, 0)
    ids = list(range(100))
    home = p.choose(req(token_ids=ids), rs)
    home.in_flight = 1
    assert p.choose(req(token_ids=ids[:64] + [1, 2, 3]), rs) is home
    q = make_policy("prefix-aware")
    h = q.choose(req(hash_ids=[1, 2, 3]), rs)
    h.in_flight += 1
    assert q.choose(req(hash_ids=[1, 2, 9]), rs) is h


# --- cache-aware (SGLang router) ------------------------------------------------------

def test_radix_tree_match_and_split():
    t = ApproxRadixTree()
    t.insert("hello world", "a")
    t.insert("hello there", "b")
    assert t.match("hello world!", {"a", "b"}) == (11, "a")
    assert t.match("hello there", {"a", "b"}) == (11, "b")
    n, who = t.match("hello xyz", {"a", "b"})
    assert n == 6 and who in ("a", "b")
    assert t.match("hello world", {"b"}) == (6, "b")
    assert t.match("zzz", {"a", "b"}) == (0, None)
    assert t.size["a"] == 11 and t.size["b"] == 11


def test_radix_tree_lru_eviction_per_tenant():
    t = ApproxRadixTree()
    t.insert("aaaa1111", "a")       # oldest
    t.insert("bbbb2222", "a")
    t.insert("cccc3333", "a")
    t.insert("zzzz", "b")
    t.insert("bbbb2222x", "a")      # touch b-branch
    assert t.size["a"] == 25
    removed = t.evict("a", 17)
    assert removed >= 8 and t.size["a"] <= 17
    assert t.match("aaaa1111", {"a"}) == (0, None)        # least recently used went first
    assert t.match("bbbb2222x", {"a"})[0] == 9
    assert t.match("zzzz", {"b"}) == (4, "b")              # other tenants untouched
    t.remove_tenant("a")
    assert t.match("bbbb2222", {"a"}) == (0, None) and "a" not in t.size


def test_cache_aware_hit_miss_and_imbalance():
    p = CacheAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    rs = reps(0, 0, 0)
    home = p.choose(req(PREFIX + "one"), rs)
    assert p.last_reason == "miss"
    home.in_flight = 3
    assert p.choose(req(PREFIX + "two"), rs) is home and p.last_reason == "hit"
    # below the match threshold (0.3) -> least loaded
    r = p.choose(req(PREFIX[:20] + "Q" * 200), rs)
    assert r is not home and p.last_reason == "miss"
    # over both thresholds -> least loaded, even with a perfect match
    home.in_flight = 10
    r = p.choose(req(PREFIX + "three"), rs)
    assert r is not home and p.last_reason == "imbalance"
    # abs over but relative not (min 8: 13 <= 8*1.5 is false; 11 <= 12 true) -> cache wins
    for x in rs:
        x.in_flight = 8
    home.in_flight = 11
    assert p.choose(req(PREFIX + "one"), rs) is home and p.last_reason == "hit"


def test_cache_aware_tree_is_bounded():
    p = CacheAwarePolicy(max_tree_size=1000)
    rs = reps(0)
    for i in range(50):
        p.choose(req(f"{i:04d}" + "x" * 96), rs)
    assert p.tree.size[rs[0].key] <= 1000


# --- vtc-basic --------------------------------------------------------------------------

def test_vtc_light_and_heavy_users_land_apart_and_window_expires():
    p = VTCBasicPolicy(min_tokens=0, max_tokens=1000)
    rs = reps(0, 0, 0, 0)
    heavy = req(user="heavy", input_tokens=1000, now=0.0)
    r = p.choose(heavy, rs)
    p.on_dispatch(heavy, r)
    p.on_finish(heavy, r, 500)                 # 1000*1 + 500*2 = 2000
    assert p.token_count("heavy") == 2000
    light = req(user="light", input_tokens=10, now=0.5)
    p.on_dispatch(light, p.choose(light, rs))
    assert p.choose(req(user="heavy", now=1.0), rs).index == 3      # heaviest -> last position
    assert p.choose(req(user="light", now=1.0), rs).index == 0      # no usage -> first position
    # utilization pushes away from a loaded replica
    rs[3].in_flight = 100
    assert p.choose(req(user="heavy", now=1.0), rs).index != 3
    # the window forgets
    assert p.token_count("heavy", now=301.0) == 0


def test_vtc_single_user_is_routed_on_load_not_pinned():
    # one user in the window: no fairness to keep, so no replica position is preferred
    p = VTCBasicPolicy(min_tokens=0, max_tokens=1000)
    rs = reps(0, 0, 0, 0)
    seen = set()
    for i in range(8):
        r = req(user="only", input_tokens=1000, now=float(i))
        st = p.choose(r, rs)
        p.on_dispatch(r, st)
        st.in_flight += 1
        seen.add(st.index)
    assert seen == {0, 1, 2, 3}


def test_vtc_without_user_is_least_request():
    p = make_policy("vtc-basic")
    assert p.choose(req(), reps(3, 0, 2)).index == 1 and p.last_reason == "no-user"


# --- session affinity ------------------------------------------------------------------

def test_session_affinity_is_sticky_and_rendezvous_stable():
    p = SessionAffinityPolicy()
    rs = reps(*([0] * 5))
    sessions = [f"s{i}" for i in range(200)]
    before = {s: p.choose(req(headers={"x-session-id": s}), rs).index for s in sessions}
    assert len(set(before.values())) == 5                   # spread over all replicas
    assert before == {s: p.choose(req(headers={"x-session-id": s}), rs).index for s in sessions}
    # remove replica 2: only its sessions move
    survivors = [r for r in rs if r.index != 2]
    after = {s: p.choose(req(headers={"x-session-id": s}), survivors).index for s in sessions}
    for s in sessions:
        if before[s] != 2:
            assert after[s] == before[s]
    # unhealthy is the same as removed
    rs[2].healthy = False
    assert after == {s: p.choose(req(headers={"x-session-id": s}), rs).index for s in sessions}
    # session from the request field; without any, the fallback
    assert p.choose(req(session="s1"), rs).index == after["s1"]
    p2 = SessionAffinityPolicy(use_user=False)
    assert p2.choose(req(), reps(4, 0, 4)).index == 1 and p2.last_reason == "no-session"


def test_session_affinity_spills_when_asked():
    p = SessionAffinityPolicy(max_imbalance=3)
    rs = reps(0, 0, 0)
    home = p.choose(req(session="abc"), rs)
    home.in_flight = 10
    assert p.choose(req(session="abc"), rs) is not home and p.last_reason == "spill"


# --- weighted (llm-d) ------------------------------------------------------------------

def test_parse_weights():
    assert parse_weights("prefix=3, load=1") == {"prefix": 3.0, "load": 1.0}
    with pytest.raises(ValueError):
        parse_weights("bogus=1")
    with pytest.raises(ValueError):
        parse_weights("prefix=0")
    # a weight that is not a number names the scorer (it was float()'s bare message)
    with pytest.raises(ValueError, match=r"scorer weight prefix='abc': the weight must be a number"):
        parse_weights("prefix=abc,load=1")
    with pytest.raises(ValueError, match="must be >= 0"):
        parse_weights("prefix=nan")


def test_weighted_scores_normalised_and_combined():
    rs = reps(0, 4, 8)
    rs[0].kv_usage, rs[1].kv_usage, rs[2].kv_usage = 0.9, 0.5, 0.1
    p = WeightedPolicy(weights="load=1")
    assert p.choose(req(), rs).index == 0
    assert p.last_scores == {rs[0].key: 1.0, rs[1].key: 0.5, rs[2].key: 0.0}
    p = WeightedPolicy(weights="kv=1")
    assert p.choose(req(), rs).index == 2
    p = WeightedPolicy(weights="kv=1,load=1")            # 0: (0.1+1)/2, 1: (0.5+0.5)/2, 2: (0.9+0)/2
    assert p.choose(req(), rs).index == 0
    for s in p.last_scores.values():
        assert 0.0 <= s <= 1.0


def test_weighted_prefix_scorer_and_kv_filter():
    p = WeightedPolicy(weights="prefix=2,load=1", kv_filter=0.95)
    rs = reps(0, 0, 0)
    home = p.choose(req(PREFIX), rs)
    home.in_flight = 2                                         # prefix 2*1 + load 0 > 0 + 1
    assert p.choose(req(PREFIX + "x"), rs) is home and p.last_reason == "hit"
    home.kv_usage = 0.99                                       # filtered out
    assert p.choose(req(PREFIX + "y"), rs) is not home
    for r in rs:                                               # all filtered -> filter ignored
        r.kv_usage = 0.99
    assert p.choose(req(PREFIX + "z"), rs) in rs


def test_policies_are_deterministic():
    def run(name):
        p = make_policy(name)
        rs = reps(0, 0, 0, 0)
        out = []
        for i in range(100):
            r = p.choose(req(PREFIX[: (i * 37) % 580] + str(i % 7) * 200, user=f"u{i % 3}",
                             input_tokens=50, now=float(i)), rs)
            r.in_flight += 1
            p.on_dispatch(req(user=f"u{i % 3}", input_tokens=50, now=float(i)), r)
            if i % 3 == 0:
                r.in_flight -= 1
            out.append(r.index)
        return out
    for name in POLICY_NAMES:
        assert run(name) == run(name), name
    # least-request keeps the in-flight counts within one of each other
    p, rs = make_policy("least-request"), reps(0, 0, 0, 0)
    for i in range(50):
        p.choose(req(), rs).in_flight += 1
        assert max(r.in_flight for r in rs) - min(r.in_flight for r in rs) <= 1


def test_every_knob_is_documented_at_its_policy_class():
    from shepherd.routing.registry import POLICIES
    for name, cls in POLICIES.items():
        for knob in policy_knobs(name):
            assert knob in (cls.__doc__ or ""), f"{name}: knob {knob!r} not documented at {cls.__name__}"
