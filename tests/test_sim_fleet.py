"""Issue 30 items 4-5: prefill/decode disaggregation and heterogeneous fleets in the
simulator, by hand-computed cases (a time model whose steps cost fixed milliseconds)."""
from __future__ import annotations

import pytest

from shepherd.bench.records import TraceRequest
from shepherd.bench.report import format_table
from shepherd.sim.fitted_cost import DistServeCostModel
from shepherd.sim.fleet import FleetCost, PDConfig, ReplicaGroup, parse_fleet, parse_prices
from shepherd.sim.simulator import SimConfig, Simulator

KV_BYTES = 1000            # per token: 100 prompt tokens cross a 1 MB/s link in 0.1 s


def fixed_steps(prefill_ms=10.0, decode_ms=5.0) -> DistServeCostModel:
    """Every step that computes a prompt costs prefill_ms, every decode-only step decode_ms
    (DistServe's time model with only its constant terms)."""
    co = {"prefill": [prefill_ms, 0, 0], "decoding_smallbs": [decode_ms, 0, 0],
          "decoding_largebs": [decode_ms, 0, 0], "decoding_large_small_bs_threshold": 1000}
    return DistServeCostModel("toy", 1, co, kv_capacity=100_000, kv_bytes_per_token=KV_BYTES, pcie_bw=25e9,
                              source="test")


def pd_sim(threshold=0, **kw) -> Simulator:
    cfg = SimConfig(model="opt-13b", fleet=[ReplicaGroup(1, "a100-80gb", 1, "prefill"),
                                            ReplicaGroup(1, "a100-80gb", 1, "decode")],
                    pd=PDConfig(threshold=threshold, link_bw=1e6, link_latency=0.01), progress=False, **kw)
    return Simulator(cfg, fixed_steps())


def test_a_disaggregated_request_prefills_on_one_replica_crosses_the_link_and_decodes_on_the_other():
    sim = pd_sim()
    res = sim.run([TraceRequest(arrival=0.0, prompt_tokens=100, output_tokens=4, index=0)])
    rec = res.records[0]
    # prefill replica: one 10 ms step samples the first token (TTFT 10 ms); the KV crosses in
    # 0.01 + 100 x 1000 / 1e6 = 0.11 s, landing at 0.12; the decode replica then runs three
    # 5 ms decode steps (the prompt's KV arrived: nothing is prefilled there)
    assert rec.ok and rec.output_tokens == 4
    assert rec.ttft == pytest.approx(0.010)
    assert rec.token_times == pytest.approx([0.010, 0.125, 0.130, 0.135])
    assert rec.replica == 1                                  # the decode replica
    assert ("transfer", pytest.approx(0.010), pytest.approx(0.120)) in rec.intervals
    s = res.summary()
    d = s["disaggregation"]
    assert (d["disaggregated"], d["prefilled_locally"]) == (1, 0)
    assert d["transfer_s_mean"] == pytest.approx(0.11) and d["transfer_tokens"] == 100
    pre, dec = s["replicas"]
    assert (pre["role"], dec["role"]) == ("prefill", "decode")
    assert pre["busy_s"] == pytest.approx(0.010) and dec["busy_s"] == pytest.approx(0.015)
    assert pre["steps"] == 1 and dec["steps"] == 3
    assert "1 prefilled on prefill replicas" in format_table(s)


def test_the_conditional_decider_prefills_short_uncached_prompts_where_they_decode():
    # threshold 50: a 100-token prompt goes to the prefill replica; a second one sharing 96
    # of its tokens finds them cached on the decode replica (4 uncached) and is prefilled there
    sim = pd_sim(threshold=50)
    trace = [TraceRequest(arrival=0.0, prompt_tokens=100, output_tokens=4, index=0, prefix_group="sys",
                          prefix_tokens=96),
             TraceRequest(arrival=1.0, prompt_tokens=100, output_tokens=4, index=1, prefix_group="sys",
                          prefix_tokens=96)]
    res = sim.run(trace)
    d = res.summary()["disaggregation"]
    assert (d["disaggregated"], d["prefilled_locally"]) == (1, 1)
    second = max(res.records, key=lambda r: r.arrival)
    # local: one 10 ms prefill step (the uncached tail) then 5 ms decodes, no transfer
    assert second.token_times == pytest.approx([1.010, 1.015, 1.020, 1.025])
    assert not any(iv[0] == "transfer" for iv in second.intervals)
    # a short prompt under the threshold is never sent
    res = pd_sim(threshold=200).run([TraceRequest(arrival=0.0, prompt_tokens=100, output_tokens=2, index=0)])
    assert res.summary()["disaggregation"]["disaggregated"] == 0
    assert res.records[0].token_times == pytest.approx([0.010, 0.015])


def test_a_prompt_the_prefill_replica_refuses_is_a_counted_rejection_and_frees_its_decode_route():
    sim = pd_sim()
    res = sim.run([TraceRequest(arrival=0.0, prompt_tokens=3000, output_tokens=4, index=0),   # > OPT's 2,048
                   TraceRequest(arrival=0.5, prompt_tokens=100, output_tokens=2, index=1)])
    by_arrival = sorted(res.records, key=lambda r: r.arrival)
    assert not by_arrival[0].ok and by_arrival[0].error_kind == "context_length"
    assert by_arrival[1].ok
    assert res.rejections["context_length"]["count"] == 1
    assert all(st.in_flight == 0 for st in sim._router.states)     # nothing left counted in flight


def test_a_heterogeneous_fleet_prices_each_group_with_its_own_gpu():
    cfg = SimConfig(model="llama-3-8b", fleet=parse_fleet("1xh200,1xa100-80gb"), router="round-robin",
                    progress=False)
    sim = Simulator(cfg)
    assert [c.name for c in sim.costs] == ["roofline:Llama-3-8B/H200", "roofline:Llama-3-8B/A100-80GB"]
    trace = [TraceRequest(arrival=0.0, prompt_tokens=512, output_tokens=64, index=i) for i in range(2)]
    res = sim.run(trace)
    on = {r.replica: r for r in res.records}
    assert on[0].e2e < on[1].e2e            # the same request decodes faster on the H200 (more bandwidth)
    caps = [r["kv_capacity_tokens"] for r in res.replicas]
    assert caps[0] > caps[1]                 # 141 GB against 80 GiB
    # one cost model handed in cannot price two GPU types
    with pytest.raises(ValueError, match="several GPU types"):
        Simulator(cfg, fixed_steps())


def test_fleet_cost_by_hand():
    groups = parse_fleet("1xh100,1xa100-80gb/tp2")
    assert [g.label() for g in groups] == ["1xh100", "1xa100-80gb/tp2"]
    fc = FleetCost(groups, prices=parse_prices(["h100=3.0", "a100-80gb=1.3"], "--gpu-price"))
    # one hour: the H100 busy half of it, the A100 pair all of it; a million output tokens
    c = fc.report(3600.0, [1800.0, 3600.0], [0, 1], output_tokens=1_000_000, total_tokens=2_000_000,
                  good_requests=1000)
    assert c["dollars_per_hour"] == pytest.approx(3.0 + 2 * 1.3)
    assert c["dollars"] == pytest.approx(5.6)
    assert c["dollars_per_million_output_tokens"] == pytest.approx(5.6)
    assert c["dollars_per_million_tokens"] == pytest.approx(2.8)
    assert c["good_requests_per_dollar"] == pytest.approx(1000 / 5.6)
    # energy at board power while busy: 700 W x 1800 s + 2 x 400 W x 3600 s = 1.15 kWh
    assert c["energy_kwh"] == pytest.approx(0.35 + 0.8)
    assert c["joules_per_output_token"] == pytest.approx(1.15 * 3.6e6 / 1e6)
    # a GPU without a known price: no dollar figures, not zero
    none = FleetCost(parse_fleet("1xa10g")).report(3600.0, [10.0], [0], output_tokens=10, total_tokens=20,
                                                   good_requests=None)
    assert none["dollars_per_hour"] is None and none["dollars_per_million_output_tokens"] is None


def test_fleet_spec_errors_are_clear():
    assert parse_fleet("2xa100-80gb/tp2@prefill,a100-80gb@decode")[1] == ReplicaGroup(1, "a100-80gb", 1, "decode")
    with pytest.raises(ValueError, match="COUNTxGPU"):
        parse_fleet("2 x h100")
    with pytest.raises(ValueError, match="role"):
        parse_fleet("1xh100@mixed")
    with pytest.raises(KeyError):
        parse_fleet("1xnot-a-gpu")
    with pytest.raises(ValueError, match="prefill replicas only"):
        Simulator(SimConfig(fleet=parse_fleet("1xh100@prefill"), progress=False)).run(
            [TraceRequest(arrival=0.0, prompt_tokens=8, output_tokens=2, index=0)])


def test_simulate_cli_runs_a_disaggregated_fleet(tmp_path, capsys):
    from shepherd.cli import main
    rc = main(["simulate", "--rate", "2", "--num-requests", "20", "--model", "opt-13b",
               "--fleet", "1xa100-80gb/tp2@prefill,1xa100-80gb@decode", "--cost-model", "distserve",
               "--slo-ttft", "0.5", "--out", str(tmp_path), "--no-plots", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "20 prefilled on prefill replicas" in out
    assert "$3.9/h for 3 GPU(s)" in out          # 1.30 $/GPU-hour x 3 A100s


def test_search_returns_the_known_optimum_of_a_toy_problem():
    from shepherd.sim.search import SearchSpace, search
    # attainment grows with replicas x a GPU's speed; a100 $1.30, h100 $3.00 per GPU-hour:
    # a100 meets 0.9 at 4 replicas ($5.20), h100 at 2 ($6.00); tp 2 doubles speed at twice the price
    speed = {"a100-80gb": 0.25, "h100": 0.5}
    seen = []

    def evaluate(c):
        seen.append(c.label())
        return min(1.0, speed[c.gpu] * c.tp * c.replicas * 0.9), None, None

    space = SearchSpace(gpus=["a100-80gb", "h100"], tps=[1, 2], replicas=[1, 2, 4, 8])
    res = search(space, evaluate, attainment=0.9)
    assert res.best.candidate.label() == "4xa100-80gb"          # also 2xa100/tp2 at $5.20: the first found
    assert res.best.dollars_per_hour == pytest.approx(5.2)
    # counts past the first that meets are skipped: a100 1,2,4; a100/tp2 1,2; h100 1,2; h100/tp2 1
    assert res.runs == 8 and res.skipped == 8 and "8xa100-80gb" not in seen
    # Pareto over ($/hour, attainment): ties in both keep the first found (2xa100 before 1xa100/tp2)
    front = [(o.candidate.label(), round(o.dollars_per_hour, 2), round(o.attainment, 3)) for o in res.pareto]
    assert front == [("1xa100-80gb", 1.3, 0.225), ("2xa100-80gb", 2.6, 0.45), ("4xa100-80gb", 5.2, 0.9)]
    # a budget under the optimum: nothing meets the SLOs
    assert search(space, evaluate, attainment=0.9, budget=5.0).best is None


def test_simulate_search_cli_finds_a_fleet_that_meets_the_slos(tmp_path, capsys):
    import json

    from shepherd.cli import main
    rc = main(["simulate", "--rate", "4", "--num-requests", "80", "--input-len", "fixed:512", "--output-len",
               "fixed:64", "--search", "--search-gpus", "a100-80gb,h100", "--search-tp", "1",
               "--search-replicas", "1,2", "--slo-ttft", "0.5", "--slo-tpot", "0.05", "--out", str(tmp_path),
               "--no-progress"])
    assert rc == 0
    out = json.loads((tmp_path / "search.json").read_text())
    assert out["best"]["meets_slos"] and out["best"]["attainment"] >= 0.9
    assert out["best"]["dollars_per_hour"] == min(r["dollars_per_hour"] for r in out["all"] if r["meets_slos"])
    assert "cheapest that meets the SLOs" in capsys.readouterr().out
