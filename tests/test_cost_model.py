"""Cost models (sim/cost_model.py): the published H100 ITL check, fits, swap, capacity."""
from __future__ import annotations

import numpy as np
import pytest

from shepherd.sim import cost_model as cm
from shepherd.sim import fitted_cost as fc


@pytest.mark.parametrize("context", [1024, 2048, 4096, 8192, 16384, 32768])
def test_llama3_8b_h100_itl_matches_vllm_within_15pct(context):
    """vLLM blog: Llama-3-8B on one H100, single request: 6.44 ms + 4.37e-5 ms per context token."""
    model = cm.RooflineCostModel("llama-3-8b", "h100")
    ref = cm.vllm_h100_itl(context)
    got = model.decode_itl(context)
    assert abs(got / ref - 1) < 0.15, (context, got, ref)


def test_roofline_floor_and_presets():
    m = cm.get_model("Llama-3-8B")
    assert m.weight_bytes == pytest.approx(16.06e9, rel=0.01)
    assert m.kv_bytes_per_token == 128 * 1024
    assert cm.get_model("llama-2-7b").kv_bytes_per_token == 512 * 1024
    assert cm.get_model("smollm2-135m").num_params == pytest.approx(134.5e6, rel=0.01)
    # ANCHORS: one Llama-3-8B decode step on an H100 cannot beat ~4.8 ms
    r = cm.RooflineCostModel("llama-3-8b", "h100")
    assert r.decode_itl(512) > 4.8e-3
    for g in cm.GPUS:
        if g == "a10g":
            continue
        cm.RooflineCostModel("llama-3-8b", g).decode_itl(1000)
    # compute-bound prefill: a 4k prompt costs far more than a decode step
    assert r.shape_time(cm.BatchShape.prefill(4096)) > 5 * r.decode_itl(4096)


def test_tensor_parallel_and_capacity():
    t = {tp: cm.RooflineCostModel("llama-2-70b", "h100", tp=tp) for tp in (2, 4, 8)}
    assert t[2].decode_itl(1000) > t[4].decode_itl(1000) > t[8].decode_itl(1000)
    # the all-reduce term keeps tp=8 from being a perfect 4x over tp=2
    assert t[2].decode_itl(1000) / t[8].decode_itl(1000) < 4
    assert t[8]._ar_tok > 0
    with pytest.raises(ValueError):
        cm.RooflineCostModel("llama-2-70b", "h100", tp=1).kv_capacity_tokens()
    cap = cm.RooflineCostModel("llama-3-8b", "h100").kv_capacity_tokens()
    assert 350_000 < cap < 550_000
    assert cm.RooflineCostModel("llama-2-7b", "a10g").kv_capacity_tokens() < 20_000


def test_decode_step_times_match_step_time():
    for model in (cm.RooflineCostModel("llama-3-8b", "h100"), cm.RooflineCostModel("llama-2-70b", "a100-80gb", tp=4),
                  fc.FittedCostModel(grid_tokens=[1, 64, 512], grid_s=[0.01, 0.012, 0.05],
                                     coef={"ctx_tokens": 1e-7, "num_seqs": 1e-5})):
        n, ctx0, k = 37, 37 * 900, 50
        fast = model.decode_step_times(n, ctx0, k)
        for j in (0, 1, 17, 49):
            ctxs = [900 + j] * n
            assert fast[j] == pytest.approx(model.shape_time(cm.BatchShape.decode(ctxs)), rel=1e-12)


def test_swap_is_pcie_transfer():
    r = cm.RooflineCostModel("llama-3-8b", "h100")
    assert r.swap_time(1000) == pytest.approx(1000 * 131072 / 50e9)
    s = cm.BatchShape.decode([100])
    s.swap_tokens = 1000
    assert r.shape_time(s) == pytest.approx(r.decode_itl(100) + r.swap_time(1000))


def test_fit_recovers_linear_model(tmp_path):
    truth = fc.FittedCostModel(grid_tokens=[1, 16, 256, 1024], grid_s=[0.004, 0.0045, 0.012, 0.04],
                               coef={"ctx_tokens": 2e-8, "prefill_pairs": 3e-11, "num_seqs": 1e-5})
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(200):
        if rng.random() < 0.5:
            shape = cm.BatchShape.decode(rng.integers(10, 3000, size=int(rng.integers(1, 64))).tolist())
        else:
            shape = cm.BatchShape.prefill(int(rng.integers(8, 1024)), int(rng.integers(0, 1000)))
        samples.append((shape, truth.shape_time(shape)))
    fit = fc.fit_cost_model(samples, grid_tokens=[1, 16, 256, 1024], kv_bytes_per_token=1000)
    assert fit.meta["fit_max_rel_err"] < 1e-6
    p = tmp_path / "m.json"
    fit.save(p)
    again = fc.load_cost_model(p)
    s = cm.BatchShape.decode([500] * 8)
    assert again.shape_time(s) == pytest.approx(truth.shape_time(s), rel=1e-6)


def test_profile_models():
    v = fc.from_vidur("llama-2-7b", "h100")
    # vidur's profiled MLP side alone is ~5.6 ms for one token (derived_nonattention_step_ms.json)
    assert 5e-3 < v.decode_itl(1) < 8e-3
    assert v.shape_time(cm.BatchShape.prefill(4096)) > v.shape_time(cm.BatchShape.prefill(512))
    s = fc.from_splitwise("llama-2-70b", "h100", tp=8)
    assert s.meta["fit_mean_rel_err"] < 0.15
    assert s.decode_itl(600, 64) > s.decode_itl(600, 1)


def test_llama3_8b_on_h100_is_transferred_from_the_profiles_that_exist():
    # vidur never profiled Llama-3-8B on H100: Llama-2-7B's H100 profile is scaled by the two
    # models' measured ratio on A100. By hand, from derived_nonattention_step_ms.json at 256
    # tokens: 9.152 x 19.488 / 17.808 = 10.015 ms, plus the LM head's read (128256 x 4096 x 2
    # bytes at 0.8 x 3.35 TB/s = 0.392 ms)
    v = fc.from_vidur("llama-3-8b", "h100")
    assert "h100_meta-llama_Llama-2-7b-hf" in v.meta["source"]
    lm_head = 128256 * 4096 * 2 / (0.8 * 3.35e12)
    assert float(v._table(256)) == pytest.approx(10.015e-3 + lm_head, rel=2e-3)
    assert float(v._table(1)) == pytest.approx(5.851e-3 + lm_head, rel=2e-3)
    # its one-request ITL stays within 6% of vLLM's published line with the preset's overhead,
    # which --step-overhead replaces, as it does the roofline's
    for c in (1024, 8192, 32768):
        assert v.decode_itl(c) == pytest.approx(cm.vllm_h100_itl(c), rel=0.06)
    assert v.overhead == (0.45e-3, 0.0)
    with pytest.raises(FileNotFoundError, match="none to transfer from"):
        fc.from_vidur("llama-3-8b", "h200")


def test_overhead_terms_add_per_step_and_per_request_and_keep_the_fast_path_exact():
    base = cm.RooflineCostModel("llama-3-8b", "h100")
    slow = cm.RooflineCostModel("llama-3-8b", "h100").set_overhead(2e-3, 50e-6)
    assert slow.overhead == (2e-3, 50e-6)
    for n, ctx in ((1, 1000), (32, 32 * 500)):
        d = slow.decode_step_time(n, ctx) - base.decode_step_time(n, ctx)
        assert d == pytest.approx(2e-3 + 50e-6 * n - base.overhead[0] - base.overhead[1] * n)
        assert slow.decode_step_times(n, ctx, 3)[0] == slow.decode_step_time(n, ctx)
    fit = fc.FittedCostModel(grid_tokens=[1, 64], grid_s=[1e-3, 2e-3], coef={"ctx_tokens": 1e-8})
    t0 = fit.decode_step_time(4, 400)
    fit.set_overhead(1e-3, 1e-4)
    assert fit.decode_step_time(4, 400) == pytest.approx(t0 + 1e-3 + 4e-4)
    assert fit.decode_step_times(4, 400, 2)[0] == fit.decode_step_time(4, 400)
    again = fc.FittedCostModel.from_json(fit.to_json())
    assert again.overhead == (1e-3, 1e-4)


def test_calibrate_fits_the_scheduler_overhead_line():
    from shepherd.sim.calibrate import fit_overhead
    host = [(n, 3e-4 + 2e-5 * n) for n in (1, 2, 4, 8, 16, 32)]
    a, b = fit_overhead(host)
    assert a == pytest.approx(3e-4) and b == pytest.approx(2e-5)


def test_calibrate_served_overhead_is_what_the_step_model_leaves_out():
    """`calibrate --served`: served TPOT minus the model's step at the same batch and context is
    the overhead; a line through the two batches gives fixed + per request, and an overhead that
    the step model already covers (TPOT below the step) gives none, not a negative one."""
    from shepherd.sim.calibrate import fit_served_overhead
    fit = fc.FittedCostModel(grid_tokens=[1, 64], grid_s=[5e-3, 9e-3], coef={"ctx_tokens": 1e-8})
    step1, step16 = fit.decode_itl(160, 1), fit.decode_itl(160, 16)
    fixed, per = fit_served_overhead([(1, 160, step1 + 1.2e-3), (16, 160, step16 + 1.2e-3 + 15 * 3e-4)], fit)
    assert fixed == pytest.approx(1.2e-3 - 3e-4) and per == pytest.approx(3e-4)
    fit.set_overhead(fixed, per)
    assert fit.decode_itl(160, 16) == pytest.approx(step16 + 1.2e-3 + 15 * 3e-4)   # the simulator now predicts it
    fit.set_overhead(0.0, 0.0)
    assert fit_served_overhead([(1, 160, step1 - 1e-3), (16, 160, step16 - 2e-3)], fit) == (0.0, 0.0)


def test_calibrate_served_overhead_fits_all_points_not_the_ends():
    """With points at 1, 2, 4, 8 and 16 requests, one noisy point (here the one-stream TPOT,
    1 ms high) moves the least-squares line a little instead of setting its intercept."""
    from shepherd.sim.calibrate import fit_served_overhead
    fit = fc.FittedCostModel(grid_tokens=[1, 64], grid_s=[5e-3, 9e-3], coef={"ctx_tokens": 1e-8})
    true_fixed, true_per = 2e-4, 3e-4
    pts = [(b, 160, fit.decode_itl(160, b) + true_fixed + true_per * b + (1e-3 if b == 1 else 0.0))
           for b in (1, 2, 4, 8, 16)]
    fixed, per = fit_served_overhead(pts, fit)
    # hand-computed least squares over (b, overhead): b = 1, 2, 4, 8, 16 (mean 6.2, Sxx = 148.8);
    # the 1 ms at b = 1 adds (1 - 6.2) * 1e-3 / 148.8 to the slope and 1e-3 / 5 - 6.2 * that to the intercept
    d_per = (1 - 6.2) * 1e-3 / 148.8
    assert per == pytest.approx(true_per + d_per)
    assert fixed == pytest.approx(true_fixed + 1e-3 / 5 - 6.2 * d_per)
    ends = fit_served_overhead([pts[0], pts[-1]], fit)     # the old two-point line, for contrast
    assert abs(ends[0] - true_fixed) > 2 * abs(fixed - true_fixed)


def test_overlap_output_step_is_fixed_plus_the_larger_of_gpu_and_cpu():
    gpu = cm.RooflineCostModel("llama-3-8b", "h100").set_overhead(0.0, 0.0)
    ovl = fc.make_cost_model("llama-3-8b", "h100", step_overhead=1e-3, seq_overhead=100e-6, overlap=True)
    add = fc.make_cost_model("llama-3-8b", "h100", step_overhead=1e-3, seq_overhead=100e-6)
    # 10 requests: 1 ms of output processing hides behind a ~6.5 ms forward
    g10 = gpu.decode_step_time(10, 10 * 500)
    assert 6e-3 < g10 < 7e-3
    assert ovl.decode_step_time(10, 10 * 500) == pytest.approx(1e-3 + g10)
    assert add.decode_step_time(10, 10 * 500) == pytest.approx(1e-3 + g10 + 1e-3)
    # 200 requests: 20 ms of CPU outlasts the ~11 ms forward and sets the pace: 1 + 20 ms
    assert gpu.decode_step_time(200, 200 * 500) < 12e-3
    assert ovl.decode_step_time(200, 200 * 500) == pytest.approx(21e-3)
    for n, ctx in ((10, 5000), (200, 100_000)):
        # the fast path's vectorised times and ScheduledBatch pricing say the same, to the bit
        assert ovl.decode_step_times(n, ctx, 2)[0] == ovl.decode_step_time(n, ctx)
        assert ovl.shape_time(cm.BatchShape.decode([ctx // n] * n)) == pytest.approx(ovl.decode_step_time(n, ctx))
    fit = fc.FittedCostModel(grid_tokens=[1, 256], grid_s=[5e-3, 9e-3], coef={"ctx_tokens": 1e-8})
    fit.set_overhead(1e-3, 100e-6, overlap=True)
    assert fit.decode_step_time(200, 0) == pytest.approx(21e-3)
    assert fit.decode_step_time(10, 0) == pytest.approx(1e-3 + 5e-3 + 9 * 4e-3 / 255)
    assert fit.decode_step_times(200, 0, 2)[0] == fit.decode_step_time(200, 0)
    assert fc.FittedCostModel.from_json(fit.to_json()).overlap


def test_calibrate_served_points_take_the_median_of_interleaved_rounds():
    """A slow spell of a few seconds (here: the whole second round, 40 % slow) must not move
    any served point: the rounds interleave the points, and each point is its rounds' median."""
    from shepherd.sim.calibrate import served_points
    calls = []

    def measure(conc, seed):
        calls.append(conc)
        slow = 1.4 if len(calls) in range(4, 7) else 1.0    # calls 4-6: the second round
        return [slow * (8e-3 + 5e-4 * conc)] * 3, ([slow * 0.07] if conc == 1 else [])
    points, ttft1 = served_points(measure, [1, 4, 16], rounds=3)
    assert calls == [1, 4, 16] * 3
    assert points == [(1, 160, pytest.approx(8.5e-3)), (4, 160, pytest.approx(10e-3)),
                      (16, 160, pytest.approx(16e-3))]
    assert ttft1 == pytest.approx(0.07)


def test_calibrate_served_sets_the_frontend_latency_from_one_requests_ttft(monkeypatch):
    """served_overhead: the step overhead from the TPOT points, then the frontend latency =
    the lone request's TTFT minus the (now overhead-including) modelled prefill of its prompt."""
    from shepherd.sim import calibrate
    from shepherd.sim.cost_model import BatchShape
    fit = fc.FittedCostModel(grid_tokens=[1, 64, 256], grid_s=[5e-3, 9e-3, 30e-3], coef={"ctx_tokens": 1e-8})
    pts = [(b, 160, fit.decode_itl(160, b) + 1e-3 + 2e-4 * b) for b in (1, 2, 4, 8, 16)]
    monkeypatch.setattr(calibrate, "measure_served", lambda args, ecfg: (pts, 0.040))
    fixed, per = calibrate.served_overhead(None, None, fit)
    assert (fixed, per) == (pytest.approx(1e-3), pytest.approx(2e-4))
    assert fit.frontend == pytest.approx(0.040 - fit.shape_time(BatchShape.prefill(128)))
    assert fit.meta["served_overhead"]["frontend"] == fit.frontend
    assert fc.FittedCostModel.from_json(fit.to_json()).frontend == fit.frontend   # kept in the JSON


@pytest.mark.parametrize("flags,msg", [
    (["--batch-sizes", "abc"], "--batch-sizes must be a comma-separated list of integers >= 1, got 'abc'"),
    (["--batch-sizes", "0"], "--batch-sizes must be a comma-separated list of integers >= 1, got '0'"),
    (["--prompt-lens", "-5"], "--prompt-lens must be a comma-separated list of integers >= 1, got '-5'"),
    (["--from-samples", "/nonexist"], "--from-samples /nonexist: cannot read"),
    (["--from-samples", "BAD"], "BAD:2: not a sample line"),
])
def test_calibrate_refuses_bad_flags_with_one_line(tmp_path, capsys, flags, msg):
    # each was a traceback (int(), ValueError at the grid, FileNotFoundError, json.loads)
    from shepherd.cli import main
    bad = tmp_path / "s.jsonl"
    bad.write_text('{"shape": {"num_seqs": 1}, "seconds": 0.1}\nnot json\n')
    flags = [str(bad) if f == "BAD" else f for f in flags]
    assert main(["calibrate", "--out", str(tmp_path / "c.json"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shepherd calibrate: ") and msg.replace("BAD", str(bad)) in err
    assert len(err.strip().splitlines()) == 1
