"""The per-step CPU path from its parts (sim/host_path.py, sim/host_profile.py): the combination
by hand, the fast path's bits, the fit, the shipped profile, and the profiler on the real engine."""
import json

import numpy as np
import pytest

from shepherd.config import SchedulerConfig
from shepherd.sim.cost_model import BatchShape, RooflineCostModel
from shepherd.sim.fitted_cost import from_vidur, make_cost_model
from shepherd.sim.host_path import PARTS, HostPart, HostPath, HostPathCostModel, fit_part, load_host_path


def hand_path() -> HostPath:
    us = 1e-6
    return HostPath(schedule=HostPart(50 * us, 1 * us, 0.1 * us), prepare=HostPart(100 * us, 5 * us, 0.5 * us),
                    sample=HostPart(20 * us, 2 * us, 0.0), update=HostPart(30 * us, 2 * us, 0.2 * us),
                    front=HostPart(200 * us, 40 * us, 0.0))


def test_a_step_is_the_gpu_plus_the_core_parts_or_the_front_whichever_is_longer():
    """core = 200 us + 10 us/request + 0.8 us/token; front = 200 us + 40 us/request, beside it."""
    gpu = RooflineCostModel("llama-3-8b", "h100").set_overhead(0.0, 0.0)
    bare = gpu.decode_step_time(4, 4 * 1000)
    cm = HostPathCostModel(RooflineCostModel("llama-3-8b", "h100"), hand_path())
    # 4 decodes: core 200 + 4 x 10 + 4 x 0.8 = 243.2 us after the GPU; the front's 360 us run beside it
    assert cm.decode_step_time(4, 4000) == pytest.approx(bare + 243.2e-6, rel=1e-12)
    # a prefill of 2,000 tokens: core 200 + 10 + 1,600 us
    s = BatchShape.prefill(2000)
    assert cm.shape_time(s) == pytest.approx(gpu.shape_time(s) + 1810e-6, rel=1e-12)
    # a GPU so fast the front sets the pace: 1,000 requests, front 200 + 40,000 us
    fast = RooflineCostModel("smollm2-135m", "h100").set_overhead(0.0, 0.0)
    cm2 = HostPathCostModel(RooflineCostModel("smollm2-135m", "h100"), hand_path())
    g = fast.decode_step_time(1000, 1000 * 10)
    assert g + 200e-6 + 1000 * 10.8e-6 < 40.2e-3
    assert cm2.decode_step_time(1000, 1000 * 10) == pytest.approx(40.2e-3, rel=1e-12)
    # a continuing step of a multi-step window saves the scheduler's fixed part
    assert cm.overhead == (pytest.approx(50e-6), 0.0)


@pytest.mark.parametrize("inner", ["roofline", "vidur"])
def test_fast_path_steps_equal_one_by_one_to_the_bit(inner):
    gpu = RooflineCostModel("llama-3-8b", "h100") if inner == "roofline" else from_vidur("llama-3-8b", "h100")
    cm = HostPathCostModel(gpu, hand_path())
    for n in (1, 7, 64, 256, 2000):
        ctx0 = n * 300
        arr = cm.decode_step_times(n, ctx0, 25)
        one = [cm.decode_step_time(n, ctx0 + j * n) for j in range(25)]
        lb = [cm.decode_step_lb(n, ctx0 + j * n) for j in range(25)]
        assert arr.tolist() == one == lb


def test_fit_part_recovers_the_terms_and_drops_a_negative_one():
    pts = [(n, tok, 100e-6 + 3e-6 * n + 0.25e-6 * tok) for n in (1, 4, 16, 64) for tok in (n, n * 128)]
    p = fit_part(pts, per_token=True)
    assert (p.fixed, p.per_req, p.per_token) == pytest.approx((100e-6, 3e-6, 0.25e-6), rel=1e-6)
    # time falling with the requests: the slope is dropped and the fixed part is the mean
    p = fit_part([(1, 1, 3e-6), (2, 2, 2e-6), (3, 3, 1e-6)])
    assert p.per_req == 0.0 and p.fixed == pytest.approx(2e-6)


def test_saved_profile_loads_back_and_the_shipped_one_has_every_part(tmp_path):
    hp = hand_path()
    hp.meta["machine"] = "hand"
    f = tmp_path / "h.json"
    hp.save(str(f))
    back = load_host_path(str(f))
    assert back.to_dict() == hp.to_dict()
    assert back.core_time(3, 10) == hp.core_time(3, 10)
    shipped = load_host_path("default")
    assert all(getattr(shipped, p).fixed + getattr(shipped, p).per_req > 0 for p in PARTS)
    assert shipped.meta["machine"] and shipped.meta["command"].startswith("shepherd calibrate --host-path")
    f.write_text(json.dumps({"grid_tokens": [1]}))
    with pytest.raises(ValueError, match="not a host-path profile"):
        load_host_path(str(f))


def test_host_path_replaces_the_overhead_knobs_and_keeps_the_gpu_models_capacity():
    with pytest.raises(ValueError, match="host-path"):
        make_cost_model("llama-3-8b", "h100", cost_model="vidur", step_overhead=0.006, host_path="default")
    cm = make_cost_model("llama-3-8b", "h100", cost_model="vidur", host_path="default")
    ref = from_vidur("llama-3-8b", "h100")
    assert cm.kv_capacity_tokens() == ref.kv_capacity_tokens()
    assert cm.profiled_tokens == ref.profiled_tokens
    assert cm.gpu_model.overhead == (0.0, 0.0)
    assert "host_path" in cm.describe() and cm.name.endswith("+host-path")


def test_simulate_cli_with_the_host_path(tmp_path):
    from shepherd.cli import main
    out = tmp_path / "o"
    rc = main(["simulate", "--rate", "4", "--num-requests", "40", "--input-len", "fixed:200",
               "--output-len", "fixed:20", "--model", "llama-3-8b", "--gpu", "h100", "--cost-model", "vidur",
               "--host-path", "default", "--no-progress", "--no-plots", "--out", str(out)])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["completed"] == 40 and "host-path" in s["sim"]["cost_model"]


def test_profiler_on_the_real_engine_times_every_part():
    """The served engine (SmolLM2, one thread), a small grid: every part is measured, the
    forward is not counted in any of them, and the fit is a profile simulate can load."""
    from shepherd.config import EngineConfig
    from shepherd.engine.build import build_served_core
    from shepherd.sim.host_profile import profile_host_path
    cfg = EngineConfig(executor="torch", num_threads=1, max_total_tokens=1024,
                       scheduler=SchedulerConfig(max_batch_size=4, prefix_cache=False))
    served = build_served_core(cfg)
    hp = profile_host_path(served, batch_sizes=(1, 2, 4), prompt_lens=(16, 64), decode_steps=4, repeats=1,
                           warmup=2)
    for p in PARTS:
        assert hp.meta["median_s"][p] > 0
    # the parts are CPU around a forward, which takes far longer on this model
    assert max(hp.meta["median_s"].values()) < hp.meta["forward_median_s"]
    assert not served.scheduler.has_work
    cm = HostPathCostModel(RooflineCostModel("llama-3-8b", "h100"), HostPath.from_dict(hp.to_dict()))
    assert np.isfinite(cm.decode_step_time(8, 8000))
