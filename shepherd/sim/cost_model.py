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

The per-step overhead (`set_overhead(fixed, per_request, overlap)`) is added to
the GPU time (`overlap=False`, the default), or, with `overlap=True`, a step
costs fixed + max(GPU time, per_request x batch): vLLM v0.6's asynchronous
output processing, where the CPU turns step N's tokens into outputs while the
GPU computes step N+1, so only the larger of the two sets the pace.

`decode_step_times` is what makes the simulator's fast path cheap: a
decode-only step's time is a function of (n, total context) only, and the
context grows by n per step, so k steps are one vectorised expression.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional, Sequence

import numpy as np

# One LoRA adapter load into an adapter slot (host memory -> the executor's pool): the engine's
# own measurement, shepherd:lora_load_seconds, on this machine (Intel Xeon model 207, 2 cores)
# for a rank-8 adapter of SmolLM2-135M on all 7 projections of its 30 layers (~9.7 MB float32),
# `python benchmarks/lora_throughput.py --streams 64 --adapters 8 --rank 8 --rounds 3` (mean of its
# loads). The simulator's default --adapter-load-time; a larger adapter or a PCIe copy costs
# another figure (give --adapter-load-time).
LORA_LOAD_S = 0.0133

from shepherd.sim.hardware import GPUS, MODELS, GiB, GPUSpec, ModelSpec, get_gpu, get_model


# --------------------------------------------------------------------------
# batch shape
# --------------------------------------------------------------------------

@dataclass
class BatchShape:
    """What a step's time depends on, extracted from a ScheduledBatch.

    num_tokens      tokens fed this step (prefill chunks + one per decode, + its drafts)
    num_seqs        sequences in the batch
    num_decode      of those, decodes (one token, or one and the drafts it verifies)
    ctx_tokens      KV positions read by attention, summed over sequences
                    (a sequence attends over start_pos + len(chunk) positions)
    prefill_pairs   query x key pairs of prefill chunks (n*start + n(n+1)/2):
                    the quadratic part of prefill attention FLOPs
    sampled         lm-head rows: one per sequence that samples, one more per draft verified
    swap_tokens     KV tokens moved between host and device before the step
    decode_ctx      of ctx_tokens, those read by decodes
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
    """BatchShape of a shepherd.step.ScheduledBatch."""
    t = s = d = ctx = pairs = sampled = dctx = 0
    for seq in batch.seqs:
        n = len(seq.token_ids)
        start = seq.start_pos
        t += n
        s += 1
        ctx += start + n
        if seq.sample:
            sampled += 1 + seq.num_draft   # a verify samples after the last token and each draft
        if n == 1 + seq.num_draft and seq.sample:   # a decode: the last known token (+ drafts), sampling
            d += 1
            dctx += start + n
        else:
            pairs += n * start + n * (n + 1) // 2
    swap = sum(len(op.slots) for op in batch.swap_out) + sum(len(op.slots) for op in batch.swap_in)
    return BatchShape(t, s, d, ctx, pairs, sampled, swap, dctx)


# --------------------------------------------------------------------------
# the interface
# --------------------------------------------------------------------------

class CostModel:
    """Base: subclasses implement shape_time; the rest derives from it."""

    name = "cost-model"
    kv_bytes_per_token: int = 0
    pcie_bw: float = 25e9
    overlap: bool = False       # see set_overhead
    # seconds between a client sending a request and the engine taking it in, plus its first
    # token's way back out (HTTP, tokenising, the pipes, the first SSE event): the simulator adds
    # it to every request's TTFT (and end-to-end latency), never to a step
    frontend: float = 0.0

    def shape_time(self, s: BatchShape) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def _overlapped(self, gpu, n):
        """overlap=True: a step of n requests whose GPU time is `gpu` (a float, or an array
        for decode_step_times) costs fixed + max(gpu, per-request x n)."""
        fixed, per = self.overhead
        cpu = per * n
        if isinstance(gpu, np.ndarray):
            return np.maximum(gpu, cpu) + fixed
        return (gpu if gpu >= cpu else cpu) + fixed

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

    def set_overhead(self, fixed: Optional[float] = None, per_request: Optional[float] = None,
                     overlap: Optional[bool] = None) -> "CostModel":
        """The per-step CPU/launch overhead: `fixed` seconds per step plus
        `per_request` seconds per request in the batch (scheduling, input
        preparation, sampling and output handling that do not shrink with the
        GPU). None keeps the current value (the GPU preset's, or the one
        `shepherd calibrate` measured).

        overlap=True: the per-request term runs beside the GPU instead of after
        it (step = fixed + max(GPU, per_request x batch)); the fixed term
        (scheduling, input preparation) still precedes the forward it feeds."""
        raise NotImplementedError(f"{type(self).__name__} has no overhead terms")

    @property
    def overhead(self) -> tuple[float, float]:
        return (0.0, 0.0)


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

    def _with_overhead(self, gpu, n, ar):
        """A step of n requests: `gpu` (float or array) is its compute/memory time, `ar` its
        all-reduces (exactly 0.0 at tp 1, so adding it changes no bit); the overhead is added
        after both, or run beside them (overlap). One order of operations for every caller, so the
        fast path's steps are the step-by-step ones to the bit."""
        if self.overlap:
            return self._overlapped(gpu + ar, n)
        return gpu + (self._ovh + self._seq_ovh * n) + ar

    def shape_time(self, s: BatchShape) -> float:
        if s.num_seqs == 0 and s.swap_tokens == 0:
            return 0.0
        mem = self._mem_a + self._mem_ctx * s.ctx_tokens + self._mem_tok * s.num_tokens
        # attention FLOPs: one (query, key) pair per decode context token, plus prefill pairs
        pairs = s.prefill_pairs + s.decode_ctx
        comp = self._c_tok * s.num_tokens + self._c_pair * pairs + self._c_samp * s.sampled
        t = self._with_overhead(max(mem, comp), s.num_seqs, self._ar_a + self._ar_tok * s.num_tokens)
        if s.swap_tokens:
            t += self.swap_time(s.swap_tokens)
        return t

    def decode_step_times(self, n: int, ctx0: int, k: int) -> np.ndarray:
        ctx = ctx0 + n * np.arange(k, dtype=np.float64)
        mem = self._mem_a + self._mem_ctx * ctx + self._mem_tok * n
        comp = self._c_tok * n + self._c_pair * ctx + self._c_samp * n
        return self._with_overhead(np.maximum(mem, comp), n, self._ar_a + self._ar_tok * n)

    def decode_step_time(self, n: int, ctx: int) -> float:
        # the same operations, in the same order, as decode_step_times (IEEE doubles either way)
        c = float(ctx)
        mem = self._mem_a + self._mem_ctx * c + self._mem_tok * n
        comp = self._c_tok * n + self._c_pair * c + self._c_samp * n
        return self._with_overhead(mem if mem >= comp else comp, n, self._ar_a + self._ar_tok * n)

    decode_step_lb = decode_step_time

    def set_overhead(self, fixed: Optional[float] = None, per_request: Optional[float] = None,
                     overlap: Optional[bool] = None) -> "CostModel":
        if overlap is not None:
            self.overlap = bool(overlap)
        if fixed is not None:
            if fixed < 0:
                raise ValueError("step overhead must be >= 0")
            self._ovh = fixed
        if per_request is not None:
            if per_request < 0:
                raise ValueError("per-request overhead must be >= 0")
            self._seq_ovh = per_request
        return self

    @property
    def overhead(self) -> tuple[float, float]:
        return (self._ovh, self._seq_ovh)

    def unit_costs(self) -> dict[str, float]:
        """Seconds per context token read, per prefill attention pair and per sampled token:
        the roofline's terms a fitted model borrows for what its profile does not measure."""
        return {"ctx_tokens": self._mem_ctx, "prefill_pairs": self._c_pair, "sampled": self._c_samp}

    def linear_floor(self) -> dict[str, float]:
        """The roofline of a step's non-attention work, without overhead: x tokens cost at
        least max(mem_a + mem_tok x, c_tok x) seconds (the weights and activations moved, the
        linear layers' FLOPs). What a fitted model clamps to past its profiled range."""
        return {"mem_a": self._mem_a, "mem_tok": self._mem_tok, "c_tok": self._c_tok}

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
                "step_overhead": self._ovh, "seq_overhead": self._seq_ovh, "overlap": self.overlap,
                "weight_bytes": m.weight_bytes, "kv_bytes_per_token": m.kv_bytes_per_token,
                "num_params": m.num_params}


def vllm_h100_itl(context: int) -> float:
    """The published reference: Llama-3-8B on one H100, single request, seconds."""
    return (6.44 + 4.37e-5 * context) / 1e3


__all__ = ["BatchShape", "batch_shape", "ModelSpec", "GPUSpec", "MODELS", "GPUS", "get_model", "get_gpu",
           "CostModel", "RooflineCostModel", "vllm_h100_itl"]
