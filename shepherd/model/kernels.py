"""Fused CPU kernels (kernels.c), built with gcc at first use and called through ctypes.

Why plain C + ctypes rather than a torch extension: it builds in about a second (a torch
extension needs the torch headers: a minute on this machine), and the kernels only need
raw pointers. OpenMP regions run on torch's own libgomp (already loaded by `import torch`,
same soname), so the two share one thread pool and torch.set_num_threads applies to both.

The build lands in $SHEPHERD_CACHE_DIR (default <repo>/.cache/kernels), keyed by a hash of
the source and the compiler flags, so a restart reuses it. If gcc is missing or the build
fails, `load()` returns None and the model runs its pure-torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from typing import Optional

import torch

log = logging.getLogger("shepherd")

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.c")
# -fno-trapping-math lets the float->int step of fexp vectorise; it changes no value.
_FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_lib = None
_tried = False


def cache_dir() -> str:
    d = os.environ.get("SHEPHERD_CACHE_DIR")
    if not d:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        d = os.path.join(root, ".cache")
    return os.path.join(d, "kernels")


def _build() -> Optional[str]:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        log.warning("no C compiler found: fused kernels off, pure-torch forward")
        return None
    src = b""
    for path in (_SRC, _SRC[:-2] + "_body.h"):   # the build key covers the included body too
        with open(path, "rb") as f:
            src += f.read()
    key = hashlib.sha256(src + " ".join([cc] + _FLAGS).encode()).hexdigest()[:16]
    out_dir = cache_dir()
    so = os.path.join(out_dir, f"shepherd_kernels_{key}.so")
    if os.path.exists(so):
        return so
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError:   # e.g. an installed, read-only package tree
        out_dir = os.path.join(tempfile.gettempdir(), "shepherd-kernels")
        os.makedirs(out_dir, exist_ok=True)
        so = os.path.join(out_dir, os.path.basename(so))
        if os.path.exists(so):
            return so
    t0 = time.perf_counter()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    r = subprocess.run([cc, *_FLAGS, _SRC, "-o", tmp, "-lm"], capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(tmp)
        log.warning("building the fused kernels failed (pure-torch forward instead):\n%s", r.stderr[-2000:])
        return None
    os.replace(tmp, so)   # atomic: concurrent builders never load a half-written file
    log.info("fused kernels built in %.1f s (%s)", time.perf_counter() - t0, so)
    return so


_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGS = {
    "rmsnorm": [_P, _P, _P, _P, _P, _I, _I, _F],
    "rope_kv": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _I, _P],
    "silu_mul": [_P, _P, _I, _I],
    "attention": [_P, _I, _P, _I, _P, _I, _I, _I, _I, _P, _P, _P, _I, _F],
    "quant_rows": [_P, _P, _P, _I, _I],
    "dequant": [_P, _P, _P, _P, _P, _I, _I],
}


def load():
    """The kernel library, or None (no compiler, or the build or load failed)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    try:
        so = _build()
        if so is None:
            return None
        lib = ctypes.CDLL(so)
        for suf in ("bf16", "f32"):
            for name, args in _SIGS.items():
                fn = getattr(lib, f"{name}_{suf}")
                fn.argtypes = args
                fn.restype = None
        lib.argmax_rows.argtypes = [_P, _I, _I, _P]
        lib.argmax_rows.restype = None
        lib.has_w4a8.restype = ctypes.c_int
        lib.has_bf16_mm.restype = ctypes.c_int
        if lib.has_bf16_mm():
            lib.bf16_mm.argtypes = [_P, _I, _I, _P, _I, _P, _P, ctypes.c_int, ctypes.c_int]
            lib.bf16_mm.restype = None
            lib.bf16_dp_pays.restype = lib.has_bf16_dp.restype = ctypes.c_int
        lib.has_w8_mm.restype = ctypes.c_int
        lib.forward_bf16_supports.argtypes = [_I, _I, _I]
        lib.forward_bf16_supports.restype = ctypes.c_int
        if hasattr(lib, "forward_bf16"):
            lib.forward_bf16.argtypes = [_I, _P] + [_P] * 8 + [_I] * 6 + [_P] * 4 + [_I, _I, _P, _P, _P, _P, _I,
                                                                                _F, _F, ctypes.c_int]
            lib.forward_bf16.restype = None
        if lib.has_w8_mm():
            lib.w8_mm_bf16.argtypes = [_P, _I, _I, _P, _P, _I, _P, ctypes.c_int]
            lib.w8_mm_bf16.restype = None
        if lib.has_w4a8():
            lib.quant_groups_bf16.argtypes = [_P, _P, _P, _P, _I, _I]
            lib.w4a8_mm_bf16.argtypes = [_P, _P, _P, _I, _I, _P, _I, _P]
            lib.quant_groups_bf16.restype = lib.w4a8_mm_bf16.restype = None
        _lib = lib
    except Exception as e:  # noqa: BLE001 - any failure here means: run the pure-torch path
        log.warning("loading the fused kernels failed (%s): pure-torch forward", e)
        _lib = None
    return _lib


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) of a float32 [S, V] CPU tensor, 5-10x faster (torch's last-dim argmax
    does not vectorise here); torch's own where there is no kernel library."""
    lib = load()
    if lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0:
        return x.argmax(-1)
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


_form: Optional[str] = None
BF16_FORMS = ("fma", "dpbf16")


def bf16_form(lib) -> str:
    """Which inner block bf16_mm runs, fixed for the process so that results do not change
    mid-run: $SHEPHERD_BF16_MM (fma | dpbf16) if set, else dpbf16 where the CPU has it and it
    does at least the FMA form's MACs per second (a 1 ms probe in kernels.c), else fma."""
    global _form
    if _form is None:
        want = os.environ.get("SHEPHERD_BF16_MM", "").strip().lower()
        if want and want not in BF16_FORMS:
            raise ValueError(f"SHEPHERD_BF16_MM={want!r}: expected one of {', '.join(BF16_FORMS)}")
        if want == "dpbf16" and not lib.has_bf16_dp():
            raise ValueError("SHEPHERD_BF16_MM=dpbf16: this CPU has no AVX512-BF16")
        _form = want or ("dpbf16" if lib.bf16_dp_pays() else "fma")
        log.info("bf16 GEMM: %s form", _form)
    return _form


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


class Kernels:
    """Typed wrappers for one dtype. Tensors must be contiguous CPU tensors of that dtype
    (int64 for indices, float32 for the RoPE tables)."""

    def __init__(self, lib, dtype: torch.dtype):
        suf = {torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]
        self._lib = lib
        self._rms = getattr(lib, f"rmsnorm_{suf}")
        self._rope = getattr(lib, f"rope_kv_{suf}")
        self._silu = getattr(lib, f"silu_mul_{suf}")
        self._attn = getattr(lib, f"attention_{suf}")
        self._quant = getattr(lib, f"quant_rows_{suf}")
        self._dequant = {dtype: getattr(lib, f"dequant_{suf}"), torch.float32: lib.dequant_f32}
        self.w4a8 = dtype == torch.bfloat16 and bool(lib.has_w4a8())   # int4 x int8 on VNNI
        self.bf16_mm = dtype == torch.bfloat16 and bool(lib.has_bf16_mm())   # bf16 weights, fp32 sums
        self.bf16_form = bf16_form(lib) if self.bf16_mm else None
        self.w8 = dtype == torch.bfloat16 and bool(lib.has_w8_mm())          # int8 weights x bf16

    def forward_supports(self, H: int, KVH: int, hd: int) -> bool:
        """Whether forward_layers (the layer stack in one call) runs this head shape here."""
        return (self.bf16_mm and hasattr(self._lib, "forward_bf16")
                and bool(self._lib.forward_bf16_supports(H, KVH, hd)))

    def forward_layers(self, lw, x, h, H, KVH, hd, I, pos, cos, sin, kv_pool, slots, slot_tab, off, ctx,
                       max_ctx, scale, eps) -> None:
        """All layers at once (kernels.c forward_bf16): x [T, D] is updated in place to the residual
        stream after the last layer; h [T, D] holds rmsnorm(x) * ln1 of layer 0 on entry (scratch
        after). lw: int64 [layers * 7] weight pointers, built by LlamaModel."""
        T, D = x.shape
        W = (H + 2 * KVH) * hd
        e = lambda n: torch.empty((T, n), dtype=torch.bfloat16)
        qkv, att, gu, act, tmp = e(W), e(H * hd), e(2 * I), e(I), e(D)
        dp = self.bf16_form == "dpbf16"
        xf = torch.empty(0 if dp else T * max(D, H * hd, I), dtype=torch.float32)
        self._lib.forward_bf16(kv_pool.shape[0], lw.data_ptr(), x.data_ptr(), h.data_ptr(), qkv.data_ptr(),
                               att.data_ptr(), gu.data_ptr(), act.data_ptr(), tmp.data_ptr(), xf.data_ptr(), T, D,
                               H, KVH, hd, I, pos.data_ptr(), cos.data_ptr(), sin.data_ptr(), kv_pool.data_ptr(),
                               kv_pool[0].numel(), kv_pool.shape[2], slots.data_ptr(), slot_tab.data_ptr(),
                               off.data_ptr(), ctx.data_ptr(), max_ctx, scale, eps, int(dp))

    def rmsnorm(self, x, w, eps, delta=None, h=None) -> torch.Tensor:
        """With delta: x += delta (in place, rounded). Returns h = rmsnorm(x) * w."""
        rows, D = x.shape
        if h is None:
            h = torch.empty_like(x)
        self._rms(x.data_ptr(), _ptr(delta), x.data_ptr(), w.data_ptr(), h.data_ptr(), rows, D, eps)
        return h

    def rope_kv(self, qkv, H, KVH, hd, pos, cos, sin, pool_layer, slots) -> None:
        self._rope(qkv.data_ptr(), qkv.shape[0], H, KVH, hd, pos.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                   pool_layer.data_ptr(), pool_layer.shape[1], slots.data_ptr())

    def silu_mul(self, gu) -> torch.Tensor:
        rows, I2 = gu.shape
        out = gu.new_empty((rows, I2 // 2))
        self._silu(gu.data_ptr(), out.data_ptr(), rows, I2 // 2)
        return out

    def attention(self, qkv, pool_layer, H, KVH, hd, slot_tab, off, ctx, max_ctx, scale) -> torch.Tensor:
        rows = qkv.shape[0]
        out = qkv.new_empty((rows, H * hd))
        self._attn(qkv.data_ptr(), qkv.shape[1], pool_layer.data_ptr(), pool_layer.shape[1], out.data_ptr(),
                   rows, H, KVH, hd, slot_tab.data_ptr(), off.data_ptr(), ctx.data_ptr(), max_ctx, scale)
        return out

    def quant_rows(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> int8 [M, K] and float32 scales [M] (one per row)."""
        rows, K = x.shape
        q = torch.empty((rows, K), dtype=torch.int8)
        s = torch.empty(rows, dtype=torch.float32)
        self._quant(x.data_ptr(), q.data_ptr(), s.data_ptr(), rows, K)
        return q, s

    def dequant(self, acc, sx, sw, bias, dtype) -> torch.Tensor:
        """int32 acc [M, N] -> dtype (the model's, or float32): acc * sx[row] * sw[col] (+ bias)."""
        rows, N = acc.shape
        y = torch.empty((rows, N), dtype=dtype)
        if bias is not None and bias.dtype != dtype:
            bias = bias.to(dtype)
        self._dequant[dtype](acc.data_ptr(), sx.data_ptr(), sw.data_ptr(), _ptr(bias), y.data_ptr(), rows, N)
        return y

    def w4a8_mm(self, x, packed, N) -> torch.Tensor:
        """x [M, K] bf16 @ int4 weights packed by quant.pack_w4a8 -> [M, N] bf16, with each row's
        groups of 32 quantised to int8 first."""
        rows, K = x.shape
        y = torch.empty((rows, N), dtype=torch.bfloat16)
        if rows == 0:
            return y
        q = torch.empty((rows, K), dtype=torch.int8)
        dx = torch.empty((rows, K // 32), dtype=torch.float32)
        sx = torch.empty_like(dx)
        self._lib.quant_groups_bf16(x.data_ptr(), q.data_ptr(), dx.data_ptr(), sx.data_ptr(), rows, K)
        self._lib.w4a8_mm_bf16(q.data_ptr(), dx.data_ptr(), sx.data_ptr(), rows, K, packed.data_ptr(), N,
                               y.data_ptr())
        return y

    @staticmethod
    def pack_bf16(w: torch.Tensor) -> torch.Tensor:
        """bf16 [N, K] (N % 16 == 0, K even) -> bf16_mm's tiles: 16 rows, k-pair major (kernels.c)."""
        N, K = w.shape
        return w.contiguous().view(N // 16, 16, K // 2, 2).permute(0, 2, 1, 3).contiguous()

    def mm_bf16(self, x, packed, N, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
        """x [M, K] bf16 @ weights packed by pack_bf16 (+ bias) -> [M, N] bf16 or float32."""
        rows, K = x.shape
        y = torch.empty((rows, N), dtype=out_dtype)
        if rows:
            self._lib.bf16_mm(x.data_ptr(), rows, K, packed.data_ptr(), N, _ptr(bias), y.data_ptr(),
                              int(out_dtype == torch.float32), int(self.bf16_form == "dpbf16"))
        return y

    @staticmethod
    def pack_w8(q: torch.Tensor) -> torch.Tensor:
        """int8 [N, K] (N % 64 == 0) -> w8_mm's units: 64 rows, k-major (kernels.c)."""
        N, K = q.shape
        return q.contiguous().view(N // 64, 64, K).transpose(1, 2).contiguous()

    def w8_mm(self, x, packed, scale, out_dtype=torch.bfloat16) -> torch.Tensor:
        """x [M, K] bf16 @ int8 weights packed by pack_w8, times float32 row scales -> [M, N]."""
        rows, K = x.shape
        N = scale.shape[0]
        y = torch.empty((rows, N), dtype=out_dtype)
        if rows:
            self._lib.w8_mm_bf16(x.data_ptr(), rows, K, packed.data_ptr(), scale.data_ptr(), N, y.data_ptr(),
                                 int(out_dtype == torch.float32))
        return y
