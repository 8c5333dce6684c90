"""Step time of one scheduled batch: the simulator's stand-in for the GPU.

Two kinds of model, one interface:

* `RooflineCostModel(model, gpu, tp)`: bytes moved / HBM bandwidth vs FLOPs /
  peak FLOPS (whichever is larger, each with an efficiency factor), plus a
  fixed per-step overhead and, for tensor parallel > 1, two all-reduces per
  layer. Presets: `MODELS` (Llama-3-8B, Llama-2-7B, Llama-2-70B,
  SmolLM2-135M) and `GPUS` (H100, H200, A100-80GB, A10G, CPU = this machine).
* `FittedCostModel`: step time = interp(batch tokens) + linear terms in
  attended context, prefill attention pairs and sequence count, fitted to
  measurements: vidur operator profiles (`from_vidur`), splitwise-sim's
  measured prompt/token times (`from_splitwise`), or `shepherd calibrate`
  timing the real torch executor on this machine (`load`/`save` JSON).

Every model answers the same questions:

    cm.step_time(batch)                 # ScheduledBatch -> seconds (SimExecutor's step_time hook)
    cm.shape_time(shape)                # BatchShape -> seconds
    cm.decode_step_times(n, ctx0, k)    # numpy array: the next k steps of a decode-only batch of
                                        # n sequences whose attended contexts sum to ctx0 (+n per step)
    cm.swap_time(num_tokens)            # host <-> device KV transfer over PCIe
    cm.kv_capacity_tokens(...)          # KV pool size from GPU memory minus weights

`decode_step_times` is what makes the simulator's fast path cheap: a
decode-only step's time is a function of (n, total context) only, and the
context grows by n per step, so k steps are one vectorised expression.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

GiB = 1024 ** 3


# --------------------------------------------------------------------------
# batch shape
# --------------------------------------------------------------------------

@dataclass
class BatchShape:
    """What a step's time depends on, extracted from a ScheduledBatch.

    num_tokens      tokens fed this step (prefill chunks + one per decode)
    num_seqs        sequences in the batch
    num_decode      of those, single-token decodes
    ctx_tokens      KV positions read by attention, summed over sequences
                    (a sequence attends over start_pos + len(chunk) positions)
    prefill_pairs   query x key pairs of prefill chunks (n*start + n(n+1)/2):
                    the quadratic part of prefill attention FLOPs
    sampled         sequences that sample a token (lm-head rows)
    swap_tokens     KV tokens moved between host and device before the step
    decode_ctx      of ctx_tokens, those read by single-token decodes
    """
    num_tokens: int = 0
    num_seqs: int = 0
    num_decode: int = 0
    ctx_tokens: int = 0
    prefill_pairs: int = 0
    sampled: int = 0
    swap_tokens: int = 0
    decode_ctx: int = 0

    @classmethod
    def decode(cls, contexts: Sequence[int]) -> "BatchShape":
        n = len(contexts)
        c = int(sum(contexts))
        return cls(num_tokens=n, num_seqs=n, num_decode=n, ctx_tokens=c, prefill_pairs=0, sampled=n,
                   decode_ctx=c)

    @classmethod
    def prefill(cls, chunk: int, start: int = 0, sample: bool = True) -> "BatchShape":
        return cls(num_tokens=chunk, num_seqs=1, num_decode=0, ctx_tokens=start + chunk,
                   prefill_pairs=chunk * start + chunk * (chunk + 1) // 2, sampled=int(sample))

    def __add__(self, o: "BatchShape") -> "BatchShape":
        return BatchShape(*(a + b for a, b in zip(astuple_(self), astuple_(o))))


def astuple_(s: BatchShape) -> tuple:
    return (s.num_tokens, s.num_seqs, s.num_decode, s.ctx_tokens, s.prefill_pairs, s.sampled,
            s.swap_tokens, s.decode_ctx)


def batch_shape(batch) -> BatchShape:
    """BatchShape of a shepherd.engine.executor.ScheduledBatch."""
    t = s = d = ctx = pairs = sampled = dctx = 0
    for seq in batch.seqs:
        n = len(seq.token_ids)
        start = seq.start_pos
        t += n
        s += 1
        ctx += start + n
        if seq.sample:
            sampled += 1
        if n == 1 and start == seq.req.num_tokens - 1:
            d += 1
            dctx += start + 1
        else:
            pairs += n * start + n * (n + 1) // 2
    swap = sum(len(op.slots) for op in batch.swap_out) + sum(len(op.slots) for op in batch.swap_in)
    return BatchShape(t, s, d, ctx, pairs, sampled, swap, dctx)


# --------------------------------------------------------------------------
# hardware and model presets
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def layer_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d + 2 * h * self.num_kv_heads * d + self.num_heads * d * h
        mlp = 3 * h * self.intermediate_size
        return attn + mlp + 2 * h

    @property
    def num_params(self) -> int:
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + self.num_layers * self.layer_params + self.hidden_size + lm_head

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def linear_flops_per_token(self) -> float:
        """Matmul FLOPs of one token through all layers (no lm head)."""
        return 2.0 * self.num_layers * (self.layer_params - 2 * self.hidden_size)

    @property
    def lm_head_flops(self) -> float:
        return 2.0 * self.vocab_size * self.hidden_size

    @property
    def attn_flops_per_pair(self) -> float:
        """QK^T and PV FLOPs for one (query, key) pair, all layers and heads."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim


@dataclass(frozen=True)
class GPUSpec:
    name: str
    mem_bytes: float          # device memory
    hbm_bw: float             # bytes/s
    peak_flops: float         # dense bf16 FLOP/s
    pcie_bw: float            # host <-> device bytes/s (swap)
    link_bw: float = 0.0      # per-GPU all-reduce bus bandwidth, bytes/s (NVLink); 0 = over PCIe
    link_latency: float = 8e-6  # per all-reduce call
    mem_eff: float = 0.8      # achieved fraction of HBM bandwidth
    compute_eff: float = 0.6  # achieved fraction of peak FLOPS (MFU of large GEMMs)
    step_overhead: float = 4.5e-4   # per-step launch/scheduling/sampling overhead, s
    seq_overhead: float = 0.0       # per-sequence overhead per step, s


MODELS: dict[str, ModelSpec] = {
    "llama-3-8b": ModelSpec("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256),
    "llama-2-7b": ModelSpec("Llama-2-7B", 32, 4096, 32, 32, 128, 11008, 32000),
    "llama-2-70b": ModelSpec("Llama-2-70B", 80, 8192, 64, 8, 128, 28672, 32000),
    "smollm2-135m": ModelSpec("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, tie_word_embeddings=True),
}

GPUS: dict[str, GPUSpec] = {
    # H100 SXM: 80 GiB HBM3 3.35 TB/s, 989 TFLOPS dense bf16, PCIe 5 x16, NVLink 4 (450 GB/s/dir)
    # mem_eff 0.8 + 0.45 ms step overhead reproduce vLLM's measured single-request
    # Llama-3-8B ITL of 6.44 ms + 4.37e-5 ms/context token to within 3% over 1k-32k.
    "h100": GPUSpec("H100", 80 * GiB, 3.35e12, 989e12, 50e9, link_bw=360e9),
    "h200": GPUSpec("H200", 141e9, 4.8e12, 989e12, 50e9, link_bw=360e9),
    "a100-80gb": GPUSpec("A100-80GB", 80 * GiB, 2.039e12, 312e12, 25e9, link_bw=240e9,
                         step_overhead=6e-4),
    # A10G (AWS g5): 24 GiB GDDR6 600 GB/s, ~70 TFLOPS dense bf16 tensor, PCIe 4, no NVLink
    "a10g": GPUSpec("A10G", 24 * GiB, 600e9, 70e12, 25e9, link_bw=0.0, step_overhead=8e-4),
    # this machine's CPU (2 vCPU AMD EPYC, AVX-512 bf16): a rough roofline only; use
    # `shepherd calibrate` for figures that should match the real engine.
    "cpu": GPUSpec("CPU", 16 * GiB, 20e9, 2.0e11, 20e9, link_bw=0.0, mem_eff=0.5,
                   compute_eff=0.35, step_overhead=5e-3, seq_overhead=2e-4),
}

_ALIASES = {
    "llama3-8b": "llama-3-8b", "meta-llama-3-8b": "llama-3-8b", "llama-3.1-8b": "llama-3-8b",
    "llama2-7b": "llama-2-7b", "llama-2-7b-hf": "llama-2-7b",
    "llama2-70b": "llama-2-70b", "llama-2-70b-hf": "llama-2-70b",
    "smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m",
    "h100-80gb": "h100", "h100-sxm": "h100", "a100": "a100-80gb", "a100-80g": "a100-80gb",
    "h200-141gb": "h200", "a10": "a10g", "this-cpu": "cpu",
}


def get_model(name: str) -> ModelSpec:
    key = name.lower().split("/")[-1]
    key = _ALIASES.get(key, key)
    if key not in MODELS:
        raise KeyError(f"unknown model {name!r}; presets: {', '.join(MODELS)}")
    return MODELS[key]


def get_gpu(name: str) -> GPUSpec:
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise KeyError(f"unknown GPU {name!r}; presets: {', '.join(GPUS)}")
    return GPUS[key]


# --------------------------------------------------------------------------
# the interface
# --------------------------------------------------------------------------

class CostModel:
    """Base: subclasses implement shape_time; the rest derives from it."""

    name = "cost-model"
    kv_bytes_per_token: int = 0
    pcie_bw: float = 25e9

    def shape_time(self, s: BatchShape) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def step_time(self, batch) -> float:
        """Seconds for one ScheduledBatch (the SimExecutor hook). Empty batch: 0."""
        if batch.empty:
            return 0.0
        s = batch_shape(batch)
        if s.num_seqs and s.num_decode == s.num_seqs and not s.swap_tokens:
            # the same expression the simulator's fast path sums, so both agree to the bit
            return self.decode_step_time(s.num_seqs, s.decode_ctx)
        return self.shape_time(s)

    __call__ = step_time

    def decode_step_times(self, n: int, ctx0: int, k: int) -> np.ndarray:
        """Times of the next k decode-only steps of n sequences whose attended
        contexts sum to ctx0 at the first step and grow by n each step."""
        return np.array([self.shape_time(BatchShape(n, n, n, ctx0 + j * n, 0, n, 0, ctx0 + j * n))
                         for j in range(k)], dtype=np.float64)

    def decode_step_time(self, n: int, ctx: int) -> float:
        """One decode-only step of n sequences attending over ctx positions in all:
        bit-for-bit the value decode_step_times gives for that step (subclasses
        override with the same expression in pure Python, which is cheaper for
        one step than a numpy call)."""
        return float(self.decode_step_times(n, ctx, 1)[0])

    decode_step_lb = decode_step_time   # step times never decrease as the context grows

    def swap_time(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return num_tokens * self.kv_bytes_per_token / self.pcie_bw

    def decode_itl(self, context: int, batch: int = 1) -> float:
        """Per-token latency of `batch` decodes each at `context` tokens."""
        return self.shape_time(BatchShape.decode([context] * batch))

    def describe(self) -> dict:
        return {"name": self.name}


# --------------------------------------------------------------------------
# roofline
# --------------------------------------------------------------------------

class RooflineCostModel(CostModel):
    def __init__(self, model: ModelSpec | str, gpu: GPUSpec | str, tp: int = 1, **gpu_overrides):
        self.model = get_model(model) if isinstance(model, str) else model
        g = get_gpu(gpu) if isinstance(gpu, str) else gpu
        self.gpu = replace(g, **gpu_overrides) if gpu_overrides else g
        if tp not in (1, 2, 4, 8):
            raise ValueError(f"tensor parallel must be 1, 2, 4 or 8, got {tp}")
        self.tp = tp
        m, gp = self.model, self.gpu
        self.name = f"roofline:{m.name}/{gp.name}" + (f"x{tp}" if tp > 1 else "")
        self.kv_bytes_per_token = m.kv_bytes_per_token
        self.pcie_bw = gp.pcie_bw * tp  # each GPU moves its shard over its own link
        bw = gp.hbm_bw * gp.mem_eff * tp
        fl = gp.peak_flops * gp.compute_eff * tp
        # memory time = mem_a + mem_ctx * ctx_tokens + mem_tok * num_tokens
        self._mem_a = m.weight_bytes / bw
        self._mem_ctx = m.kv_bytes_per_token / bw
        self._mem_tok = (m.kv_bytes_per_token + 4 * m.hidden_size * m.dtype_bytes) / bw  # KV write + act
        # compute time = c_tok * tokens + c_pair * (pairs) + c_samp * sampled
        self._c_tok = m.linear_flops_per_token / fl
        self._c_pair = m.attn_flops_per_pair / fl
        self._c_samp = m.lm_head_flops / fl
        self._ovh = gp.step_overhead
        self._seq_ovh = gp.seq_overhead
        # all-reduce: 2 per layer, ring: 2(tp-1)/tp of the message per GPU
        if tp > 1:
            link = gp.link_bw if gp.link_bw > 0 else gp.pcie_bw
            self._ar_a = 2 * m.num_layers * gp.link_latency
            self._ar_tok = 2 * m.num_layers * (2 * (tp - 1) / tp) * m.hidden_size * m.dtype_bytes / link
        else:
            self._ar_a = self._ar_tok = 0.0

    def shape_time(self, s: BatchShape) -> float:
        if s.num_seqs == 0 and s.swap_tokens == 0:
            return 0.0
        mem = self._mem_a + self._mem_ctx * s.ctx_tokens + self._mem_tok * s.num_tokens
        # attention FLOPs: one (query, key) pair per decode context token, plus prefill pairs
        pairs = s.prefill_pairs + s.decode_ctx
        comp = self._c_tok * s.num_tokens + self._c_pair * pairs + self._c_samp * s.sampled
        t = max(mem, comp) + self._ovh + self._seq_ovh * s.num_seqs
        if self.tp > 1:
            t += self._ar_a + self._ar_tok * s.num_tokens
        if s.swap_tokens:
            t += self.swap_time(s.swap_tokens)
        return t

    def decode_step_times(self, n: int, ctx0: int, k: int) -> np.ndarray:
        ctx = ctx0 + n * np.arange(k, dtype=np.float64)
        mem = self._mem_a + self._mem_ctx * ctx + self._mem_tok * n
        comp = self._c_tok * n + self._c_pair * ctx + self._c_samp * n
        t = np.maximum(mem, comp) + (self._ovh + self._seq_ovh * n)
        if self.tp > 1:
            t += self._ar_a + self._ar_tok * n
        return t

    def decode_step_time(self, n: int, ctx: int) -> float:
        # the same operations, in the same order, as decode_step_times (IEEE doubles either way)
        c = float(ctx)
        mem = self._mem_a + self._mem_ctx * c + self._mem_tok * n
        comp = self._c_tok * n + self._c_pair * c + self._c_samp * n
        t = (mem if mem >= comp else comp) + (self._ovh + self._seq_ovh * n)
        if self.tp > 1:
            t += self._ar_a + self._ar_tok * n
        return t

    decode_step_lb = decode_step_time

    def kv_capacity_tokens(self, mem_fraction: float = 0.9, reserve_bytes: float = 1.0 * GiB,
                           page_size: int = 1) -> int:
        """KV pool in tokens: (device memory x fraction - weights - activations reserve),
        across tp GPUs, divided by KV bytes per token; rounded down to page_size."""
        free = self.tp * (self.gpu.mem_bytes * mem_fraction - reserve_bytes) - self.model.weight_bytes
        if free <= 0:
            raise ValueError(f"{self.model.name} ({self.model.weight_bytes / 1e9:.1f} GB) does not fit "
                             f"on {self.tp} x {self.gpu.name}")
        tokens = int(free // self.model.kv_bytes_per_token)
        return tokens - tokens % page_size

    def describe(self) -> dict:
        m, g = self.model, self.gpu
        return {"name": self.name, "kind": "roofline", "model": asdict(m), "gpu": asdict(g), "tp": self.tp,
                "weight_bytes": m.weight_bytes, "kv_bytes_per_token": m.kv_bytes_per_token,
                "num_params": m.num_params}


# --------------------------------------------------------------------------
# fitted / table model
# --------------------------------------------------------------------------

FEATURES = ("ctx_tokens", "prefill_pairs", "num_seqs", "sampled")


@dataclass
class FittedCostModel(CostModel):
    """step = interp(num_tokens; grid_tokens, grid_s) + sum(coef[f] * shape.f) (+ swap).

    The table part carries everything that scales with the tokens fed (the
    linear layers, norms, the step's fixed overhead at its first point); the
    linear part carries attention over the KV (ctx_tokens), prefill attention
    (prefill_pairs) and per-sequence costs. Beyond the grid the table is
    extrapolated linearly from its last two points."""
    grid_tokens: list = field(default_factory=lambda: [1])
    grid_s: list = field(default_factory=lambda: [0.0])
    coef: dict = field(default_factory=dict)
    kv_bytes_per_token: int = 0
    pcie_bw: float = 25e9
    name: str = "fitted"
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        order = np.argsort(self.grid_tokens)
        self._gx = np.asarray(self.grid_tokens, dtype=np.float64)[order]
        self._gy = np.asarray(self.grid_s, dtype=np.float64)[order]
        self._c = {f: float(self.coef.get(f, 0.0)) for f in FEATURES}

    def _table(self, x):
        gx, gy = self._gx, self._gy
        if len(gx) == 1:
            return np.full_like(np.asarray(x, dtype=np.float64), gy[0]) if np.ndim(x) else float(gy[0])
        y = np.interp(x, gx, gy)
        slope = (gy[-1] - gy[-2]) / (gx[-1] - gx[-2])
        hi = np.asarray(x) > gx[-1]
        if np.ndim(x):
            y = np.where(hi, gy[-1] + slope * (np.asarray(x) - gx[-1]), y)
        elif hi:
            y = gy[-1] + slope * (x - gx[-1])
        return y

    def shape_time(self, s: BatchShape) -> float:
        if s.num_seqs == 0 and s.swap_tokens == 0:
            return 0.0
        c = self._c
        t = float(self._table(s.num_tokens)) if s.num_tokens else 0.0
        t += (c["ctx_tokens"] * s.ctx_tokens + c["prefill_pairs"] * s.prefill_pairs
              + c["num_seqs"] * s.num_seqs + c["sampled"] * s.sampled)
        if s.swap_tokens:
            t += self.swap_time(s.swap_tokens)
        return max(t, 0.0)

    def _decode_base(self, n: int) -> float:
        cache = self.__dict__.setdefault("_base_cache", {})
        b = cache.get(n)
        if b is None:
            c = self._c
            b = cache[n] = float(self._table(n)) + (c["num_seqs"] + c["sampled"]) * n
        return b

    def decode_step_times(self, n: int, ctx0: int, k: int) -> np.ndarray:
        ctx = ctx0 + n * np.arange(k, dtype=np.float64)
        return np.maximum(self._decode_base(n) + self._c["ctx_tokens"] * ctx, 0.0)

    def decode_step_time(self, n: int, ctx: int) -> float:
        t = self._decode_base(n) + self._c["ctx_tokens"] * float(ctx)
        return t if t > 0.0 else 0.0

    decode_step_lb = decode_step_time

    # -- persistence -------------------------------------------------------
    def to_json(self) -> dict:
        return {"kind": "fitted", "name": self.name, "grid_tokens": list(map(int, self.grid_tokens)),
                "grid_s": list(map(float, self.grid_s)), "coef": {k: float(v) for k, v in self.coef.items()},
                "kv_bytes_per_token": int(self.kv_bytes_per_token), "pcie_bw": float(self.pcie_bw),
                "meta": self.meta}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def from_json(cls, d: dict) -> "FittedCostModel":
        if d.get("kind") != "fitted":
            raise ValueError(f"not a fitted cost model (kind={d.get('kind')!r})")
        return cls(grid_tokens=d["grid_tokens"], grid_s=d["grid_s"], coef=d.get("coef", {}),
                   kv_bytes_per_token=d.get("kv_bytes_per_token", 0), pcie_bw=d.get("pcie_bw", 25e9),
                   name=d.get("name", "fitted"), meta=d.get("meta", {}))

    def describe(self) -> dict:
        return self.to_json()

    def kv_capacity_tokens(self, *a, **k) -> int:
        cap = self.meta.get("kv_capacity_tokens")
        if not cap:
            raise ValueError("this fitted cost model does not know the KV capacity; pass --max-total-tokens")
        return int(cap)


def load_cost_model(path: str | Path) -> FittedCostModel:
    return FittedCostModel.from_json(json.loads(Path(path).read_text()))


# --------------------------------------------------------------------------
# fitting
# --------------------------------------------------------------------------

def _nnls(A: np.ndarray, b: np.ndarray, max_iter: int = 500) -> np.ndarray:
    """Non-negative least squares (Lawson-Hanson): min ||A x - b|| with x >= 0."""
    m, n = A.shape
    P = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    tol = 1e-12 * max(1.0, float(np.abs(A).max()) * float(np.abs(b).max()))
    w = A.T @ (b - A @ x)
    for _ in range(max_iter):
        if P.all() or not (w[~P] > tol).any():
            break
        j = int(np.argmax(np.where(P, -np.inf, w)))
        P[j] = True
        for _ in range(max_iter):
            z = np.zeros(n)
            z[P] = np.linalg.lstsq(A[:, P], b, rcond=None)[0]
            if (z[P] > 0).all():
                break
            mask = P & (z <= 0)
            alpha = float(np.min(x[mask] / (x[mask] - z[mask])))
            x = x + alpha * (z - x)
            P &= x > 1e-15
        x = z
        w = A.T @ (b - A @ x)
    return x


def fit_cost_model(samples: Iterable[tuple[BatchShape, float]], *, grid_tokens: Optional[Sequence[int]] = None,
                   features: Sequence[str] = ("ctx_tokens", "prefill_pairs", "num_seqs"),
                   kv_bytes_per_token: int = 0, pcie_bw: float = 25e9, name: str = "fitted",
                   meta: Optional[dict] = None) -> FittedCostModel:
    """Fit measured step times: a piecewise-linear function of num_tokens (knots
    at grid_tokens, kept only where samples are) plus linear terms in
    `features`, every coefficient >= 0 (non-negative least squares), minimising
    the relative error (step times span orders of magnitude)."""
    samples = [(s, t) for s, t in samples if t > 0]
    if not samples:
        raise ValueError("no samples to fit")
    toks = np.array([s.num_tokens for s, _ in samples], dtype=np.float64)
    y = np.array([t for _, t in samples], dtype=np.float64)
    lo, hi = int(toks.min()), int(toks.max())
    if grid_tokens is None:
        grid_tokens = [lo, hi] + [2 ** i for i in range(0, 20) if lo < 2 ** i < hi]
    gx = np.asarray(sorted(set(int(g) for g in grid_tokens)), dtype=np.float64)

    def hat_basis(x):
        # piecewise-linear "hat" functions at the knots, linear extrapolation past the ends
        B = np.zeros((len(x), len(gx)))
        if len(gx) == 1:
            B[:, 0] = 1.0
            return B
        for i, xi in enumerate(x):
            j = int(np.clip(np.searchsorted(gx, xi) - 1, 0, len(gx) - 2))
            w = (xi - gx[j]) / (gx[j + 1] - gx[j])
            B[i, j] += 1 - w
            B[i, j + 1] += w
        return B

    H = hat_basis(toks)
    keep = H.sum(axis=0) > 1e-9           # a knot no sample touches cannot be fitted
    if not keep.all():
        gx = gx[keep]
        H = hat_basis(toks)
    feats = list(features)
    F = np.array([[getattr(s, f) for f in feats] for s, _ in samples], dtype=np.float64).reshape(len(samples), -1)
    X = np.hstack([H, F])
    A = X / y[:, None]                     # relative error
    scale = np.maximum(np.linalg.norm(A, axis=0), 1e-300)
    sol = _nnls(A / scale, np.ones(len(y))) / scale
    grid_s = sol[:len(gx)]
    coef = {f: float(sol[len(gx) + i]) for i, f in enumerate(feats)}
    model = FittedCostModel(grid_tokens=[int(g) for g in gx], grid_s=grid_s.tolist(), coef=coef,
                            kv_bytes_per_token=kv_bytes_per_token, pcie_bw=pcie_bw, name=name,
                            meta=dict(meta or {}))
    pred = np.array([model.shape_time(s) for s, _ in samples])
    rel = np.abs(pred - y) / y
    model.meta.update({"fit_samples": len(samples), "fit_mean_rel_err": float(rel.mean()),
                       "fit_median_rel_err": float(np.median(rel)), "fit_max_rel_err": float(rel.max())})
    return model


def data_dir() -> Path:
    """shared/data (shepherd.paths: beside the checkout, or SHEPHERD_DATA_DIR)."""
    from shepherd.paths import shared_data_dir
    return shared_data_dir()


def from_vidur(model: str = "llama-2-7b", gpu: str = "h100", path: Optional[str | Path] = None,
               *, tp: int = 1) -> FittedCostModel:
    """Table model from vidur's profiled MLP-side operator times (per layer, by
    token count) summed over the layers, plus attention over the KV from the
    GPU's HBM roofline and the per-step overhead of the GPU preset.

    Uses the raw profile CSV in shared/data/vidur/profiling_compute (medians of
    every non-attention operator x num_layers, plus embedding once)."""
    import csv
    m, g = get_model(model), get_gpu(gpu)
    vid_name = {"Llama-3-8B": "meta-llama_Meta-Llama-3-8B", "Llama-2-7B": "meta-llama_Llama-2-7b-hf",
                "Llama-2-70B": "meta-llama_Llama-2-70b-hf"}.get(m.name)
    if path is None:
        if vid_name is None:
            raise KeyError(f"no vidur profile for {m.name}")
        path = data_dir() / "vidur" / "profiling_compute" / f"{g.name.split('-')[0].lower()}_{vid_name}_mlp.csv"
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no vidur profile at {path}")
    per_layer = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
                 "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
    table: dict[int, float] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            if int(row["num_tensor_parallel_workers"]) != tp:
                continue
            ms = sum(float(row[f"time_stats.{op}.median"]) for op in per_layer) * m.num_layers
            ms += float(row["time_stats.emb.median"])
            table[int(row["num_tokens"])] = ms / 1e3
    if not table:
        raise ValueError(f"{path}: no rows for tensor parallel {tp}")
    roof = RooflineCostModel(m, g, tp=tp)
    xs = sorted(table)
    ys = [table[x] + roof._ovh for x in xs]
    coef = {"ctx_tokens": roof._mem_ctx, "prefill_pairs": roof._c_pair, "num_seqs": roof._seq_ovh,
            "sampled": roof._c_samp}
    return FittedCostModel(grid_tokens=xs, grid_s=ys, coef=coef, kv_bytes_per_token=m.kv_bytes_per_token,
                           pcie_bw=roof.pcie_bw, name=f"vidur:{m.name}/{g.name}" + (f"x{tp}" if tp > 1 else ""),
                           meta={"source": str(path), "kv_capacity_tokens": roof.kv_capacity_tokens()})


def from_splitwise(model: str = "llama-2-70b", gpu: str = "h100", tp: int = 8,
                   path: Optional[str | Path] = None) -> FittedCostModel:
    """Fit to splitwise-sim's measured prompt and per-token times (perf_model.csv:
    prompt_time for a batch of `batch_size` prompts of `prompt_size`; token_time
    per decode step of `batch_size` sequences at context ~prompt_size + token_size/2)."""
    import csv
    m, g = get_model(model), get_gpu(gpu)
    path = Path(path) if path else data_dir() / "splitwise_sim" / "perf_model.csv"
    want_model = m.name.lower().replace("-", "").replace("llama2", "llama2-")  # llama2-70b
    hw = {"H100": "h100-80gb", "A100-80GB": "a100-80gb"}.get(g.name)
    samples = []
    with path.open() as f:
        for row in csv.DictReader(f):
            if row["model"] != want_model or row["hardware"] != hw or int(row["tensor_parallel"]) != tp:
                continue
            p, b, tok = int(row["prompt_size"]), int(row["batch_size"]), int(row["token_size"])
            samples.append((BatchShape(num_tokens=p * b, num_seqs=b, num_decode=0, ctx_tokens=p * b,
                                       prefill_pairs=b * p * (p + 1) // 2, sampled=b),
                            float(row["prompt_time"]) / 1e3))
            samples.append((BatchShape.decode([p + tok // 2] * b), float(row["token_time"]) / 1e3))
    if not samples:
        raise ValueError(f"{path}: no rows for {want_model} on {hw} with tp={tp}")
    roof = RooflineCostModel(m, g, tp=tp)
    fitted = fit_cost_model(samples, kv_bytes_per_token=m.kv_bytes_per_token, pcie_bw=roof.pcie_bw,
                            features=("ctx_tokens", "prefill_pairs"),
                            name=f"splitwise:{m.name}/{g.name}x{tp}",
                            meta={"source": str(path), "kv_capacity_tokens": roof.kv_capacity_tokens()})
    return fitted


# --------------------------------------------------------------------------
# one entry point for the CLI
# --------------------------------------------------------------------------

def make_cost_model(model: str = "llama-3-8b", gpu: str = "h100", *, tp: int = 1,
                    cost_model: Optional[str] = None) -> CostModel:
    """--cost-model: a JSON file written by `shepherd calibrate` (or any fitted
    model), 'roofline' (default), 'vidur' or 'splitwise'."""
    if cost_model in (None, "", "roofline"):
        return RooflineCostModel(model, gpu, tp=tp)
    if cost_model == "vidur":
        return from_vidur(model, gpu, tp=tp)
    if cost_model == "splitwise":
        return from_splitwise(model, gpu, tp=tp)
    return load_cost_model(cost_model)


def vllm_h100_itl(context: int) -> float:
    """The published reference: Llama-3-8B on one H100, single request, seconds."""
    return (6.44 + 4.37e-5 * context) / 1e3


__all__ = ["BatchShape", "batch_shape", "ModelSpec", "GPUSpec", "MODELS", "GPUS", "get_model", "get_gpu",
           "CostModel", "RooflineCostModel", "FittedCostModel", "fit_cost_model", "load_cost_model",
           "from_vidur", "from_splitwise", "make_cost_model", "vllm_h100_itl"]
