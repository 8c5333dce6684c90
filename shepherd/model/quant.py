"""Quantised weights and the linear layers that run them on real integer kernels (no
dequantise-then-bf16).

  * int8: weight-only, symmetric, one scale per output row -> `aten._weight_int8pack_mm`.
  * w8a8: the same int8 weights, and each activation row quantised to int8 with its own scale
    at run time (dynamic, per token) -> `torch._int_mm` (int8 x int8 -> int32, VNNI on x86),
    then y = acc * s_row * s_col. Integer sums are exact, so any kernel or batch size gives a
    row the same bits: batch invariance needs no padding here. 3-3.7x the bf16 GEMMs at 64 rows
    on an AVX-512 VNNI CPU without AMX (benchmarks/quant_gemm_ab.py, docs/MODEL.md).
  * int4: asymmetric, groups of 32 along K (GGUF's block size), w = (q - 8) * scale + zero
    -> `aten._convert_weight_to_int4pack_for_cpu` + `aten._weight_int4pack_mm_for_cpu`.

GGUF blocks load straight into these forms: Q4_0 (w = (q - 8) d) is zero = 0; Q4_1
(w = q d + m) is zero = m + 8 d; the nibbles are the kernel's q unchanged. Q8_0 has one
scale per 32 weights, which no torch int8 kernel takes: it is dequantised (exactly) and
re-quantised per row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

QUANT_MODES = ("auto", "none", "int8", "int4", "w8a8")
GROUP = 32


@dataclass
class QWeight:
    """A quantised [N, K] weight before packing (rows can still be concatenated/permuted)."""
    kind: str                         # "int8" | "w8a8" | "int4"
    q: torch.Tensor                   # int8 [N, K] (int8, w8a8) or int32 0..15 [N, K] (int4)
    scale: torch.Tensor               # float32 [N] (int8, w8a8) or [N, K/GROUP] (int4)
    zero: Optional[torch.Tensor] = None   # float32 [N, K/GROUP] (int4)

    @property
    def shape(self):
        return tuple(self.q.shape)


def cat_rows(ws: list[QWeight]) -> QWeight:
    z = None if ws[0].zero is None else torch.cat([w.zero for w in ws], 0)
    return QWeight(ws[0].kind, torch.cat([w.q for w in ws], 0), torch.cat([w.scale for w in ws], 0), z)


def quantize_int8(w: torch.Tensor, kind: str = "int8") -> QWeight:
    w = w.float()
    s = (w.abs().amax(1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
    return QWeight(kind, q, s)


def quantize_int4(w: torch.Tensor) -> QWeight:
    N, K = w.shape
    if K % GROUP:
        raise ValueError(f"int4 needs K divisible by {GROUP}, got {K}")
    g = w.float().view(N, K // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    s = ((hi - lo) / 15.0).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / s[..., None]).clamp_(0, 15).to(torch.int32).view(N, K)
    return QWeight("int4", q, s, lo + 8 * s)


def dequantize(w: QWeight) -> torch.Tensor:
    if w.kind in ("int8", "w8a8"):
        return w.q.float() * w.scale[:, None]
    N, K = w.shape
    g = (w.q.float().view(N, K // GROUP, GROUP) - 8) * w.scale[..., None] + w.zero[..., None]
    return g.view(N, K)


def quantize(w: torch.Tensor, kind: str) -> QWeight:
    return quantize_int4(w) if kind == "int4" else quantize_int8(w, kind)


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pure-torch twin of kernels.c's quant_rows: int8 rows and one float32 scale per row."""
    xf = x.float()
    s = xf.abs().amax(1).clamp_min(1e-10) / 127.0
    return torch.round(xf / s[:, None]).clamp_(-127, 127).to(torch.int8), s


def dequant(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, b, dtype) -> torch.Tensor:
    y = (acc.float() * sx[:, None] * sw[None, :]).to(dtype)
    return y if b is None else y + b


def from_gguf_q4(raw: np.ndarray, shape: tuple[int, int], has_min: bool) -> QWeight:
    """GGUF Q4_0 (18-byte blocks: f16 d, 16 bytes of nibbles) or Q4_1 (20 bytes: f16 d,
    f16 m, nibbles) rows -> int4 groups of 32, bit for bit the same weights."""
    N, K = shape
    bsz = 20 if has_min else 18
    b = np.ascontiguousarray(raw).reshape(N, K // GROUP, bsz)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., bsz - 16:]
    q = np.concatenate([qs & 15, qs >> 4], -1).reshape(N, K).astype(np.int32)
    if has_min:
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    else:
        zero = np.zeros_like(d)
    return QWeight("int4", torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero))


def pack_w4a8(w: QWeight) -> torch.Tensor:
    """int4 QWeight -> the w4a8 kernel's blocks (kernels.c: 16 rows x one group of 32 per
    320 bytes: nibbles, then d and m = zero - 8 d as fp16). N % 16 == 0, K % 32 == 0."""
    N, K = w.shape
    NT, NG = N // 16, K // GROUP
    q = w.q.numpy().astype(np.uint8).reshape(NT, 16, NG, GROUP).transpose(0, 2, 1, 3)     # t, g, l, k
    lo = q[..., :16].reshape(NT, NG, 16, 4, 4).transpose(0, 1, 3, 2, 4)                   # t, g, c, l, j
    hi = q[..., 16:].reshape(NT, NG, 16, 4, 4).transpose(0, 1, 3, 2, 4)
    nib = (lo | (hi << 4)).reshape(NT, NG, 256)
    per = lambda a: np.ascontiguousarray(a.numpy().reshape(NT, 16, NG).transpose(0, 2, 1)).astype(np.float16)
    d = per(w.scale)
    m = per(w.zero - 8 * w.scale)
    blk = np.concatenate([nib, d.view(np.uint8), m.view(np.uint8)], -1)
    return torch.from_numpy(np.ascontiguousarray(blk).reshape(-1))


def permute_rows(w: QWeight, fn) -> QWeight:
    """Apply a row permutation written for numpy arrays to every per-row part."""
    t = lambda x: None if x is None else torch.from_numpy(np.ascontiguousarray(fn(x.numpy())))
    return QWeight(w.kind, t(w.q), t(w.scale), t(w.zero))


class QLinear:
    """y = x @ W^T (+ b) with a packed int8 / int4 weight; same interface as llama.Linear."""

    def __init__(self, w: QWeight, b: Optional[torch.Tensor], owner, dtype: torch.dtype):
        self.kind = w.kind
        self.b = b
        self.owner = owner
        self.out_features, self.in_features = w.shape
        dev = getattr(owner, "device", torch.device("cpu"))
        k = getattr(owner, "kernels", None)
        self.w8 = self.w4 = None       # shepherd's int8 / int4 kernels, where built
        if w.kind == "w8a8":
            if dev.type != "cpu":
                raise ValueError("w8a8 runs on CPU only (torch._int_mm's CUDA kernel has other shape rules)")
            self.qt = w.q.contiguous().t()       # [K, N] view of the [N, K] rows: _int_mm's fast layout
            self.scale = w.scale.float().contiguous()
        elif w.kind == "int8":
            if k is not None and k.w8 and self.out_features % 64 == 0:
                # shepherd's kernel (kernels.c: w8_mm): row-invariant for any M, and faster than torch's
                # (benchmarks/quant_gemm_ab.py, the LM head table)
                self.w8 = (k.pack_w8(w.q), w.scale.float().contiguous())
            else:
                self.q = w.q.contiguous().to(dev)
                self.scale = w.scale.to(dtype).to(dev)
        else:
            if dev.type != "cpu":
                raise ValueError("int4 weights run on CPU only (torch's CUDA int4 kernel needs another packing)")
            if k is not None and k.w4a8 and self.out_features % 16 == 0 and self.in_features % GROUP == 0:
                self.w4 = pack_w4a8(w)       # int8 activations on VNNI (kernels.c: w4a8_mm)
            else:
                self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.contiguous(), 1)
                self.sz = torch.stack([w.scale, w.zero], -1).transpose(0, 1).contiguous().to(dtype)

    def raw(self, x: torch.Tensor, out_dtype=None) -> torch.Tensor:
        """out_dtype float32 (the LM head): only w8a8 and w8_mm take it from their sums directly."""
        if self.kind == "w8a8":
            return self._w8a8(x, out_dtype)
        if self.w8 is not None:
            y = self.owner.kernels.w8_mm(x.contiguous(), *self.w8, out_dtype or x.dtype)
        elif self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)
        elif self.w4 is not None:
            y = self.owner.kernels.w4a8_mm(x, self.w4, self.out_features)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.sz)
        return y if self.b is None else y + self.b

    def _w8a8(self, x: torch.Tensor, out_dtype=None) -> torch.Tensor:
        out_dtype = out_dtype or x.dtype
        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features), dtype=out_dtype)
        k = getattr(self.owner, "kernels", None)
        xq, sx = k.quant_rows(x) if k is not None else quant_rows(x)
        acc = torch._int_mm(xq, self.qt)
        if k is not None:
            return k.dequant(acc, sx, self.scale, self.b, out_dtype)
        return dequant(acc, sx, self.scale, self.b, out_dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 output (the LM head), straight from the sums where the kernel can."""
        if self.kind == "w8a8" or self.w8 is not None:
            return self.raw(x, torch.float32)
        return self(x).float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        o = self.owner
        M = x.shape[0]
        if o.batch_invariant and M < o.min_rows:
            return self.raw(torch.cat([x, x.new_zeros((o.min_rows - M, x.shape[1]))], 0))[:M]
        return self.raw(x)
