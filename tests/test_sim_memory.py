"""Memory is O(requests in flight + cache), never O(requests served): the
number of live objects after 2,000 served requests is what it was after 500."""
from __future__ import annotations

import gc

from shepherd.bench.synthetic import ClientSpec, SyntheticSpec, iter_synthetic
from shepherd.config import SchedulerConfig
from shepherd.sim.simulator import SimConfig, Simulator


def _live_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


def test_live_objects_stay_flat_as_served_requests_grow():
    spec = SyntheticSpec(clients=[ClientSpec("a", rate=10.0, input_len="lognormal:300:0.5",
                                             output_len="lognormal:40:0.5", system_prompt_tokens=64,
                                             num_system_prompts=4),
                                  ClientSpec("b", rate=10.0, input_len="fixed:200", output_len="fixed:30")],
                         num_requests=2000, seed=1)
    seen: dict[int, int] = {}

    def on_record(rec) -> None:
        n = sim.finished
        if n in (500, 2000):
            seen[n] = _live_objects()

    sim = Simulator(SimConfig(replicas=2, kv_capacity=40_000, keep_records=False, progress=False,
                              scheduler=SchedulerConfig(max_total_tokens=40_000)))
    result = sim.run(iter_synthetic(spec), on_record=on_record)
    assert result.stats.n == 2000 and result.stats.completed == 2000
    assert result.records == []
    # 1,500 more requests served; a leak of even one object per request would show
    assert seen[2000] - seen[500] < 300, seen


def test_synthetic_arrivals_are_drawn_on_demand():
    # 1e6 req/s for 50 requests used to draw ~60 s x rate arrivals first (MemoryError)
    spec = SyntheticSpec(clients=[ClientSpec("a", rate=1e6)], num_requests=50)
    it = iter_synthetic(spec)
    first = [next(it) for _ in range(10)]
    assert [r.index for r in first] == list(range(10))
    assert len(list(it)) == 40


def test_cli_burst_rate_runs(tmp_path):
    import json

    from shepherd.cli import main
    out = tmp_path / "burst"
    assert main(["simulate", "--rate", "1000000", "--num-requests", "50", "--out", str(out),
                 "--no-progress", "--no-plots"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["requests"] == 50 and s["completed"] == 50
    assert s["sim"]["router"] == "least-request"
