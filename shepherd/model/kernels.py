"""Fused CPU kernels (kernels.c), built with gcc at first use and called through ctypes.

Why plain C + ctypes rather than a torch extension: it builds in about a second (a torch
extension needs the torch headers: a minute on this machine), and the kernels only need
raw pointers. OpenMP regions run on torch's own libgomp (already loaded by `import torch`,
same soname), so the two share one thread pool and torch.set_num_threads applies to both.

The build lands in $SHEPHERD_CACHE_DIR (default <repo>/.cache/kernels), keyed by a hash of
the source, the generated header and the compiler flags, so a restart reuses it. If gcc is
missing or the build fails, `load()` returns None and the model runs its pure-torch path. The
seam itself (every kernel's signature, the layer weight order) is declared in kernel_abi.py and
checked at load: a library that disagrees with it raises KernelABIError instead of running.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from shepherd.model import kernel_abi

log = logging.getLogger("shepherd")

@dataclass(frozen=True)
class StackWatch:
    """What the one-call layer stack (Kernels.layer_stack) watches for until it returns at an op
    boundary (between layers, or between the ops of one): a look every `probe` s (kernels.c forward_bf16: each thread's CPU time against the
    wall time since the last look); it returns at the first look when `least` is None (a time
    budget), else at the first look where a thread got less than `least` of the wall. In a
    forward of at most `stretch_rows` rows, an op that took `stretch` s or more also makes the
    next op boundary a look, and the stack returns there whatever it finds (0: no such looks)."""
    probe: float
    least: Optional[float] = None
    stretch: float = 0.0
    stretch_rows: int = 0


@dataclass(frozen=True)
class StackLook:
    """The look the stack returned at: the least share of the wall a thread of the team got as
    CPU time, the team's CPUs (their sum), over `wall` s since the last look; `op`: the longest
    op's wall time in that while, s, where the watch's stretch applied (else 0)."""
    least: float
    cpus: float
    wall: float
    op: float = 0.0


# the ops of one layer in the one-call stack: kernels.layer_stack counts in them, and can stop
# and start again at the boundary before any of them
STACK_OPS = len(kernel_abi.FORWARD_STAGES)

# what a between-layers hook returns (model/llama.py): None (no more looks in this forward), a
# StackWatch, or s to its next call (a StackWatch(s): a time budget)
Watch = Union[None, float, StackWatch]

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


def build() -> Optional[str]:
    """The path of the built library (built now unless cached), or None (no compiler, or it failed)."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        log.warning("no C compiler found: fused kernels off, pure-torch forward")
        return None
    header = kernel_abi.abi_header().encode()
    src = header
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
    with tempfile.TemporaryDirectory() as inc:
        with open(os.path.join(inc, "kernel_abi.h"), "wb") as f:
            f.write(header)
        r = subprocess.run([cc, *_FLAGS, "-I", inc, _SRC, "-o", tmp, "-lm"], capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(tmp)
        log.warning("building the fused kernels failed (pure-torch forward instead):\n%s", r.stderr[-2000:])
        return None
    os.replace(tmp, so)   # atomic: concurrent builders never load a half-written file
    log.info("fused kernels built in %.1f s (%s)", time.perf_counter() - t0, so)
    return so


def load() -> Optional[kernel_abi.KernelLib]:
    """The kernel library bound through kernel_abi, or None (no compiler, or the build or the
    dlopen failed). A library whose signatures disagree with kernel_abi.KERNELS raises
    KernelABIError: that is a bug to fix, not a reason to fall back."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    try:
        so = build()
        cdll = None if so is None else ctypes.CDLL(so)
    except Exception as e:  # noqa: BLE001 - any failure here means: run the pure-torch path
        log.warning("loading the fused kernels failed (%s): pure-torch forward", e)
        cdll = None
    _lib = None if cdll is None else kernel_abi.bind(cdll)
    return _lib


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) of a float32 [S, V] CPU tensor, 5-10x faster (torch's last-dim argmax
    does not vectorise here); torch's own where there is no kernel library."""
    lib = load()
    if lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0:
        return x.argmax(-1)
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.argmax_rows(x=x, rows=x.shape[0], V=x.shape[1], out=out)
    return out


def unpack_bitmask(bitmask: torch.Tensor, V: int) -> torch.Tensor:
    """int32 token bitmask [S, W] (bit b of word w: token 32 w + b allowed) -> bool [S, V]."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :V].bool()


def _check_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> None:
    W = (x.shape[-1] + 31) // 32
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[1] != W or not bitmask.is_contiguous():
        raise ValueError(f"bitmask must be a contiguous int32 [rows, {W}] tensor for {x.shape[-1]} tokens, "
                         f"got {bitmask.dtype} {tuple(bitmask.shape)}")


def argmax_masked_rows(x: torch.Tensor, bitmask: torch.Tensor, mrow: list[int]) -> torch.Tensor:
    """argmax_rows(x) with row r read through bitmask row mrow[r] (a clear bit reads -inf; no mask
    where mrow[r] < 0): the index argmax_rows gives after masking, without writing x."""
    _check_bitmask(x, bitmask)
    lib = load()
    if lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0:
        x = x.clone()
        rows = [r for r, m in enumerate(mrow) if m >= 0]
        if rows:
            keep = unpack_bitmask(bitmask[[mrow[r] for r in rows]].to(x.device), x.shape[1])
            x[rows] = x[rows].masked_fill(~keep, float("-inf"))
        return argmax_rows(x)
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    rows_t = torch.tensor(mrow, dtype=torch.long)
    lib.argmax_masked_rows(x=x, rows=x.shape[0], V=x.shape[1], mask=bitmask, W=bitmask.shape[1], mrow=rows_t,
                           out=out)
    return out


def apply_bitmask(x: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """x[r, t] = -inf, in place, for each r in rows and each token t clear in bitmask row r."""
    _check_bitmask(x, bitmask)
    if not rows:
        return
    lib = load()
    if (lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2
            or x.stride(1) != 1):
        keep = unpack_bitmask(bitmask[rows].to(x.device), x.shape[1])
        x[rows] = x[rows].masked_fill(~keep, float("-inf"))
        return
    lib.bitmask_apply_rows(x=x, ld=x.stride(0), V=x.shape[1], mask=bitmask, W=bitmask.shape[1],
                           rows=torch.tensor(rows, dtype=torch.long), n=len(rows))


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


class Kernels:
    """Typed wrappers for one dtype. Tensors must be contiguous CPU tensors of that dtype
    (int64 for indices, float32 for the RoPE tables)."""

    def __init__(self, lib: kernel_abi.KernelLib, dtype: torch.dtype):
        suf = {torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]
        self.lib = lib
        self._rms = getattr(lib, f"rmsnorm_{suf}")
        self._rope = getattr(lib, f"rope_kv_{suf}")
        self._silu = getattr(lib, f"silu_mul_{suf}")
        self._attn = getattr(lib, f"attention_{suf}")
        self._lora = getattr(lib, f"lora_{suf}")
        self._quant = getattr(lib, f"quant_rows_{suf}")
        self._dequant = {dtype: getattr(lib, f"dequant_{suf}"), torch.float32: lib.dequant_f32}
        self.w4a8 = dtype == torch.bfloat16 and bool(lib.has_w4a8())   # int4 x int8 on VNNI
        self.bf16_mm = dtype == torch.bfloat16 and bool(lib.has_bf16_mm())   # bf16 weights, fp32 sums
        self.bf16_form = bf16_form(lib) if self.bf16_mm else None
        self.w8 = dtype == torch.bfloat16 and bool(lib.has_w8_mm())          # int8 weights x bf16
        # layer_stack's op scratch of the last forward's shape, kept for the next forward of that
        # shape (every decode step of one stream): its seven allocations cost ~50 us a one-row step
        # here, each torch call slow after the forward has streamed the weights through the caches
        # (benchmarks/core_loop_cost.py). One forward at a time runs on a Kernels (its executor's).
        self._stack_scratch: tuple = ((), ())

    def forward_supports(self, H: int, KVH: int, hd: int) -> bool:
        """Whether layer_stack (the layer stack in one call) runs this head shape here."""
        return (self.bf16_mm and self.lib.forward_bf16 is not None
                and bool(self.lib.forward_bf16_supports(H=H, KVH=KVH, hd=hd)))

    @staticmethod
    def layer_weights(layers: list[dict[str, Optional[torch.Tensor]]]) -> torch.Tensor:
        """layer_stack's `lw`: each layer's tensors keyed by kernel_abi.LAYER_WEIGHTS names, as
        int64 pointers in that order (0 for None). The tensors must outlive the table."""
        rows = []
        for L in layers:
            if set(L) != set(kernel_abi.LAYER_WEIGHTS):
                raise KeyError(f"layer weights {sorted(L)}: expected {list(kernel_abi.LAYER_WEIGHTS)}")
            rows += [0 if L[n] is None else L[n].data_ptr() for n in kernel_abi.LAYER_WEIGHTS]
        return torch.tensor(rows, dtype=torch.int64)

    def layer_stack(self, *, lw, x, h, H, KVH, hd, I, pos, cos, sin, kv_pool, slots, slot_tab, off, ctx,
                    max_ctx, scale, eps, lora=None, lora_rows=None
                    ) -> Callable[[int, int, Optional[StackWatch]], tuple[int, Optional[StackLook]]]:
        """One forward's layer stack (kernels.c forward_bf16) as `run(a, b, watch)`: the ops at
        positions a..b-1 (position layer * STACK_OPS + op, the ops of kernel_abi.FORWARD_STAGES),
        or, with a StackWatch, only up to the first op boundary where its look says return; it
        returns the position it stopped before (b: all done) and that look (None when all done).
        x [T, D] is updated in place to the residual stream; h [T, D] holds rmsnorm(x) * ln1 of
        layer a // STACK_OPS on entry at a layer's first op, and the op scratch (allocated here when the
        shape changes, kept from one forward to the next, never per range) carries every other op's
        input from one call to the next,
        so run(0, n, None) and runs over [0, a), [a, b), ..., [., n) give the same bits, whatever
        thread count each runs at (every op's items are computed whole by one thread).
        lw: layer_weights' table. lora: the LoRA records [L, linears, slots, fields] (model/lora.py)
        and lora_rows the step's LoraRows, or None (no row has an adapter)."""
        T, D = x.shape
        W = (H + 2 * KVH) * hd
        dp = self.bf16_form == "dpbf16"
        key = (T, D, W, H * hd, I, dp)
        if self._stack_scratch[0] != key:     # the ops' inputs and outputs: written before they are read
            e = lambda n: torch.empty((T, n), dtype=torch.bfloat16)
            self._stack_scratch = (key, (e(W), e(H * hd), e(2 * I), e(I), e(D),
                                         torch.empty(0 if dp else T * max(D, H * hd, I), dtype=torch.float32),
                                         torch.zeros(4, dtype=torch.float32)))
        qkv, att, gu, act, tmp, xf, seen = self._stack_scratch[1]
        call = functools.partial(
            self.lib.forward_bf16, lw=lw, x=x, h=h, qkv=qkv, att=att, gu=gu, act=act, tmp=tmp, xf=xf,
            M=T, D=D, H=H, KVH=KVH, hd=hd, I=I, pos=pos, cos_t=cos, sin_t=sin, pool=kv_pool,
            layer_elems=kv_pool.numel() // kv_pool.shape[0], cap1=kv_pool.shape[2], slots=slots, slot_tab=slot_tab,
            off=off, ctx=ctx, max_ctx=max_ctx, scale=scale, eps=eps, dp=int(dp),
            lora=None if lora_rows is None else lora, lora_slots=0 if lora is None else lora.shape[2],
            lrows=None if lora_rows is None else lora_rows.lrows,
            litems=None if lora_rows is None else lora_rows.litems,
            lslot=None if lora_rows is None else lora_rows.lslot,
            nitems=0 if lora_rows is None else lora_rows.nitems, seen=seen)

        def run(a: int, b: int, watch: Optional[StackWatch]) -> tuple[int, Optional[StackLook]]:
            if watch is None:
                return call(s0=a, S=b, probe=-1.0, least=0.0, stop=0, stretch=0.0), None
            nxt = call(s0=a, S=b, probe=watch.probe, least=watch.least or 0.0, stop=int(watch.least is None),
                       stretch=watch.stretch if T <= watch.stretch_rows else 0.0)
            return nxt, (StackLook(*seen.tolist()) if nxt < b else None)
        return run

    def rmsnorm(self, x, w, eps, delta=None, h=None) -> torch.Tensor:
        """With delta: x += delta (in place, rounded). Returns h = rmsnorm(x) * w."""
        rows, D = x.shape
        if h is None:
            h = torch.empty_like(x)
        self._rms(x=x, delta=delta, x_out=x, w=w, h=h, rows=rows, D=D, eps=eps)
        return h

    def rope_kv(self, qkv, H, KVH, hd, pos, cos, sin, pool_layer, slots) -> None:
        self._rope(qkv=qkv, rows=qkv.shape[0], H=H, KVH=KVH, hd=hd, pos=pos, cos_t=cos, sin_t=sin, pool=pool_layer,
                   cap1=pool_layer.shape[1], slots=slots)

    def silu_mul(self, gu) -> torch.Tensor:
        rows, I2 = gu.shape
        out = gu.new_empty((rows, I2 // 2))
        self._silu(gu=gu, out=out, rows=rows, I=I2 // 2)
        return out

    def attention(self, qkv, pool_layer, H, KVH, hd, slot_tab, off, ctx, max_ctx, scale) -> torch.Tensor:
        rows = qkv.shape[0]
        out = qkv.new_empty((rows, H * hd))
        self._attn(q=qkv, q_stride=qkv.shape[1], pool=pool_layer, cap1=pool_layer.shape[1], out=out, rows=rows, H=H,
                   KVH=KVH, hd=hd, slot_tab=slot_tab, off=off, ctx=ctx, max_ctx=max_ctx, scale=scale)
        return out

    def lora(self, x, y, rec, rows) -> None:
        """y [T, N] += each adapter row's LoRA update, in place (model/lora.py): x [T, K] is the
        linear's input, rec the linear's records (one per adapter slot), rows the step's LoraRows."""
        self._lora(x=x, K=x.shape[1], y=y, ldy=y.shape[1], rec=rec, lrows=rows.lrows, litems=rows.litems,
                   lslot=rows.lslot, nitems=rows.nitems)

    def quant_rows(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> int8 [M, K] and float32 scales [M] (one per row)."""
        rows, K = x.shape
        q = torch.empty((rows, K), dtype=torch.int8)
        s = torch.empty(rows, dtype=torch.float32)
        self._quant(x=x, q=q, s=s, rows=rows, K=K)
        return q, s

    def dequant(self, acc, sx, sw, bias, dtype) -> torch.Tensor:
        """int32 acc [M, N] -> dtype (the model's, or float32): acc * sx[row] * sw[col] (+ bias)."""
        rows, N = acc.shape
        y = torch.empty((rows, N), dtype=dtype)
        if bias is not None and bias.dtype != dtype:
            bias = bias.to(dtype)
        self._dequant[dtype](acc=acc, sx=sx, sw=sw, bias=bias, y=y, rows=rows, N=N)
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
        self.lib.quant_groups_bf16(x=x, q=q, dx=dx, sx=sx, rows=rows, K=K)
        self.lib.w4a8_mm_bf16(xq=q, dx=dx, sx=sx, rows=rows, K=K, w=packed, N=N, y=y)
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
            self.lib.bf16_mm(x=x, rows=rows, K=K, w=packed, N=N, bias=bias, y=y,
                             out_f32=int(out_dtype == torch.float32), dp=int(self.bf16_form == "dpbf16"))
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
            self.lib.w8_mm_bf16(x=x, rows=rows, K=K, w=packed, s=scale, N=N, y=y,
                                out_f32=int(out_dtype == torch.float32))
        return y
