"""The planner's plots of a simulation (issue 30 item 7): per-replica load and KV over time, and
the prefix hit rate over time against both bounds, with the series they are drawn from."""
import numpy as np
import pytest

from shepherd.bench.synthetic import ClientSpec, SyntheticSpec, synthetic
from shepherd.config import SchedulerConfig
from shepherd.sim.simulator import SimConfig, simulate


@pytest.fixture(scope="module")
def run():
    trace = synthetic(SyntheticSpec(clients=[ClientSpec("a", rate=6.0, input_len="lognormal:600:0.6",
                                                        output_len="lognormal:60:0.6", system_prompt_tokens=512,
                                                        num_system_prompts=3)], num_requests=300, seed=3))
    cfg = SimConfig(model="llama-3-8b", gpu="a10g", replicas=3, router="round-robin", seed=0,
                    scheduler=SchedulerConfig(max_total_tokens=12_288), kv_capacity=12_288)
    return simulate(trace, cfg)


def test_per_replica_series_add_up_to_the_cluster_series(run):
    ts = run.timeseries
    assert ts["replica_ids"] == [0, 1, 2]
    assert ts["replica_kv_capacity"] == [12_288] * 3
    for key, total in (("replica_kv_used", "kv_used"), ("replica_kv_cached", "kv_cached"),
                       ("replica_running", "running"), ("replica_waiting", "waiting")):
        per = np.asarray(ts[key])
        assert per.shape == (3, len(ts["t"]))
        assert np.allclose(per.sum(axis=0), ts[total])
    # round robin: every replica ran requests, and none held more KV than it has
    assert all(max(r) > 0 for r in ts["replica_running"])
    assert max(max(r) for r in ts["replica_kv_used"]) <= 12_288
    for used, r in zip(ts["replica_kv_used"], run.replicas):    # sampled: never above the exact peak
        assert 0 < max(used) <= r["kv_peak_used_tokens"]


def test_prefix_series_by_arrival_sum_to_the_runs_hits_and_bounds(run):
    ts, b = run.timeseries, run.hit_rate_bounds
    assert sum(ts["prefix_query"]) == b["query_tokens"]
    assert sum(ts["prefix_hit_infinite"]) == b["infinite_hit_tokens"]
    assert sum(ts["prefix_hit_lru_cluster"]) == b["lru_cluster_hit_tokens"]
    assert sum(ts["prefix_hit"]) == run.prefix_hit_tokens > 0
    assert len(ts["prefix_edges"]) == len(ts["prefix_query"]) + 1
    # per bin, nothing beats the cache that never forgets
    q = np.asarray(ts["prefix_query"])
    assert (np.asarray(ts["prefix_hit"]) <= np.asarray(ts["prefix_hit_infinite"]) + 1e-9).all() or q.sum() == 0


def test_plots_are_written_with_the_right_series(run, tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from shepherd.bench.plots import prefix_figure, replicas_figure, write_plots
    ts = run.timeseries
    fig = replicas_figure(plt, ts, "t")
    kv_ax, req_ax = fig.axes
    kv_lines = kv_ax.get_lines()
    assert [ln.get_label() for ln in kv_lines[::2]] == ["replica 0", "replica 1", "replica 2"]
    assert np.allclose(kv_lines[2].get_ydata(), np.asarray(ts["replica_kv_used"][1]) / 12_288)
    assert np.allclose(kv_lines[3].get_ydata(),
                       (np.asarray(ts["replica_kv_used"][1]) + np.asarray(ts["replica_kv_cached"][1])) / 12_288)
    req_lines = req_ax.get_lines()
    assert [ln.get_label() for ln in req_lines[:2]] == ["replica 0 running", "replica 0 queued"]
    assert np.array_equal(req_lines[5].get_ydata(), ts["replica_waiting"][2])
    plt.close(fig)

    fig = prefix_figure(plt, ts, "t")
    lines = fig.axes[0].get_lines()
    assert [ln.get_label() for ln in lines] == ["bound: infinite cache", "bound: cluster-wide LRU", "achieved"]
    # the figure's bins: the simulator's, merged k at a time into at most 64; each point is the
    # merged bins' hits over their tokens asked
    q = np.asarray(ts["prefix_query"], dtype=float)
    k = -(-len(q) // 64)
    for ln, key in zip(lines, ("prefix_hit_infinite", "prefix_hit_lru_cluster", "prefix_hit")):
        h = np.asarray(ts[key], dtype=float)
        want = [h[i:i + k].sum() / q[i:i + k].sum() for i in range(0, len(q), k) if q[i:i + k].sum() > 0]
        assert np.allclose(ln.get_ydata(), want)
    assert len(lines[0].get_ydata()) <= 64
    plt.close(fig)

    paths = write_plots(tmp_path, run.stats, ts, title="t")
    names = {p.name for p in paths}
    assert {"replicas.png", "prefix_time.png", "kv.png"} <= names
    assert all((tmp_path / n).stat().st_size > 10_000 for n in ("replicas.png", "prefix_time.png"))
