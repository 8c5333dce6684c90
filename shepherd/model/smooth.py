"""SmoothQuant-style smoothing before w8a8 quantisation.

Per-token int8 activations lose the small channels of a row whose scale is set by a few
large ones. Smoothing divides each input channel c of a linear layer by s_c and multiplies
the weight's column c by s_c, with s_c = max|X_c|^a / max|W_c|^(1-a) (a = 0.5): the product
is unchanged, the activation outliers shrink and the weights take part of them. Every
division lands in an op that already exists, so the forward is untouched:

  * qkv, gate-up: the RMSNorm weight before them (ln1, ln2);
  * down: the up projection's rows (silu(g) * u / s);
  * o: the V projection's rows (attention is linear in V); a V head feeds its G query heads,
    so their channels share one s (the largest);
  * the LM head: the final norm (a tied head becomes a separate, smoothed copy).

max|X_c| comes from one pass of the unquantised model over a fixed calibration text
(CAL_TEXT, written for this purpose: mixed prose, code, dialogue, lists, numbers; none of it
is the perplexity text of benchmarks/quant_quality.py). Measured on SmolLM2-135M: w8a8
perplexity +4.2 % without smoothing, +1.8 % with it (docs/MODEL.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ALPHA = 0.5
CAL_TEXT = (
    "Preheat the oven to two hundred degrees. In a large bowl, whisk the flour, sugar, baking powder and salt. "
    "def parse(path):\n    with open(path) as f:\n        return [line.split(',') for line in f]\n"
    "The committee met on Tuesday to discuss the budget for next year, and several members asked why the "
    "costs of maintenance had doubled since 2019. Q: What is the capital of France? A: Paris. "
    "User: Can you explain how a transistor works? Assistant: A transistor is a semiconductor device that "
    "amplifies or switches electronic signals. It has three terminals: the base, the collector and the emitter. "
    "1. Mix the ingredients. 2. Bake for 25 minutes. 3. Let it cool before serving. The stock market fell 3% "
    "on Monday after the central bank raised interest rates, the largest drop since March.")


def activation_maxima(model, ids: list[int]) -> dict[tuple[int, str], torch.Tensor]:
    """max |x| per input channel of each layer's qkv / o / gu / down on one causal pass.
    A plain single-sequence forward (SDPA, no KV pool): it runs before any executor exists."""
    m = model
    T, H, KVH, hd = len(ids), m.H, m.KVH, m.hd
    qs, ks, half = m.q_size, m.kv_size, hd // 2
    pos = torch.arange(T)
    cos, sin = m.cos[pos].unsqueeze(1), m.sin_signed[pos].unsqueeze(1)
    rope = lambda t: t * cos + torch.roll(t, half, -1) * sin
    out: dict[tuple[int, str], torch.Tensor] = {}
    amax = lambda t: t.float().abs().amax(0)
    x = F.embedding(torch.tensor(ids), m.embed)
    for i, L in enumerate(m.layers):
        h = m.rms_norm(x, L["ln1"])
        qkv = L["qkv"](h)
        q = rope(qkv[:, :qs].view(T, H, hd)).transpose(0, 1).float()
        k = rope(qkv[:, qs:qs + ks].view(T, KVH, hd)).transpose(0, 1).float()
        v = qkv[:, qs + ks:].view(T, KVH, hd).transpose(0, 1).float()
        G = H // KVH
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(G, 0), v.repeat_interleave(G, 0),
                                           is_causal=True, scale=m.scale)
        a = a.transpose(0, 1).reshape(T, qs).to(m.dtype)
        x = x + L["o"](a)
        h2 = m.rms_norm(x, L["ln2"])
        gu = L["gu"](h2)
        d = F.silu(gu[:, : m.I]) * gu[:, m.I:]
        x = x + L["down"](d)
        out[(i, "qkv")], out[(i, "o")], out[(i, "gu")], out[(i, "down")] = amax(h), amax(a), amax(h2), amax(d)
    out[(-1, "head")] = amax(m.rms_norm(x, m.final_norm))
    return out


def _scale(xmax: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    wmax = torch.stack([w.float().abs().amax(0) for w in ws]).amax(0)
    return (xmax.clamp_min(1e-5) ** ALPHA / wmax.clamp_min(1e-5) ** (1 - ALPHA)).clamp_min(1e-5)


def smooth_weights(cfg, weights: dict[str, torch.Tensor], tokenizer, dtype: torch.dtype) -> None:
    """Folds the smoothing scales into `weights` (Hugging Face names), in place. The linear
    weights come back in float32 (they are quantised next); the norms and biases in `dtype`."""
    from shepherd.model.llama import LlamaModel
    ref = LlamaModel(cfg, weights, dtype, batch_invariant=False, max_pos=4096)
    with torch.inference_mode():
        xmax = activation_maxima(ref, tokenizer.encode(CAL_TEXT))
    del ref
    H, KVH, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G = H // KVH
    f = lambda n: weights[n].float()
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"]
        gu = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        for names, norm, key in ((qkv, p + "input_layernorm.weight", "qkv"),
                                 (gu, p + "post_attention_layernorm.weight", "gu")):
            s = _scale(xmax[(i, key)], [f(n) for n in names])
            weights[norm] = (f(norm) / s).to(dtype)
            for n in names:
                weights[n] = f(n) * s
        up, down = p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"
        s = _scale(xmax[(i, "down")], [f(down)])
        weights[up] = f(up) / s[:, None]
        weights[down] = f(down) * s
        v, o, vb = p + "self_attn.v_proj.weight", p + "self_attn.o_proj.weight", p + "self_attn.v_proj.bias"
        s = _scale(xmax[(i, "o")], [f(o)]).view(KVH, G, hd).amax(1)          # one s per (V head, channel)
        weights[v] = f(v) / s.reshape(-1)[:, None]
        if vb in weights:
            weights[vb] = (f(vb) / s.reshape(-1)).to(dtype)
        weights[o] = f(o) * s[:, None, :].expand(KVH, G, hd).reshape(-1)
    # the LM head through the final norm; a tied head gets its own (smoothed) copy, since the
    # embedding lookup must keep the original rows
    head = "lm_head.weight" if not cfg.tie_word_embeddings else "model.embed_tokens.weight"
    s = _scale(xmax[(-1, "head")], [f(head)])
    weights["model.norm.weight"] = (f("model.norm.weight") / s).to(dtype)
    weights["lm_head.weight"] = (f(head) * s).to(dtype)
    cfg.tie_word_embeddings = False
