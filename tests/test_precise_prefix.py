"""The precise-prefix policy and scorer over an index fed with KV events, and the simulator
running the same router with every replica's cache known exactly."""
from __future__ import annotations

import pytest

from shepherd.bench.synthetic import ClientSpec, SyntheticSpec, synthetic
from shepherd.config import SchedulerConfig
from shepherd.kv_events.events import BlockRemoved, BlockStored
from shepherd.kv_events.hashing import chain_hashes
from shepherd.routing import ReplicaState, RouteRequest, make_policy
from shepherd.sim.simulator import SimConfig, Simulator

try:
    from kv_fakes import cached_hashes
except ImportError:  # pragma: no cover - when tests/ is a package
    from tests.kv_fakes import cached_hashes


def stored(tokens):
    return BlockStored(chain_hashes(tokens), None, list(tokens[:16 * (len(tokens) // 16)]), 16)


def replicas(n=3):
    return [ReplicaState(index=i, url=f"http://r{i}") for i in range(n)]


def route(policy, reps, tokens, finish=True):
    rr = RouteRequest(token_ids=list(tokens))
    r = policy.choose(rr, reps)
    r.in_flight += 1
    policy.on_dispatch(rr, r)
    if finish:
        r.in_flight -= 1
        policy.on_finish(rr, r, 0)
    return r, rr


def test_longest_cached_run_wins_and_an_eviction_is_seen():
    pol = make_policy("precise-prefix")
    reps = replicas()
    sys_prompt = list(range(1, 65))                     # 4 blocks, cached on r0 and r1
    conv = sys_prompt + list(range(500, 564))           # 8 blocks, the conversation cached on r1 only
    pol.kv_index.apply("http://r0", [stored(sys_prompt)])
    pol.kv_index.apply("http://r1", [stored(conv)])
    r, _ = route(pol, reps, conv + [9, 9, 9])
    assert r.url == "http://r1" and pol.last_reason == "hit" and pol.last_match == pytest.approx(128 / 131)
    pol.kv_index.apply("http://r1", [BlockRemoved(chain_hashes(conv)[4:])])      # r1 evicts the tail
    reps[0].running = 5                                  # both now hold 4 blocks: the less loaded wins
    r, _ = route(pol, reps, conv)
    assert r.url == "http://r1"
    reps[0].running, reps[1].running = 0, 5
    r, _ = route(pol, reps, conv)
    assert r.url == "http://r0" and pol.last_reason == "hit"


def test_in_flight_prompts_count_before_any_event_arrives():
    """A burst sharing a new prefix lands together: the first request's KV is being computed
    where it went, so the others follow it instead of computing it again elsewhere."""
    pol = make_policy("precise-prefix")
    reps = replicas()
    doc = list(range(1000, 1320))                        # 20 blocks, cached nowhere yet
    first, _ = route(pol, reps, doc + [1], finish=False)
    assert pol.last_reason == "miss"
    for q in range(2, 5):
        r, _ = route(pol, reps, doc + [q], finish=False)
        assert r is first and pol.last_reason == "hit"


def test_new_prefixes_go_where_fewer_tokens_have_been_entering_the_cache():
    pol = make_policy("precise-prefix")
    reps = replicas()
    seen = [route(pol, reps, list(range(k * 1000, k * 1000 + 400)))[0].url for k in range(1, 7)]
    assert sorted(seen) == sorted([r.url for r in reps] * 2)      # six distinct prompts, two each
    pol0 = make_policy("precise-prefix", pressure_weight=0)       # without it: by load alone (all idle)
    assert route(pol0, replicas(), list(range(400)))[0].url == "http://r0"


def test_load_gap_over_both_thresholds_goes_to_the_least_loaded():
    pol = make_policy("precise-prefix", balance_abs_threshold=4, balance_rel_threshold=1.5)
    reps = replicas(2)
    p = list(range(200))
    pol.kv_index.apply("http://r0", [stored(p)])
    reps[0].running, reps[1].running = 10, 1
    r, _ = route(pol, reps, p)
    assert r.url == "http://r1" and pol.last_reason == "imbalance"


def test_precise_scorer_inside_the_weighted_policy():
    pol = make_policy("weighted", weights="precise=3,load=1")
    reps = replicas()
    p = list(range(7, 107))
    pol.kv_index.apply("http://r2", [stored(p)])
    reps[2].running = 2
    r, _ = route(pol, reps, p)
    assert r.url == "http://r2" and pol.last_reason == "hit"
    assert pol.last_scores["http://r2"] > pol.last_scores["http://r0"]


def _trace(n=240):
    spec = SyntheticSpec(clients=[ClientSpec(name="chat", rate=2.0, input_len="uniform:100:300",
                                             output_len="uniform:20:60", system_prompt_tokens=200,
                                             num_system_prompts=2, turns=6, think_time=5.0)],
                         num_requests=n, seed=3)
    return synthetic(spec)


def _sim(router, trace, **knobs):
    cfg = SimConfig(replicas=3, router=router, router_knobs=knobs, kv_capacity=6000, model="llama-3-8b",
                    scheduler=SchedulerConfig(max_total_tokens=6000), timeseries=False)
    sim = Simulator(cfg)
    return sim, sim.run(trace)


def test_the_simulator_feeds_the_router_every_replica_cache_exactly():
    trace = _trace()
    sim, res = _sim("precise-prefix", trace)
    index = sim.policy.kv_index
    for rep in sim.replicas:
        truth = cached_hashes(rep.sched.kv.tree)
        assert index.blocks(rep.idx) == len(truth) and all(index.holds(rep.idx, h) for h in truth)
    assert sum(r["evicted_tokens"] for r in res.replicas) > 0          # the caches were under pressure
    _, ca = _sim("cache-aware", trace, tokenizer_type="tokens")
    _, lr = _sim("least-request", trace)
    assert res.prefix_hit_rate > ca.prefix_hit_rate > lr.prefix_hit_rate
    assert res.balance()["requests"] <= ca.balance()["requests"]


def test_a_sessions_next_turn_finds_the_previous_answer_cached():
    """The simulated answer continues the session's stream, so turn 1's prompt (turn 0's prompt,
    its answer, a new message) hits everything turn 0 left in the cache: prompt + answer - 1."""
    from shepherd.bench.records import TraceRequest
    g = dict(prefix_group="sys", prefix_tokens=40, session="s", client="c")
    trace = [TraceRequest(arrival=0.0, prompt_tokens=100, output_tokens=30, index=0, turn=0, **g),
             TraceRequest(arrival=60.0, prompt_tokens=100 + 30 + 50, output_tokens=10, index=1, turn=1, **g)]
    cfg = SimConfig(replicas=1, kv_capacity=4096, scheduler=SchedulerConfig(max_total_tokens=4096), timeseries=False)
    res = Simulator(cfg).run(trace)
    first, second = sorted(res.records, key=lambda r: r.arrival)
    assert first.cached_tokens == 0 and second.cached_tokens == 100 + 30 - 1
    assert res.hit_rate_bounds["infinite_hit_tokens"] == 129


def test_fleet_sim_replays_a_trace_file(tmp_path):
    # benchmarks/fleet_sim.py runs the routers on any trace file shepherd reads (here Mooncake's
    # schema with hash_ids), not only its two built-in workloads
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "fleet_sim.py"), "--trace",
                          str(root / "tests" / "data" / "mooncake_5.jsonl"), "--routers", "precise-prefix",
                          "--replicas", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr
    assert "mooncake_5.jsonl (5 requests" in out.stdout
    assert "| precise-prefix | defaults |" in out.stdout
    bad = subprocess.run([sys.executable, str(root / "benchmarks" / "fleet_sim.py"), "--trace",
                          str(tmp_path / "absent.jsonl")], capture_output=True, text=True, timeout=60, cwd=root)
    assert bad.returncode == 2 and "neither sessions nor mooncake nor a file" in bad.stderr


def test_the_gateway_run_replays_the_simulators_sessions_trace_scaled(monkeypatch):
    # benchmarks/fleet_gateway.py plays fleet_sim.py's own sessions trace (the command it prints gives
    # the simulator the same requests on 3 replicas), and each turn it sends is the previous prompt,
    # the replica's answer (whatever its ids) and the trace's new tokens, as long as the trace's prompt
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import fleet_gateway
    import fleet_sim
    g = fleet_gateway.parse(["--requests", "60"])
    s = fleet_sim.parser().parse_args(fleet_gateway.sim_command(g).split()[2:])
    assert (s.replicas, s.kv_capacity) == (3, g.kv_capacity)
    trace = fleet_gateway.session_trace(g)
    assert trace == synthetic(fleet_sim.workload(s)) and len(trace) == 60
    held: dict = {}
    later = 0
    for tr in trace:
        prev = held.get(tr.session, [])
        p = fleet_gateway.turn_prompt(prev, tr)
        assert p[:len(prev)] == prev and len(p) == tr.prompt_tokens
        later += bool(prev)
        held[tr.session] = p + [1000 + tr.turn] * tr.output_tokens    # an answer of the asked length
    assert later > 20
    firsts = [fleet_gateway.turn_prompt([], tr) for tr in trace if tr.turn == 0]
    shared = {tuple(p[:g.system_tokens]) for p in firsts}
    assert len(shared) <= g.system_prompts < len(firsts)     # turn 1 opens with a shared system prompt
