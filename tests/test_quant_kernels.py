"""Weight-only int8/int4 (shepherd/model/quant.py) and the fused CPU kernels
(shepherd/model/kernels.c): exact GGUF block loading, kernel numerics against plain
torch, row independence (what batch invariance rests on), clear errors."""
import math

import numpy as np
import pytest
import torch

from shepherd.model import kernels, quant


def _gguf_tensor(path, name):
    from shepherd.model.gguf_file import gguf_reader
    return next(t for t in gguf_reader(path).tensors if t.name == name)


def test_q4_1_blocks_load_bit_exact(default_model_path):
    """The Q4_1 nibbles, scales and mins become the int4 kernel's q/scale/zero with no
    rounding: dequantising our form gives gguf's own dequantisation exactly."""
    import gguf
    t = _gguf_tensor(default_model_path, "blk.0.ffn_gate.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
    N, K = int(t.shape[1]), int(t.shape[0])
    qw = quant.from_gguf_q4(np.asarray(t.data), (N, K), has_min=True)
    ref = torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(N, K))
    assert torch.equal(quant.dequantize(qw), ref.float())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_qlinear_matches_dequantised_matmul_and_rows_are_independent(kind):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g)
    qw = quant.quantize(w, kind)
    owner = type("O", (), {"batch_invariant": True, "min_rows": 1})()
    lin = quant.QLinear(qw, None, owner, torch.bfloat16)
    x = torch.randn(40, 128, generator=g).bfloat16()
    y = lin(x).float()
    ref = x.float() @ quant.dequantize(qw).t()
    assert (y - ref).abs().max() <= 0.02 * ref.abs().max()
    # quantisation error itself is bounded by half a step
    err = (quant.dequantize(qw) - w).abs().max()
    assert err <= (0.5 * w.abs().max() / 127 if kind == "int8" else 0.5 * (w.max() - w.min()) / 15) + 1e-6
    for M in (1, 2, 3, 5, 17):
        for s in (0, 40 - M):
            assert torch.equal(lin(x[s:s + M]), lin(x)[s:s + M]), f"M={M} at {s}"


def test_bad_quantization_mode_is_a_clear_error(default_model_path):
    from shepherd.model.loader import ModelLoadError, load_model
    with pytest.raises(ModelLoadError, match="quantization must be one of"):
        load_model(default_model_path, "bfloat16", quantization="int3")


def test_kv_pool_is_sized_from_the_gpus_free_memory_not_the_hosts(monkeypatch):
    """On cuda the KV budget (--kv-cache-memory-fraction of free memory) is the card's free memory
    after the weights are loaded; the host's MemAvailable only sizes a CPU pool."""
    from shepherd.engine import torch_executor as te
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 << 30, 80 << 30))
    monkeypatch.setattr(te, "mem_available_bytes", lambda: 500 << 30)
    assert te.free_memory_bytes(torch.device("cuda", 0)) == 3 << 30
    assert te.free_memory_bytes(torch.device("cpu")) == 500 << 30


def test_unavailable_device_is_a_clear_error():
    from shepherd.config import ConfigError, EngineConfig
    from shepherd.engine.torch_executor import TorchExecutor
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        TorchExecutor(EngineConfig(device="cuda"))
    with pytest.raises(ConfigError, match="not supported|use cpu"):
        TorchExecutor(EngineConfig(device="tpu"))


# ----------------------------------------------------------------------------- fused kernels
@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def kern(request):
    from shepherd.model import kernels
    lib = kernels.load()
    if lib is None:
        pytest.skip("no C compiler: the fused kernels are off (the pure-torch path is tested elsewhere)")
    return kernels.Kernels(lib, request.param), request.param


def _ref_attention(q, K, V, scale):
    s = (q.float() @ K.float().t()) * scale
    return torch.softmax(s, -1) @ V.float()


@pytest.mark.parametrize("H,KVH,hd", [(6, 2, 64), (8, 2, 128), (4, 4, 64), (10, 2, 96)],
                         ids=["g3-hd64", "g4-hd128", "g1-hd64", "g5-hd96"])
def test_fused_attention_reads_the_pool_by_slot(kern, H, KVH, hd):
    """Rows with different contexts over scattered slots: equal to softmax(qK^T)V over each
    row's own keys, and each row's bits equal to the row computed alone. Head shapes: the
    ones the bf16 kernel has unrolled bodies for (SmolLM2's 3 x 64, Llama-3's 4 x 128, 1 x 64)
    and one that takes its generic body."""
    k, dt = kern
    g = torch.Generator().manual_seed(1)
    cap = 300
    pool = torch.randn(2 * KVH, cap + 1, hd, generator=g).to(dt)
    perm = torch.randperm(cap, generator=g)
    ctxs = [1, 7, 64, 65, 200]
    tab, off = [], []
    for i, c in enumerate(ctxs):
        off.append(sum(len(t) for t in tab))
        tab.append(torch.roll(perm, 37 * i)[:c])
    slot_tab = torch.cat(tab)
    qkv = torch.randn(len(ctxs), (H + 2 * KVH) * hd, generator=g).to(dt)
    out = k.attention(qkv, pool, H, KVH, hd, slot_tab, torch.tensor(off), torch.tensor(ctxs), max(ctxs), 0.125)
    G = H // KVH
    for r, c in enumerate(ctxs):
        for h in range(H):
            kv = h // G
            sl = tab[r]
            ref = _ref_attention(qkv[r, h * hd:(h + 1) * hd].view(1, hd), pool[kv, sl], pool[KVH + kv, sl], 0.125)
            got = out[r, h * hd:(h + 1) * hd].float()
            assert (got - ref[0]).abs().max() < (2e-2 if dt == torch.bfloat16 else 1e-5)
        alone = k.attention(qkv[r:r + 1].contiguous(), pool, H, KVH, hd, tab[r].contiguous(), torch.tensor([0]),
                            torch.tensor([c]), c, 0.125)
        assert torch.equal(alone[0], out[r])


def test_fused_rmsnorm_silu_rope_match_torch(kern):
    k, dt = kern
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 576, generator=g).to(dt)
    d = torch.randn(9, 576, generator=g).to(dt)
    w = torch.randn(576, generator=g).to(dt)
    ref_x = (x.float() + d.float()).to(dt)
    xf = ref_x.float()
    ref_h = (w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5))).to(dt)
    xx = x.clone()
    h = k.rmsnorm(xx, w, 1e-5, delta=d)
    assert torch.equal(xx, ref_x)
    tol = 2e-2 if dt == torch.bfloat16 else 1e-5
    assert ((h.float() - ref_h.float()).abs() <= tol * (1 + ref_h.float().abs())).all()
    gu = torch.randn(5, 2 * 64, generator=g).to(dt)
    ref = torch.nn.functional.silu(gu[:, :64].float()) * gu[:, 64:].float()
    assert ((k.silu_mul(gu).float() - ref).abs() <= tol * (1 + ref.abs())).all()
    # RoPE + K/V write: positions 0 and 5, slots 3 and 1
    H, KVH, hd = 2, 1, 8
    qkv = torch.randn(2, (H + 2 * KVH) * hd, generator=g).to(dt)
    orig = qkv.clone()
    pool = torch.zeros(2 * KVH, 4, hd, dtype=dt)
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.outer(torch.arange(8).float(), inv)
    k.rope_kv(qkv, H, KVH, hd, torch.tensor([0, 5]), ang.cos().contiguous(), ang.sin().contiguous(), pool,
              torch.tensor([3, 1]))
    assert torch.equal(qkv[0, :hd], orig[0, :hd])                        # position 0: no rotation
    x1, x2 = orig[1, :hd // 2].float(), orig[1, hd // 2:hd].float()
    c, s = ang[5].cos(), ang[5].sin()
    assert torch.allclose(qkv[1, :hd // 2].float(), x1 * c - x2 * s, atol=tol, rtol=tol)
    assert torch.equal(pool[0, 3], qkv[0, H * hd:(H + 1) * hd])           # K of row 0 -> slot 3
    assert torch.equal(pool[1, 1], orig[1, (H + 1) * hd:])                # V of row 1 -> slot 1
    assert math.isfinite(float(pool.float().sum()))


# ----------------------------------------------------------------------------- real model
@pytest.mark.model
def test_quantised_perplexity_within_budget(default_model_path):
    """int8 and w8a8 (smoothed) within 2 %, int4 within 5 % of the unquantised forward's perplexity."""
    import importlib.util
    import pathlib
    from shepherd.config import EngineConfig
    from shepherd.engine.torch_executor import TorchExecutor
    spec = importlib.util.spec_from_file_location(
        "quant_quality", pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "quant_quality.py")
    qq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qq)
    ppl = {}
    for q in ("none", "int8", "int4", "w8a8"):
        ex = TorchExecutor(EngineConfig(model=default_model_path, dtype="bfloat16", quantization=q,
                                        max_total_tokens=1024))
        assert ex.quantization == q if q != "none" else ex.quantization == "none"
        ppl[q] = qq.perplexity(ex, ex.tokenizer.encode(qq.TEXT))
    assert 1.0 < ppl["none"] < 100
    assert ppl["int8"] <= ppl["none"] * 1.02, ppl
    assert ppl["int4"] <= ppl["none"] * 1.05, ppl
    assert ppl["w8a8"] <= ppl["none"] * 1.02, ppl


def test_w8a8_row_quantisation_kernels_equal_their_torch_twins(kern):
    """quant_rows / dequant in C give the pure-torch path's bits (so --kernels torch and fused
    w8a8 agree), and an all-zero row quantises to zeros instead of dividing by zero."""
    k, dt = kern
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 576, generator=g) * torch.rand(7, 1, generator=g) * 20).to(dt)
    x[3] = 0
    q, s = k.quant_rows(x)
    q2, s2 = quant.quant_rows(x)
    assert torch.equal(q, q2) and torch.equal(s, s2)
    assert q[3].abs().sum() == 0 and int(q.abs().max()) == 127
    w = torch.randint(-127, 128, (96, 576), dtype=torch.int8, generator=g)
    acc = torch._int_mm(q, w.t())
    assert torch.equal(acc.long(), q.long() @ w.long().t())          # the integer GEMM is exact
    sw, b = torch.rand(96, generator=g), torch.randn(96, generator=g).to(dt)
    for bias in (None, b):
        for out in (dt, torch.float32):
            assert torch.equal(k.dequant(acc, s, sw, bias, out), quant.dequant(acc, s2, sw, bias, out))


def test_argmax_rows_matches_torch_argmax():
    from shepherd.model.kernels import argmax_rows
    g = torch.Generator().manual_seed(4)
    for shape in ((64, 49152), (1, 17), (3, 5), (2, 40)):
        x = torch.randn(*shape, generator=g)
        assert torch.equal(argmax_rows(x), x.argmax(-1)), shape
    x = torch.zeros(4, 100)
    x[1, 50] = x[1, 70] = 1.0                       # ties: the first index
    x[2, 5] = x[2, 9] = float("nan")                # NaN wins, the first one
    x[3] = float("-inf")
    assert argmax_rows(x).tolist() == x.argmax(-1).tolist() == [0, 50, 5, 0]


def test_w4a8_kernel_matches_the_dequantised_weights_and_is_row_invariant():
    """The int4 x int8 VNNI kernel: within int8-activation error of x @ dequantize(W)^T, and a
    row's bits are the same computed alone or among 1, 3, 5 or 64 rows."""
    from shepherd.model import kernels
    lib = kernels.load()
    if lib is None or not kernels.Kernels(lib, torch.bfloat16).w4a8:
        pytest.skip("no AVX512-VNNI kernel on this CPU (int4 runs torch's kernel)")
    k = kernels.Kernels(lib, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    for N, K in ((96, 64), (576, 1536)):
        qw = quant.quantize_int4(torch.randn(N, K, generator=g) * 0.05)
        packed = quant.pack_w4a8(qw)
        ref_w = quant.dequantize(qw)
        x = torch.randn(64, K, generator=g).to(torch.bfloat16)
        full = k.w4a8_mm(x, packed, N)
        ref = x.float() @ ref_w.t()
        assert ((full.float() - ref).abs().max() / ref.abs().max()) < 0.02
        for M in (1, 3, 5):
            assert torch.equal(k.w4a8_mm(x[-M:].contiguous(), packed, N), full[-M:])


def _kernel_owner():
    from shepherd.model import kernels
    lib = kernels.load()
    if lib is None:
        pytest.skip("no C compiler: the fused kernels are off")
    k = kernels.Kernels(lib, torch.bfloat16)
    return k, type("O", (), dict(kernels=k, batch_invariant=True, min_rows=1, row_tile=0, use_mkldnn=True,
                                 device=torch.device("cpu")))()


def test_bf16_gemm_kernel_matches_float_matmul_and_is_row_invariant():
    """The bf16 GEMM behind llama.Linear: within float32-accumulation error of x @ W^T (+ b),
    float32 logits straight from the accumulators, and a row's bits the same alone or among many
    rows (so the batch-invariant mode needs no padding rows with it). Both forms of its inner
    block (float32 FMAs; vdpbf16ps where the CPU has it)."""
    k, owner = _kernel_owner()
    if not k.bf16_mm:
        pytest.skip("no AVX-512 on this CPU (oneDNN runs the bf16 GEMMs)")
    forms = ["fma"] + (["dpbf16"] if k.lib.has_bf16_dp() else [])
    for form in forms:   # both inner blocks, whichever this process would pick
        k.bf16_form = form
        _check_bf16_gemm(owner, form)


def _check_bf16_gemm(owner, form):
    from shepherd.model.llama import Linear
    g = torch.Generator().manual_seed(6)
    for N, K, bias in ((96, 64, True), (960, 576, False), (576, 1536, False)):
        w = torch.randn(N, K, generator=g).bfloat16()
        b = torch.randn(N, generator=g).bfloat16() if bias else None
        lin = Linear(w, b, owner)
        assert lin.tiles is not None
        x = torch.randn(37, K, generator=g).bfloat16()
        ref = x.float() @ w.float().t() + (b.float() if bias else 0)
        logits = lin.logits(x)
        assert logits.dtype == torch.float32
        assert (logits - ref).abs().max() <= 1e-5 * ref.abs().max() * K ** 0.5
        full = lin(x)
        assert torch.equal(full, logits.bfloat16())   # one rounding of the same sums
        for M in (1, 2, 3, 4, 5, 6, 7, 9, 11, 13):   # across the kernel's 5- and 6-row blocks
            for s in (0, 37 - M):
                assert torch.equal(lin(x[s:s + M]), full[s:s + M]), f"{form}: M={M} at {s}"


def test_int8_weight_kernel_matches_the_dequantised_weights_and_is_row_invariant():
    """The int8-weight x bf16 kernel (int8 mode, and the LM head of int4 models): float32 sums of
    exact products, so within float32 error of x @ dequantize(W)^T; a row's bits do not depend on M."""
    k, owner = _kernel_owner()
    if not k.w8:
        pytest.skip("no AVX-512 on this CPU (torch's int8 kernel runs)")
    g = torch.Generator().manual_seed(7)
    qw = quant.quantize_int8(torch.randn(192, 576, generator=g))
    lin = quant.QLinear(qw, None, owner, torch.bfloat16)
    assert lin.w8 is not None
    x = torch.randn(21, 576, generator=g).bfloat16()
    ref = x.double() @ quant.dequantize(qw).double().t()
    logits = lin.logits(x)
    assert ((logits.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    full = lin(x)
    assert torch.equal(full, logits.bfloat16())
    for M in (1, 2, 3, 4, 5, 8):
        for s in (0, 21 - M):
            assert torch.equal(lin(x[s:s + M]), full[s:s + M]), f"M={M} at {s}"


def test_bf16_gemm_form_override_is_checked(monkeypatch):
    """$SHEPHERD_BF16_MM picks the bf16 GEMM's inner block; a value that is not a form is an
    error naming the choices, not a silent fallback."""
    lib = kernels.load()
    if lib is None or not lib.has_bf16_mm():
        pytest.skip("no AVX-512 kernels on this machine")
    monkeypatch.setattr(kernels, "_form", None)
    monkeypatch.setenv("SHEPHERD_BF16_MM", "fma")
    assert kernels.bf16_form(lib) == "fma"
    monkeypatch.setattr(kernels, "_form", None)
    monkeypatch.setenv("SHEPHERD_BF16_MM", "amx")
    with pytest.raises(ValueError, match="fma, dpbf16"):
        kernels.bf16_form(lib)
