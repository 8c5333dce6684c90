"""adapter-affinity (routing/adapters.py): an adapter's requests go where it is loaded, a hot one
spreads once its holders are loaded `max_imbalance` past the least-loaded replica, base-model
requests go to the least-loaded replica; and the simulator's fleet uses it."""
from __future__ import annotations

import collections

from shepherd.bench import synthetic as S
from shepherd.bench.records import TraceRequest
from shepherd.config import SchedulerConfig
from shepherd.routing.base import ReplicaState, RouteRequest
from shepherd.routing.registry import make_policy
from shepherd.sim.cost_model import RooflineCostModel
from shepherd.sim.simulator import SimConfig, simulate


def reps(n):
    return [ReplicaState(index=i, url=f"http://r{i}") for i in range(n)]


def send(p, rs, adapter):
    rq = RouteRequest(adapter=adapter)
    r = p.choose(rq, rs)
    r.in_flight += 1
    p.on_dispatch(rq, r)
    return r.index


def test_sticks_to_the_replica_that_holds_the_adapter():
    p, rs = make_policy("adapter-affinity", max_imbalance=3), reps(3)
    first = send(p, rs, "A")
    assert p.last_reason == "miss"
    assert [send(p, rs, "A") for _ in range(3)] == [first] * 3 and p.last_reason == "hit"
    # B goes to another replica (least loaded), then sticks there too
    b = send(p, rs, "B")
    assert b != first and send(p, rs, "B") == b


def test_a_hot_adapter_spreads_past_the_imbalance_and_then_uses_both():
    p, rs = make_policy("adapter-affinity", max_imbalance=2), reps(2)
    got = [send(p, rs, "hot") for _ in range(4)]
    # loads 0/0: r0 (miss); 1-0 <= 2: r0; 2-0 <= 2: r0; 3-0 > 2: spread to r1
    assert got == [0, 0, 0, 1] and p.last_reason == "spread"
    assert p.holds(rs[1], "hot")
    assert send(p, rs, "hot") == 1      # both hold it now: the less loaded of the two


def test_replicas_reported_adapters_count_and_base_goes_least_loaded():
    p, rs = make_policy("adapter-affinity"), reps(3)
    rs[2].adapters = frozenset({"X"})
    rs[0].in_flight = 5
    assert send(p, rs, "X") == 2 and p.last_reason == "hit"
    assert send(p, rs, None) == 1 and p.last_reason == "base"
    rs[2].healthy = False                 # its holder is gone: any healthy replica, least loaded
    assert send(p, rs, "X") == 1 and p.last_reason == "miss"


def test_remembers_at_most_max_loras_per_replica():
    p, rs = make_policy("adapter-affinity", max_loras=2), reps(1)
    for a in ("A", "B", "C"):
        send(p, rs, a)
    assert not p.holds(rs[0], "A") and p.holds(rs[0], "B") and p.holds(rs[0], "C")
    p.forget(rs[0].key)
    assert not p.holds(rs[0], "C")


def test_simulated_fleet_loads_fewer_adapters_with_affinity():
    """4 replicas, 32 Zipf adapters, --max-loras 4: routing by adapter means each replica
    serves a few adapters, so fewer loads than least-request, which sends every adapter
    everywhere."""
    cost = RooflineCostModel("smollm2-135m", "cpu")
    base = [TraceRequest(arrival=0.02 * i, prompt_tokens=32, output_tokens=16, index=i) for i in range(400)]

    def run(router):
        tr = list(S.with_adapters(iter([TraceRequest(**vars(t)) for t in base]), S.adapter_names(32), 1.0, 0))
        res = simulate(tr, SimConfig(model="smollm2-135m", gpu="cpu", replicas=4, router=router,
                                     scheduler=SchedulerConfig(max_loras=4), kv_capacity=4096,
                                     adapter_load_time=0.02), cost)
        assert len(res.records) == 400 and all(r.ok for r in res.records)
        per = collections.Counter()
        for r, t in zip(sorted(res.records, key=lambda r: int(r.req_id[1:])), tr):
            per[(r.replica, t.adapter)] += 1
        return res, len(per)
    (_, pairs_aff), (_, pairs_lr) = run("adapter-affinity"), run("least-request")
    assert pairs_aff < pairs_lr


def test_gateway_reads_adapters_and_base_names_from_metrics():
    from shepherd.gateway.backends import parse_lora_info
    from shepherd.gateway.intake import route_request_from
    text = ('# HELP vllm:lora_requests_info Running stats on LoRA requests.\n'
            'vllm:num_requests_running{model_name="base"} 3.0\n'
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a1,a2",waiting_lora_adapters="a3"} '
            '1.7e+09\n')
    assert parse_lora_info(text) == (frozenset({"a1", "a2", "a3"}), frozenset({"base"}))
    assert parse_lora_info("vllm:num_requests_running 1\n") == (frozenset(), frozenset())
    p, rs = make_policy("adapter-affinity"), reps(2)
    rs[1].adapters, rs[0].base_models, rs[1].base_models = frozenset({"a2"}), frozenset({"base"}), frozenset({"base"})
    rs[1].in_flight = 4
    rq = route_request_from({"model": "a2", "prompt": "hi"}, "completions", {}, 0.0)
    assert rq.adapter == "a2" and p.choose(rq, rs).index == 1 and p.last_reason == "hit"
    base = route_request_from({"model": "base", "prompt": "hi"}, "completions", {}, 0.0)
    assert p.choose(base, rs).index == 0 and p.last_reason == "base"
