"""A Llama-family forward (Llama, Mistral, Qwen2, SmolLM) in plain torch, over a
token-granular KV pool.

One forward runs a ragged batch: several prefill chunks of different lengths
and many single-token decodes. Every token writes its K/V into the pool at
its slot and attends over its own request's slots (gathered per step).

Layout of the pool: K and V are each [layers, capacity, kv_heads, head_dim];
slot s of layer l holds one token's K (or V) for one request.

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
from typing import Optional

import torch
import torch.nn.functional as F

from shepherd.config import ModelConfig


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
    q_len query rows (the same for the group) and up to n_ctx keys."""
    token_index: Optional[torch.Tensor]   # [B*q_len] rows of the flat token batch, None = all rows in order
    gather: torch.Tensor                  # [B*Lp] slot ids of the keys (padding: slot 0)
    mask: torch.Tensor                    # [B, 1, q_len, Lp] additive float mask (0 / -inf)
    B: int
    q_len: int
    Lp: int                               # padded key count, a multiple of kv_block in invariant mode


@dataclass
class StepInput:
    input_ids: torch.Tensor               # [T] long
    positions: torch.Tensor               # [T] long
    write_slots: torch.Tensor             # [T] long
    groups: list[AttnGroup]
    logits_index: torch.Tensor            # [S] rows whose logits are wanted
    num_tokens: int = 0
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- model
class LlamaModel:
    """Weights and forward. Not an nn.Module: plain tensors, inference only."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 batch_invariant: bool = True, kv_block: int = 64, max_pos: Optional[int] = None):
        self.cfg = cfg
        self.dtype = dtype
        self.batch_invariant = batch_invariant
        self.kv_block = kv_block
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
        self.attn_min_rows = 1 if dtype == torch.bfloat16 else 8
        self.row_tile = 0
        W = weights
        cv = lambda t: t.to(dtype).contiguous()
        self.embed = cv(W["model.embed_tokens.weight"])
        self.lm_head = self.embed if cfg.tie_word_embeddings else cv(W["lm_head.weight"])
        self.final_norm = cv(W["model.norm.weight"])
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            wqkv = torch.cat([W[p + "self_attn.q_proj.weight"], W[p + "self_attn.k_proj.weight"],
                              W[p + "self_attn.v_proj.weight"]], 0)
            bqkv = None
            if cfg.attention_bias and (p + "self_attn.q_proj.bias") in W:
                bqkv = cv(torch.cat([W[p + "self_attn.q_proj.bias"], W[p + "self_attn.k_proj.bias"],
                                     W[p + "self_attn.v_proj.bias"]], 0))
            wgu = torch.cat([W[p + "mlp.gate_proj.weight"], W[p + "mlp.up_proj.weight"]], 0)
            self.layers.append(dict(
                ln1=cv(W[p + "input_layernorm.weight"]),
                ln2=cv(W[p + "post_attention_layernorm.weight"]),
                wqkv=cv(wqkv), bqkv=bqkv,
                wo=cv(W[p + "self_attn.o_proj.weight"]),
                wgu=cv(wgu),
                wd=cv(W[p + "mlp.down_proj.weight"]),
            ))
        self.max_pos = max_pos or cfg.max_position_embeddings
        cos, sin = rope_tables(cfg, self.max_pos, W.get("rope_freqs"))
        self.cos = cos.to(dtype)
        self.sin = sin.to(dtype)

    # ---- kv pool -----------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        return 2 * self.cfg.num_layers * self.KVH * self.hd * torch.empty((), dtype=self.dtype).element_size()

    def alloc_kv(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.cfg.num_layers, capacity, self.KVH, self.hd)
        return torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)

    # ---- primitives ------------------------------------------------------------------
    def linear(self, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
        M = x.shape[0]
        if self.batch_invariant:
            if self.row_tile:
                return self._tiled_linear(x, w, b)
            if M < self.min_rows:
                pad = x.new_zeros((self.min_rows - M, x.shape[1]))
                return F.linear(torch.cat([x, pad], 0), w, b)[:M]
        return F.linear(x, w, b)

    def _tiled_linear(self, x, w, b):
        T = self.row_tile
        M = x.shape[0]
        n = -(-M // T)
        if n * T != M:
            x = torch.cat([x, x.new_zeros((n * T - M, x.shape[1]))], 0)
        out = torch.empty((n * T, w.shape[0]), dtype=x.dtype)
        for i in range(n):
            out[i * T:(i + 1) * T] = F.linear(x[i * T:(i + 1) * T], w, b)
        return out[:M]

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        return w * (xf * torch.rsqrt(var + self.eps)).to(self.dtype)

    # ---- forward -----------------------------------------------------------------------
    def forward(self, inp: StepInput, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """Runs all layers; returns float32 logits for the rows in inp.logits_index."""
        T = inp.input_ids.shape[0]
        x = F.embedding(inp.input_ids, self.embed)
        cos = self.cos.index_select(0, inp.positions).unsqueeze(1)  # [T, 1, hd]
        sin = self.sin.index_select(0, inp.positions).unsqueeze(1)
        half = self.hd // 2
        H, KVH, hd = self.H, self.KVH, self.hd
        qs, ks = self.q_size, self.kv_size
        for li, L in enumerate(self.layers):
            h = self.rms_norm(x, L["ln1"])
            qkv = self.linear(h, L["wqkv"], L["bqkv"])
            qk = qkv[:, : qs + ks].view(T, H + KVH, hd)
            x1 = qk[..., :half]
            x2 = qk[..., half:]
            rot = torch.cat((-x2, x1), dim=-1)
            qk = qk * cos + rot * sin
            q = qk[:, :H]
            k = qk[:, H:]
            v = qkv[:, qs + ks:].view(T, KVH, hd)
            kp = k_pool[li]
            vp = v_pool[li]
            kp.index_copy_(0, inp.write_slots, k)
            vp.index_copy_(0, inp.write_slots, v)
            attn = self.attention(q, kp, vp, inp.groups, T)
            x = x + self.linear(attn, L["wo"])
            h = self.rms_norm(x, L["ln2"])
            gu = self.linear(h, L["wgu"])
            g = gu[:, : self.I]
            u = gu[:, self.I:]
            x = x + self.linear(F.silu(g) * u, L["wd"])
        xs = x.index_select(0, inp.logits_index) if inp.logits_index.numel() != T else x
        xs = self.rms_norm(xs, self.final_norm)
        return self.linear(xs, self.lm_head).float()

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor,
                  groups: list[AttnGroup], T: int) -> torch.Tensor:
        """q: [T, H, hd] (RoPE applied). Returns [T, H*hd]."""
        if len(groups) == 1 and groups[0].token_index is None:
            g = groups[0]
            return self._group_attention(q, kp, vp, g).reshape(T, self.q_size)
        out = q.new_empty((T, self.H, self.hd))
        for g in groups:
            qg = q if g.token_index is None else q.index_select(0, g.token_index)
            og = self._group_attention(qg, kp, vp, g)
            if g.token_index is None:
                out = og.view(T, self.H, self.hd)
            else:
                out.index_copy_(0, g.token_index, og.view(-1, self.H, self.hd))
        return out.reshape(T, self.q_size)

    def _group_attention(self, q, kp, vp, g: AttnGroup) -> torch.Tensor:
        """q: [B*q_len, H, hd] -> [B*q_len, H, hd]."""
        B, Q, Lp = g.B, g.q_len, g.Lp
        KVH, G, hd = self.KVH, self.G, self.hd
        # [B, Q, KVH, G, hd] -> [B, KVH, G*Q, hd]
        qg = q.view(B, Q, KVH, G, hd).permute(0, 2, 3, 1, 4).reshape(B, KVH, G * Q, hd)
        K = kp.index_select(0, g.gather).view(B, Lp, KVH, hd)
        V = vp.index_select(0, g.gather).view(B, Lp, KVH, hd)
        mask = g.mask  # [B, 1, Q, Lp] -> rows ordered (G, Q)
        if self.batch_invariant:
            o = self._blocked_attention(qg, K, V, mask)
        else:
            m = mask.unsqueeze(2).expand(B, 1, G, Q, Lp).reshape(B, 1, G * Q, Lp)
            o = F.scaled_dot_product_attention(qg, K.transpose(1, 2), V.transpose(1, 2), attn_mask=m.to(qg.dtype),
                                               scale=self.scale)
        # [B, KVH, G*Q, hd] -> [B, Q, KVH, G, hd]
        return o.view(B, KVH, G, Q, hd).permute(0, 3, 1, 2, 4).reshape(B * Q, self.H, hd)

    def _blocked_attention(self, qg, K, V, mask) -> torch.Tensor:
        """Fixed-block attention: identical arithmetic for a query row whatever
        the batch, the number of query rows, or the padded key length."""
        B, KVH, M, hd = qg.shape
        G = self.G
        Q = M // G
        M0 = M
        if M < self.attn_min_rows:   # same GEMM path for a decode row as for a prefill row
            qg = torch.cat([qg, qg.new_zeros((B, KVH, self.attn_min_rows - M, hd))], 2)
            M = self.attn_min_rows
        Lp = K.shape[1]
        Bk = self.kv_block
        nb = Lp // Bk
        # keys [B, Lp, KVH, hd] -> [B, KVH, nb, Bk, hd]
        Kb = K.view(B, nb, Bk, KVH, hd).permute(0, 3, 1, 2, 4)
        Vb = V.view(B, nb, Bk, KVH, hd).permute(0, 3, 1, 2, 4)
        # each (row, block) score tile is its own [M, hd] x [hd, Bk] product
        qb = qg.unsqueeze(2).expand(B, KVH, nb, M, hd)
        s = torch.matmul(qb, Kb.transpose(-1, -2)).float()  # [B, KVH, nb, M, Bk]
        if M != M0:
            s = s[:, :, :, :M0]
        s = s.reshape(B, KVH, nb, G, Q, Bk)
        s = s * self.scale + mask.view(B, 1, Q, nb, Bk).permute(0, 1, 3, 2, 4).unsqueeze(3)
        mx = s.amax(-1, keepdim=True)                                  # [B, KVH, nb, G, Q, 1]
        mx_safe = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
        p = torch.exp(s - mx_safe)
        l = p.sum(-1, keepdim=True)
        pm = p.to(qg.dtype).view(B, KVH, nb, M0, Bk)
        if M != M0:
            pm = torch.cat([pm, pm.new_zeros((B, KVH, nb, M - M0, Bk))], 3)
        o = torch.matmul(pm, Vb).float()  # [B, KVH, nb, M, hd]
        if M != M0:
            o = o[:, :, :, :M0]
        o = o.reshape(B, KVH, nb, G, Q, hd)
        if nb == 1:
            out = o[:, :, 0] / l[:, :, 0]
        else:
            gm = mx.amax(2, keepdim=True)
            w = torch.exp(mx - torch.where(torch.isinf(gm), torch.zeros_like(gm), gm))   # 0 for empty blocks
            acc_o = o[:, :, 0] * w[:, :, 0]
            acc_l = l[:, :, 0] * w[:, :, 0]
            for j in range(1, nb):   # fixed, sequential order over blocks
                acc_o = acc_o + o[:, :, j] * w[:, :, j]
                acc_l = acc_l + l[:, :, j] * w[:, :, j]
            out = acc_o / acc_l
        return out.to(qg.dtype).reshape(B, KVH, M0, hd)
