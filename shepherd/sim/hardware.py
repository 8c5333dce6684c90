"""Model and hardware presets for the cost models: parameter counts, KV bytes
per token, GPU memory, bandwidth, FLOPS and per-step overheads.

    get_model("llama-3-8b") -> ModelSpec      get_gpu("h100") -> GPUSpec
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = 1024 ** 3



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
    max_context: int = 8192   # positions the model was trained for: longer requests are rejected
    mlp_mats: int = 3         # weight matrices per MLP: 3 gated (Llama), 2 (OPT's fc1/fc2)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def layer_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d + 2 * h * self.num_kv_heads * d + self.num_heads * d * h
        mlp = self.mlp_mats * h * self.intermediate_size
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
    price_hr: float = 0.0           # on-demand $ per GPU-hour (0: unknown; --gpu-price GPU=$)
    power_w: float = 0.0            # board power (TDP) per GPU, W (0: unknown; --gpu-power GPU=W)


# max_context: each model's config.json max_position_embeddings (Llama-3.1 extends Llama-3's
# 8,192 to 131,072 with the same weights' shapes)
MODELS: dict[str, ModelSpec] = {
    "llama-3-8b": ModelSpec("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, max_context=8192),
    "llama-3.1-8b": ModelSpec("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256, max_context=131072),
    "llama-2-7b": ModelSpec("Llama-2-7B", 32, 4096, 32, 32, 128, 11008, 32000, max_context=4096),
    "llama-2-70b": ModelSpec("Llama-2-70B", 80, 8192, 64, 8, 128, 28672, 32000, max_context=4096),
    "smollm2-135m": ModelSpec("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, tie_word_embeddings=True,
                              max_context=8192),
    # OPT-13B (DistServe's model): MHA, a 2-matrix GELU MLP, tied embeddings, 2,048 positions
    "opt-13b": ModelSpec("OPT-13B", 40, 5120, 40, 40, 128, 20480, 50272, tie_word_embeddings=True,
                         max_context=2048, mlp_mats=2),
}

# price_hr: the middle of the "specialty provider" on-demand range of one published survey
# (mercatus-ai.com/blog/cloud-gpu-pricing, May 2026: A100 80GB $1.10-1.50, H100 SXM5 $2.50-3.50,
# H200 SXM5 $3.50-4.50 per GPU-hour; hyperscalers 1.3-2x more, long-tail providers less);
# power_w: SXM board power (A100 400 W, H100 and H200 700 W). The A10G has neither here.
GPUS: dict[str, GPUSpec] = {
    # H100 SXM: 80 GiB HBM3 3.35 TB/s, 989 TFLOPS dense bf16, PCIe 5 x16, NVLink 4 (450 GB/s/dir)
    # mem_eff 0.8 + 0.45 ms step overhead reproduce vLLM's measured single-request
    # Llama-3-8B ITL of 6.44 ms + 4.37e-5 ms/context token to within 3% over 1k-32k.
    "h100": GPUSpec("H100", 80 * GiB, 3.35e12, 989e12, 50e9, link_bw=360e9, price_hr=3.00, power_w=700),
    "h200": GPUSpec("H200", 141e9, 4.8e12, 989e12, 50e9, link_bw=360e9, price_hr=4.00, power_w=700),
    "a100-80gb": GPUSpec("A100-80GB", 80 * GiB, 2.039e12, 312e12, 25e9, link_bw=240e9,
                         step_overhead=6e-4, price_hr=1.30, power_w=400),
    # A10G (AWS g5): 24 GiB GDDR6 600 GB/s, ~70 TFLOPS dense bf16 tensor, PCIe 4, no NVLink
    "a10g": GPUSpec("A10G", 24 * GiB, 600e9, 70e12, 25e9, link_bw=0.0, step_overhead=8e-4),
    # this machine's CPU (2 vCPU AMD EPYC, AVX-512 bf16): a rough roofline only; use
    # `shepherd calibrate` for figures that should match the real engine.
    "cpu": GPUSpec("CPU", 16 * GiB, 20e9, 2.0e11, 20e9, link_bw=0.0, mem_eff=0.5,
                   compute_eff=0.35, step_overhead=5e-3, seq_overhead=2e-4),
}

_ALIASES = {
    "llama3-8b": "llama-3-8b", "meta-llama-3-8b": "llama-3-8b", "llama3.1-8b": "llama-3.1-8b",
    "meta-llama-3.1-8b": "llama-3.1-8b", "opt-13b-hf": "opt-13b",
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



__all__ = ["GiB", "ModelSpec", "GPUSpec", "MODELS", "GPUS", "get_model", "get_gpu"]
