"""A Llama-family forward (Llama, Mistral, Qwen2, SmolLM) in plain torch, over a
token-granular KV pool.

One forward runs a ragged batch: several prefill chunks of different lengths
and many single-token decodes. Every token writes its K/V into the pool at
its slot and attends over its own request's slots (gathered per step).

Layout of the pool: K and V are each [layers, kv_heads, capacity, head_dim]
(head-major, so that a gather of a request's slots is already in the layout the
attention matmuls want); slot s of layer l, head h holds one token's K (or V).

Batch invariance (``batch_invariant=True``): a row's result must not depend on
the other rows in the step or on how a prompt was chunked. Everything here is
row-wise except two kinds of reductions:
  * GEMMs: oneDNN's bf16 kernels on this CPU compute a row the same way for any
    M; MKL's fp32 GEMM does so for M >= 4 (it switches to GEMV below). We pad
    M to a fixed minimum and, if a start-up probe finds the GEMM not row
    invariant, fall back to fixed-size row tiles (the same GEMM shape per tile).
  * attention: every query row (decode or prefill, alone or batched) runs the
    same code: its keys are split into fixed blocks of ``kv_block`` positions
    starting at position 0; each block's scores, softmax partials and P@V are
    fixed-shape ops; the blocks are then combined in a fixed order. Masked
    positions and padding blocks contribute exact zeros.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from shepherd.config import ModelConfig
from shepherd.model.kernels import STACK_OPS, StackLook, StackWatch, Watch
from shepherd.model.lora import LoraPool, LoraRows
from shepherd.model.quant import QLinear, cat_rows, dequantize, quantize_int8


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU has native bf16 dot products (AVX-512 bf16 or AMX), from /proc/cpuinfo;
    False where it cannot tell."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split()
                    return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        pass
    return False


# --------------------------------------------------------------------------- RoPE
def rope_inv_freq(cfg: ModelConfig, rope_freqs: Optional[torch.Tensor] = None) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = cfg.rope_scaling or {}
    rtype = sc.get("rope_type", sc.get("type"))
    if rope_freqs is not None:  # llama.cpp stores llama3 scaling as per-frequency divisors
        inv = inv / rope_freqs.float().reshape(-1)[: inv.numel()]
    elif rtype == "llama3":
        factor = float(sc["factor"])
        low = float(sc.get("low_freq_factor", 1.0))
        high = float(sc.get("high_freq_factor", 4.0))
        old_len = float(sc.get("original_max_position_embeddings", 8192))
        low_wl = old_len / low
        high_wl = old_len / high
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        is_medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = torch.where(is_medium, smoothed, inv_l)
    elif rtype == "linear":
        inv = inv / float(sc["factor"])
    elif rtype in (None, "default"):
        pass
    else:
        raise ValueError(f"rope scaling {rtype!r} is not supported (default, linear, llama3)")
    return inv


def rope_tables(cfg: ModelConfig, max_pos: int, rope_freqs=None) -> tuple[torch.Tensor, torch.Tensor]:
    inv = rope_inv_freq(cfg, rope_freqs)
    t = torch.arange(max_pos, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()  # [max_pos, head_dim] float32


# --------------------------------------------------------------------------- batch metadata
@dataclass
class AttnGroup:
    """Sequences whose attention runs as one padded batch: B sequences, each with
    q_len query rows (the same for the group) and up to Lp keys."""
    token_index: Optional[torch.Tensor]   # [B*q_len] rows of the flat token batch; None = all rows in order
    gather: torch.Tensor                  # [2*KVH*B*Lp] flat (K/V head, slot) rows of the keys; padding -> slot 0
    mask: torch.Tensor                    # [B, nb, 1, q_len, Bk] additive float mask (0 / -inf), nb*Bk = Lp
    B: int
    q_len: int
    Lp: int
    nb: int = 1                           # key blocks of Bk = Lp // nb positions


@dataclass
class StepInput:
    input_ids: torch.Tensor               # [T] long
    positions: torch.Tensor               # [T] long
    write_index: torch.Tensor             # [2*KVH*T] flat (K/V head, slot) rows for this step's K/V
    groups: list[AttnGroup]
    logits_index: Optional[torch.Tensor]  # [S] rows whose logits are wanted; None = all rows
    num_tokens: int = 0
    # fused-kernel path (built when the model has kernels): per row its slot, and the keys it
    # attends over: slot_tab[row_off[r] : row_off[r] + row_ctx[r]]
    slots: Optional[torch.Tensor] = None      # [T] long
    slot_tab: Optional[torch.Tensor] = None   # [sum of ctx per sequence] long (or longer: read up to there)
    row_off: Optional[torch.Tensor] = None    # [T] long
    row_ctx: Optional[torch.Tensor] = None    # [T] long
    max_ctx: int = 0
    lora_rows: Optional[LoraRows] = None      # the rows that run with a LoRA adapter; None: none does


class Linear:
    """y = x @ W^T (+ b) with the weight prepacked for oneDNN once (2-2.5x faster than
    F.linear on this CPU, bit-identical). In batch-invariant mode M is padded up to
    `min_rows` (or run in fixed row tiles) so that every row takes the same kernel."""

    def __init__(self, w: torch.Tensor, b: Optional[torch.Tensor], owner: "LlamaModel"):
        self.w = w.contiguous()
        self.b = b
        self.owner = owner
        self.out_features, self.in_features = w.shape
        self.packed = self.tiles = None
        k = owner.kernels
        if (k is not None and k.bf16_mm and w.dtype == torch.bfloat16 and w.device.type == "cpu"
                and self.out_features % 16 == 0 and self.in_features % 2 == 0):
            # shepherd's bf16 GEMM: row-invariant for any M (no padding rows), and faster than
            # oneDNN at decode sizes here (benchmarks/quant_gemm_ab.py; docs/MODEL.md)
            self.tiles = k.pack_bf16(self.w)
            self.w = None
        elif owner.use_mkldnn:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.w, 64)
                x = torch.randn(4, w.shape[1]).to(w.dtype)
                if not torch.equal(self._mk(x), F.linear(x, self.w, self.b)):
                    self.packed = None
            except Exception:
                self.packed = None
        if self.packed is not None:
            self.w = None          # keep one copy of the weights in memory

    def _mk(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.b, "none", [], "")

    def raw(self, x, out_dtype=None):
        if self.tiles is not None:
            return self.owner.kernels.mm_bf16(x.contiguous(), self.tiles, self.out_features, self.b,
                                              out_dtype or x.dtype)
        if self.packed is not None:
            return self._mk(x)
        return F.linear(x, self.w, self.b)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None:     # float32 straight from the accumulators
            return self.raw(x, torch.float32)
        return self(x).float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        o = self.owner
        if o.batch_invariant and self.tiles is None:
            M = x.shape[0]
            if o.row_tile and M:     # (an empty input has no tile to run)
                T = o.row_tile
                n = -(-M // T)
                if n * T != M:
                    x = torch.cat([x, x.new_zeros((n * T - M, x.shape[1]))], 0)
                return torch.cat([self.raw(x[i * T:(i + 1) * T]) for i in range(n)], 0)[:M]
            if M < o.min_rows:
                return self.raw(torch.cat([x, x.new_zeros((o.min_rows - M, x.shape[1]))], 0))[:M]
        return self.raw(x)


# --------------------------------------------------------------------------- model
class LlamaModel:
    """Weights and forward. Not an nn.Module: plain tensors, inference only."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 batch_invariant: bool = True, kv_block: int = 64, max_pos: Optional[int] = None,
                 use_mkldnn: bool = True, kernels=None, qweights: Optional[dict] = None,
                 device: Optional[torch.device] = None):
        self.cfg = cfg
        self.device = torch.device(device or "cpu")
        self.kernels = kernels     # shepherd.model.kernels.Kernels, or None: pure-torch forward
        self.dtype = dtype
        self.batch_invariant = batch_invariant
        self.kv_block = kv_block
        self.use_mkldnn = use_mkldnn and torch.backends.mkldnn.is_available() and self.device.type == "cpu"
        self.H = cfg.num_heads
        self.KVH = cfg.num_kv_heads
        self.G = self.H // self.KVH
        self.hd = cfg.head_dim
        self.D = cfg.hidden_size
        self.I = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.scale = 1.0 / math.sqrt(self.hd)
        self.q_size = self.H * self.hd
        self.kv_size = self.KVH * self.hd
        # Minimum GEMM rows: measured on this CPU, a row's bits differ between M=1 and M>=2
        # in bf16 (oneDNN GEMV path), and between M<8 and M>=8 in fp32 (MKL small-M paths).
        # Padding M up to min_rows makes every row take the GEMM path. If the start-up
        # probe (TorchExecutor) still finds variance, fixed row tiles are used instead.
        self.min_rows = 4 if dtype == torch.bfloat16 else 8
        # bf16 attention at a decode's few query rows is row invariant where the CPU has bf16 dot
        # products; on an Intel Xeon without avx512_bf16 a decode row's bits changed beside other
        # sequences and with the thread count (tests/test_batch_invariance.py, torch path), and
        # padding to 8 rows, as fp32 does, made them equal
        native_bf16 = self.device.type != "cpu" or cpu_has_bf16_dot()
        self.attn_min_rows = 1 if dtype == torch.bfloat16 and native_bf16 else 8
        self.row_tile = 0
        self.whole_forward = True   # False: one kernel call per op even where layer_stack applies
        self.lora: Optional[LoraPool] = None   # the executor's adapter slots, when it serves LoRA adapters
        # called as hook(layer index, look) before a layer of a forward: engine/threads.py's
        # ThreadGovernor drops to one OpenMP thread in the middle of a step that another process is
        # stretching. It returns a kernels.Watch: None (not again in this forward), a StackWatch,
        # or s to its next call. The per-op paths call it before every layer until None, with look
        # None; where the stack runs in one C call (kernels.layer_stack), that call returns at the
        # first op boundary (between layers or inside one) where the watch says so (a look that
        # found a thread descheduled, or the time asked for), and the hook gets the layer it
        # stopped in and that look (kernels.StackLook; None at the forward's start);
        # after a None the rest of the stack runs in one go (the governor: at one thread)
        self.between_layers: Optional[Callable[[int, Optional[StackLook]], Watch]] = None
        esz = torch.empty((), dtype=dtype).element_size()
        self._word = torch.int64 if (self.hd * esz) % 8 == 0 else dtype
        W = weights
        Q = qweights or {}
        self.quantized = bool(Q)
        cv = lambda t: t.to(dtype).contiguous().to(self.device)
        self.embed = cv(W["model.embed_tokens.weight"])
        head = self.embed if cfg.tie_word_embeddings else cv(W["lm_head.weight"])
        # quantised models keep the LM head at int8 (as llama.cpp keeps Q8_0/Q6_K there: int4 logits
        # cost more perplexity than the other layers together), weight-only; w8a8 models run it as
        # w8a8 too (smoothed). An int4 model with a per-row w8a8 head was faster (1 row 12.9 -> 10.9 ms,
        # one thread) but its greedy tokens left transformers' early on 6 of the 8 parity prompts.
        head_kind = "w8a8" if any(q.kind == "w8a8" for q in Q.values()) else "int8"
        self.lm_head = QLinear(quantize_int8(head, head_kind), None, self, dtype) if Q else Linear(head, None, self)
        self.final_norm = cv(W["model.norm.weight"])
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            bqkv = None
            if cfg.attention_bias and (p + "self_attn.q_proj.bias") in W:
                bqkv = cv(torch.cat([W[p + "self_attn.q_proj.bias"], W[p + "self_attn.k_proj.bias"],
                                     W[p + "self_attn.v_proj.bias"]], 0))
            self.layers.append(dict(
                ln1=cv(W[p + "input_layernorm.weight"]),
                ln2=cv(W[p + "post_attention_layernorm.weight"]),
                qkv=self._linear(W, Q, [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                                        p + "self_attn.v_proj.weight"], bqkv),
                o=self._linear(W, Q, [p + "self_attn.o_proj.weight"]),
                gu=self._linear(W, Q, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down=self._linear(W, Q, [p + "mlp.down_proj.weight"]),
            ))
        self.max_pos = max_pos or cfg.max_position_embeddings
        cos, sin = rope_tables(cfg, self.max_pos, W.get("rope_freqs"))
        half = self.hd // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)])
        self.cos = cos.to(dtype).to(self.device)
        self.sin_signed = (sin * sign).to(dtype).to(self.device)   # rotate_half(x) * sin == roll(x, half) * sin_signed
        self.cos_half = cos[:, :half].contiguous()  # float32 tables for the fused RoPE
        self.sin_half = sin[:, :half].contiguous()
        self.layer_ptrs = self._layer_ptrs()

    def _layer_ptrs(self) -> Optional[torch.Tensor]:
        """The weight table kernels.layer_stack walks (Kernels.layer_weights), where every linear
        layer is a bf16_mm one; None: the forward calls one kernel per op."""
        k = self.kernels
        if k is None or not k.forward_supports(self.H, self.KVH, self.hd):
            return None
        names = ("qkv", "o", "gu", "down")
        if not all(isinstance(L[n], Linear) and L[n].tiles is not None for L in self.layers for n in names):
            return None
        if any(L[n].b is not None for L in self.layers for n in ("o", "gu", "down")):
            return None
        return k.layer_weights([   # the tensors stay alive in self.layers
            dict(qkv=L["qkv"].tiles, qkv_b=L["qkv"].b, o=L["o"].tiles, gu=L["gu"].tiles, down=L["down"].tiles,
                 ln2=L["ln2"], ln1_next=self.layers[i + 1]["ln1"] if i + 1 < len(self.layers) else None)
            for i, L in enumerate(self.layers)])

    def _linear(self, W: dict, Q: dict, names: list[str], bias=None):
        """One linear layer over the row-concatenation of `names` (fused QKV, gate-up)."""
        if all(n in Q for n in names):
            parts = [Q[n] for n in names]
            if len({q.kind for q in parts}) > 1:     # mixed GGUF block types: run all at int8
                parts = [quantize_int8(dequantize(q)) for q in parts]
            return QLinear(cat_rows(parts), bias, self, self.dtype)
        if any(n in Q for n in names):
            raise ValueError(f"{names}: some parts quantised, some not")
        return Linear(torch.cat([W[n] for n in names], 0).to(self.dtype).contiguous().to(self.device), bias, self)

    # ---- kv pool -----------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        return 2 * self.cfg.num_layers * self.KVH * self.hd * torch.empty((), dtype=self.dtype).element_size()

    def alloc_kv(self, capacity: int) -> torch.Tensor:
        """One tensor [layers, 2*kv_heads, capacity+1, head_dim]: K heads then V heads.
        Slot `capacity` is a scratch slot for padding rows (never handed to the scheduler)."""
        return torch.zeros((self.cfg.num_layers, 2 * self.KVH, capacity + 1, self.hd), dtype=self.dtype,
                           device=self.device)

    # ---- primitives ------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        return w * (xf * torch.rsqrt(var + self.eps)).to(self.dtype)

    # ---- forward -----------------------------------------------------------------------
    def forward(self, inp: StepInput, kv_pool: torch.Tensor) -> torch.Tensor:
        """Runs all layers; returns float32 logits for the rows in inp.logits_index."""
        if self.kernels is not None and inp.slot_tab is not None:
            return self._forward_fused(inp, kv_pool)
        T = inp.input_ids.shape[0]
        H, KVH, hd = self.H, self.KVH, self.hd
        qs, ks = self.q_size, self.kv_size
        half = hd // 2
        x = F.embedding(inp.input_ids, self.embed)
        cos = self.cos.index_select(0, inp.positions).unsqueeze(1)        # [T, 1, hd]
        sin = self.sin_signed.index_select(0, inp.positions).unsqueeze(1)
        rows = kv_pool.shape[1] * kv_pool.shape[2]
        word = self._word
        hook = self.between_layers
        for li, L in enumerate(self.layers):
            if hook is not None and hook(li, None) is None:
                hook = None     # it has seen enough of this forward
            h = self.rms_norm(x, L["ln1"])
            qkv = self._lora(li, "qkv", h, L["qkv"](h), inp)             # [T, q | k | v]
            qk = qkv[:, : qs + ks].view(T, H + KVH, hd)
            qk.copy_(torch.addcmul(qk * cos, torch.roll(qk, half, -1), sin))   # RoPE (rotate-half), in place
            # this step's K and V rows -> their slots (copied as int64 words: index_copy_ and
            # index_select are ~8x faster on 8-byte elements than on bf16; bit-exact)
            kvp = kv_pool[li].view(rows, hd).view(word)
            kvp.index_copy_(0, inp.write_index, qkv[:, qs:].view(T, 2 * KVH, hd).transpose(0, 1)
                            .reshape(2 * KVH * T, hd).view(word))
            attn = self.attention(qkv[:, :qs].view(T, H, hd), kvp, inp.groups, T)
            o = self._lora(li, "o", attn, L["o"](attn), inp)
            x = x + o
            h = self.rms_norm(x, L["ln2"])
            gu = self._lora(li, "gu", h, L["gu"](h), inp)
            act = F.silu(gu[:, : self.I]) * gu[:, self.I:]
            x = x + self._lora(li, "down", act, L["down"](act), inp)
        if inp.logits_index is not None:
            x = x.index_select(0, inp.logits_index)
        x = self.rms_norm(x, self.final_norm)
        return self.lm_head.logits(x)

    def _forward_fused(self, inp: StepInput, kv_pool: torch.Tensor) -> torch.Tensor:
        """The same layer with fused kernels: 4 GEMMs + 4 kernel calls per layer. The residual
        add rides in the next RMSNorm; attention reads K/V in the pool by slot."""
        k = self.kernels
        H, KVH, hd, eps = self.H, self.KVH, self.hd, self.eps
        x = self.embed.index_select(0, inp.input_ids)     # F.embedding's gather without its Python wrapper
        h = k.rmsnorm(x, self.layers[0]["ln1"], eps)
        if self.layer_ptrs is not None and self.whole_forward:
            run = k.layer_stack(lw=self.layer_ptrs, x=x, h=h, H=H, KVH=KVH, hd=hd, I=self.I, pos=inp.positions,
                                cos=self.cos_half, sin=self.sin_half, kv_pool=kv_pool, slots=inp.slots,
                                slot_tab=inp.slot_tab, off=inp.row_off, ctx=inp.row_ctx, max_ctx=inp.max_ctx,
                                scale=self.scale, eps=eps, lora=None if self.lora is None else self.lora.table,
                                lora_rows=inp.lora_rows)
            # the stack is cut only where the hook's watch says (a cut at every layer cost
            # 1.0-1.6 ms of a 13 ms one-row decode step: benchmarks/step_time.py --watch every;
            # the governor's watch returns only at a look that found a thread descheduled);
            # x and h carry the state from one call to the next
            # (positions count ops, STACK_OPS a layer: the stack returns between the ops of a layer
            # too, so a look finds contention within an op, not a 30-92 ms layer, of its start;
            # the hook is told the layer it is in)
            n, at, hook, look = len(self.layers) * STACK_OPS, 0, self.between_layers, None
            while at < n:
                want = None if hook is None else hook(at // STACK_OPS, look)
                if want is None:
                    hook = None
                at, look = run(at, n, want if want is None or isinstance(want, StackWatch) else StackWatch(want))
            return self._logits(x, inp)
        hook = self.between_layers
        for li, L in enumerate(self.layers):
            if hook is not None and hook(li, None) is None:
                hook = None     # it has seen enough of this forward
            pool = kv_pool[li]
            qkv = self._lora(li, "qkv", h, L["qkv"](h), inp)
            k.rope_kv(qkv, H, KVH, hd, inp.positions, self.cos_half, self.sin_half, pool, inp.slots)
            attn = k.attention(qkv, pool, H, KVH, hd, inp.slot_tab, inp.row_off, inp.row_ctx, inp.max_ctx,
                               self.scale)
            k.rmsnorm(x, L["ln2"], eps, delta=self._lora(li, "o", attn, L["o"](attn), inp), h=h)
            gu = self._lora(li, "gu", h, L["gu"](h), inp)
            act = k.silu_mul(gu)
            d = self._lora(li, "down", act, L["down"](act), inp)
            if li + 1 < len(self.layers):
                k.rmsnorm(x, self.layers[li + 1]["ln1"], eps, delta=d, h=h)
            else:
                x = x + d
        return self._logits(x, inp)

    def _lora(self, li: int, lin: str, x: torch.Tensor, y: torch.Tensor, inp: StepInput) -> torch.Tensor:
        """y, the output of layer li's linear `lin` on x, with the LoRA updates of the step's
        adapter rows added in place (model/lora.py)."""
        if inp.lora_rows is not None:
            self.lora.apply(li, lin, x, y, inp.lora_rows, self.kernels)
        return y

    def _logits(self, x: torch.Tensor, inp: StepInput) -> torch.Tensor:
        if inp.logits_index is not None:
            x = x.index_select(0, inp.logits_index)
        return self.lm_head.logits(self.kernels.rmsnorm(x.contiguous(), self.final_norm, self.eps))

    def attention(self, q: torch.Tensor, kvp: torch.Tensor, groups: list[AttnGroup], T: int) -> torch.Tensor:
        """q: [T, H, hd] (RoPE applied). Returns [T, H*hd]."""
        if len(groups) == 1 and groups[0].token_index is None:
            return self._group_attention(q, kvp, groups[0])
        out = q.new_zeros((T, self.q_size))
        for g in groups:
            og = self._group_attention(q.index_select(0, g.token_index), kvp, g)
            out.index_copy_(0, g.token_index, og)
        return out

    def _group_attention(self, q, kvp, g: AttnGroup) -> torch.Tensor:
        """q: [B*Q, H, hd] -> [B*Q, H*hd]."""
        B, Q, Lp, nb = g.B, g.q_len, g.Lp, g.nb
        KVH, G, hd = self.KVH, self.G, self.hd
        Bk = Lp // nb
        # rows of a (kv head, sequence): the G query heads of each of its Q tokens, ordered (G, Q)
        qg = q.reshape(B, Q, KVH, G, hd).permute(2, 0, 3, 1, 4).reshape(KVH, B, G * Q, hd)
        KV = kvp.index_select(0, g.gather).view(self.dtype).view(2, KVH, B, nb, Bk, hd)
        K, V = KV[0], KV[1]
        # prefill: fused SDPA (decodes: blocked path, faster here). float32 only: torch's CPU
        # SDPA with this broadcast bf16 mask returned wrong rows (greedy chat answers turned
        # to garbage; tests/test_model_parity.py::test_non_invariant_bf16_chat_answer).
        if not self.batch_invariant and nb == 1 and Q > 1 and (self.dtype == torch.float32 or
                                                               self.device.type == "cuda"):
            m = g.mask.view(B, 1, 1, Q, Lp).expand(B, 1, G, Q, Lp).reshape(1, B, G * Q, Lp)
            o = F.scaled_dot_product_attention(qg, K.view(KVH, B, Lp, hd), V.view(KVH, B, Lp, hd),
                                               attn_mask=m.to(qg.dtype), scale=self.scale)
        else:
            o = self._blocked_attention(qg, K, V, g.mask, Q)
        # [KVH, B, G, Q, hd] -> [B, Q, KVH, G, hd]
        return o.view(KVH, B, G, Q, hd).permute(1, 3, 0, 2, 4).reshape(B * Q, self.q_size)

    def _blocked_attention(self, qg, K, V, mask, Q) -> torch.Tensor:
        """Fixed-block attention: identical arithmetic for a query row whatever the
        batch, the number of query rows, or the padded key length.
        qg [KVH, B, M=G*Q, hd]; K, V [KVH, B, nb, Bk, hd]; mask [B, nb, 1, Q, Bk]."""
        KVH, B, M, hd = qg.shape
        nb, Bk = K.shape[2], K.shape[3]
        G = self.G
        M0 = M
        if M < self.attn_min_rows:   # same GEMM path for a decode row as for a prefill row
            qg = torch.cat([qg, qg.new_zeros((KVH, B, self.attn_min_rows - M, hd))], 2)
            M = self.attn_min_rows
        # one [M, hd] x [hd, Bk] product per (head, seq, block)
        s = torch.matmul(qg.unsqueeze(2), K.transpose(-1, -2))          # [KVH, B, nb, M, Bk]
        if M != M0:
            s = s[:, :, :, :M0]
        s = torch.add(mask, s.reshape(KVH, B, nb, G, Q, Bk), alpha=self.scale)   # float32, scaled + masked
        mx = s.amax(-1, keepdim=True).clamp_min(-1e30)                   # empty block: -1e30, exp -> 0
        p = torch.exp(s - mx)
        l = p.sum(-1, keepdim=True)                                       # [KVH, B, nb, G, Q, 1]
        pm = p.to(qg.dtype).view(KVH, B, nb, M0, Bk)
        if M != M0:
            pm = torch.cat([pm, pm.new_zeros((KVH, B, nb, M - M0, Bk))], 3)
        o = torch.matmul(pm, V)                                           # [KVH, B, nb, M, hd]
        if M != M0:
            o = o[:, :, :, :M0]
        o = o.reshape(KVH, B, nb, G, Q, hd)
        if nb == 1:
            out = o[:, :, 0].float() / l[:, :, 0]
        else:
            gm = mx.amax(2, keepdim=True)
            w = torch.exp(mx - gm)                                        # exactly 0 for empty blocks
            # sequential (cumulative) sums over blocks: a fixed order, trailing empty blocks add 0
            acc_o = torch.cumsum(o.float() * w, 2)[:, :, -1]
            acc_l = torch.cumsum(l * w, 2)[:, :, -1]
            out = acc_o / acc_l
        return out.to(qg.dtype)
