"""LoRA adapters: PEFT folders read and checked, the executor's adapter slots, the batched update.

    ad = read_adapter(path, model_config, max_rank)   # LoraError (a ValueError) says what is wrong
    pool = LoraPool(model_config, slots=8, max_rank=16)
    pool.load(slot, ad)                                # the adapter's weights into a slot
    rows = pool.rows(row_slot)                         # per step: the rows grouped by slot
    pool.apply(layer, "qkv", x, y, rows, kernels)      # y += x A^T B^T, per row with its slot's A, B

A PEFT adapter is a folder with `adapter_config.json` and `adapter_model.safetensors`; it may adapt
any of the q/k/v/o and gate/up/down projections of any layers, each with its own rank (PEFT's
rank_pattern) up to `max_rank`. shepherd's forward runs fused q|k|v and gate|up projections, so an
adapter's update of one fused linear is one shrink over the stacked A rows of its parts
(x . A^T, [rank] per row) and one expand per part into that part's output columns: Punica's
segmented GEMMs (SGMV) cut to the rows of one adapter at a time. The slots are the executor's
device pool (vLLM's max_loras GPU slots): weights are copied in when the scheduler says an adapter
becomes resident (step.LoraLoad) and read in place by the kernels through one int64 record per
(layer, linear, slot) (kernel_abi.LORA_RECORD).

Precision: A and B stay float32 (PEFT keeps adapter weights float32 under a bf16 model), the
scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B, and the update is added in
float32 to the rounded base output and rounded once, as PEFT does. Every sum runs per row in a
fixed order, so a row's result does not depend on the rows beside it (batch invariance across
adapters: tests/test_lora.py).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Optional

import torch

from shepherd.config import ModelConfig
from shepherd.model import kernel_abi

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT module name -> (the fused linear of shepherd's forward, its part)
MODULES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
           "gate_proj": ("gu", 0), "up_proj": ("gu", 1), "down_proj": ("down", 0)}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_FIELD = {n: i for i, n in enumerate(kernel_abi.LORA_RECORD)}
_PART = len(kernel_abi.LORA_PART)
_LINEARS = kernel_abi.LORA_LINEARS


class LoraError(ValueError):
    """The adapter cannot be served; the message says what is wrong with which file or tensor."""


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, list[tuple[str, int]]]]:
    """linear -> (input features, [(PEFT module, output features) per part])."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    D, I = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (D, [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]),
            "o": (q, [("o_proj", D)]),
            "gu": (D, [("gate_proj", I), ("up_proj", I)]),
            "down": (I, [("down_proj", D)])}


@dataclass
class LoraAdapter:
    """An adapter in host memory: per (layer, PEFT module) its float32 A [r, in] and B^T [r, out]
    with the scaling folded in."""
    name: str
    path: str
    rank: int                                      # the largest rank of its modules
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * 4 + b.numel() * 4 for a, b in self.weights.values())

    @property
    def modules(self) -> list[str]:
        return sorted({m for _, m in self.weights}, key=list(MODULES).index)


def _config(path: str) -> dict:
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise LoraError(f"{path!r} is not a folder (a PEFT adapter is a folder with {CONFIG_FILE} and {WEIGHTS_FILE})")
    if not os.path.isfile(cfg_path):
        raise LoraError(f"{path!r} has no {CONFIG_FILE}")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        raise LoraError(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(c, dict):
        raise LoraError(f"{CONFIG_FILE} must hold a JSON object")
    kind = str(c.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise LoraError(f"{CONFIG_FILE}: peft_type {kind!r} is not supported (only LORA)")
    for flag, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) weights")):
        if c.get(flag):
            raise LoraError(f"{CONFIG_FILE}: {what} is not supported")
    if c.get("bias", "none") not in ("none", None):
        raise LoraError(f"{CONFIG_FILE}: bias={c.get('bias')!r} is not supported (only 'none')")
    if c.get("modules_to_save"):
        raise LoraError(f"{CONFIG_FILE}: modules_to_save {c['modules_to_save']} is not supported "
                        "(an adapter may only add low-rank updates)")
    for k in ("r", "lora_alpha"):
        v = c.get(k)
        if k in c and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise LoraError(f"{CONFIG_FILE}: {k} must be a positive number, got {v!r}")
    return c


def _alpha(c: dict, module_key: str) -> float:
    """lora_alpha, or the alpha_pattern entry that matches the module (PEFT's rule: the pattern
    matches the end of the module's name, at a dot)."""
    for pat, a in (c.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pat})$", module_key):
            return float(a)
    return float(c.get("lora_alpha", c.get("r", 8)))


def read_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check a PEFT LoRA adapter folder for a base model of config `cfg`. Raises LoraError
    naming the file, tensor or field that is wrong (nothing is half-loaded)."""
    from safetensors import safe_open
    path = os.path.expanduser(str(path))
    c = _config(path)
    wpath = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(wpath):
        other = " (adapter_model.bin is not read: save with safe_serialization=True)" \
            if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
        raise LoraError(f"{path!r} has no {WEIGHTS_FILE}{other}")
    shapes = {m: (K, N) for lin, (K, parts) in linear_shapes(cfg).items() for m, N in parts}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(wpath, framework="pt") as f:
            for key in f.keys():
                m = _KEY.search(key)
                if m is None or m.group(3) not in MODULES:
                    raise LoraError(f"{WEIGHTS_FILE}: tensor {key!r} is not a LoRA weight of a supported module "
                                    f"(q/k/v/o/gate/up/down projections of the decoder layers)")
                layer = int(m.group(1))
                if layer >= cfg.num_layers:
                    raise LoraError(f"{WEIGHTS_FILE}: tensor {key!r} adapts layer {layer}, but the model has "
                                    f"{cfg.num_layers} layers")
                pairs.setdefault((layer, m.group(3)), {})[m.group(4)] = f.get_tensor(key)
    except LoraError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors' own errors: a truncated or foreign file
        raise LoraError(f"{WEIGHTS_FILE} cannot be read as safetensors: {e}") from None
    if not pairs:
        raise LoraError(f"{WEIGHTS_FILE} holds no LoRA weights")
    ad = LoraAdapter(name=name, path=path, rank=0)
    for (layer, mod), ab in sorted(pairs.items(), key=lambda kv: (kv[0][0], list(MODULES).index(kv[0][1]))):
        where = f"layers.{layer}.{mod}"
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{WEIGHTS_FILE}: {where} has lora_{'A' if 'A' in ab else 'B'} but no "
                            f"lora_{'B' if 'A' in ab else 'A'}")
        A, B = ab["A"], ab["B"]
        K, N = shapes[mod]
        if not (A.is_floating_point() and B.is_floating_point()):
            raise LoraError(f"{WEIGHTS_FILE}: {where} weights are {A.dtype}/{B.dtype}, expected floating point")
        r = A.shape[0] if A.dim() == 2 else -1
        if A.dim() != 2 or B.dim() != 2 or A.shape[1] != K or B.shape[0] != N or B.shape[1] != r or r < 1:
            raise LoraError(f"{WEIGHTS_FILE}: {where} has lora_A {list(A.shape)} and lora_B {list(B.shape)}; "
                            f"this model needs lora_A [r, {K}] and lora_B [{N}, r]")
        if r > max_rank:
            raise LoraError(f"{where} has rank {r}, more than --max-lora-rank {max_rank}")
        A, B = A.float(), B.float()
        if not (torch.isfinite(A).all() and torch.isfinite(B).all()):
            raise LoraError(f"{WEIGHTS_FILE}: {where} holds NaN or infinite values")
        section = "self_attn" if MODULES[mod][0] in ("qkv", "o") else "mlp"
        alpha = _alpha(c, f"model.layers.{layer}.{section}.{mod}")
        scale = alpha / math.sqrt(r) if c.get("use_rslora") else alpha / r
        ad.weights[(layer, mod)] = (A.contiguous(), (B * scale).t().contiguous())
        ad.rank = max(ad.rank, r)
    return ad


@dataclass
class LoraRows:
    """One step's rows that run with an adapter, grouped by slot into items of at most
    LORA_RB rows (kernels.c), and the torch path's per-slot row lists."""
    lrows: torch.Tensor      # [n] int64: rows, grouped by slot
    litems: torch.Tensor     # [items + 1] int64: item i is lrows[litems[i]:litems[i + 1]]
    lslot: torch.Tensor      # [items] int64: the slot of each item
    by_slot: dict[int, torch.Tensor]

    @property
    def nitems(self) -> int:
        return self.lslot.numel()


LORA_RB = 4     # kernels.c's rows per item


class LoraPool:
    """The executor's adapter slots: per slot and linear layer the stacked A rows of the parts the
    adapter adapts ([3 * max_rank, K] at most) and each part's B^T, in float32, and the int64
    records the kernels read. A slot that does not adapt a linear has record field `a` = 0."""

    def __init__(self, cfg: ModelConfig, slots: int, max_rank: int, device: Optional[torch.device] = None):
        self.cfg = cfg
        self.slots = slots
        self.max_rank = max_rank
        self.device = torch.device(device or "cpu")
        self.shapes = linear_shapes(cfg)
        L = cfg.num_layers
        z = lambda *s: torch.zeros(s, dtype=torch.float32, device=self.device)
        self.A = {lin: z(L, slots, len(parts) * max_rank, K) for lin, (K, parts) in self.shapes.items()}
        self.Bt = {lin: [z(L, slots, max_rank, N) for _, N in parts] for lin, (K, parts) in self.shapes.items()}
        self.table = torch.zeros((L, len(_LINEARS), slots, len(_FIELD)), dtype=torch.int64)
        # the per-(layer, linear) views, made once: indexing the table on every call cost ~10 us,
        # 120 calls a step (1.2 ms of a 64-row decode step)
        self._tables = {(li, lin): self.table[li, gi] for li in range(L) for gi, lin in enumerate(_LINEARS)}
        self.names: list[Optional[str]] = [None] * slots

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * 4 for t in self.A.values()) + sum(t.numel() * 4 for v in self.Bt.values() for t in v)

    def load(self, slot: int, ad: LoraAdapter) -> None:
        """Copy the adapter's weights into `slot` (whatever was there is replaced)."""
        if ad.rank > self.max_rank:
            raise LoraError(f"adapter {ad.name!r} has rank {ad.rank}, more than the pool's {self.max_rank}")
        self.clear(slot)
        for li in range(self.cfg.num_layers):
            for gi, lin in enumerate(_LINEARS):
                K, parts = self.shapes[lin]
                rec = self.table[li, gi, slot]
                col = roff = 0
                used = []
                for p, (mod, N) in enumerate(parts):
                    w = ad.weights.get((li, mod))
                    if w is not None:
                        A, Bt = w
                        r = A.shape[0]
                        self.A[lin][li, slot, roff: roff + r].copy_(A)
                        b = self.Bt[lin][p][li, slot]
                        b[:r].copy_(Bt)
                        used.append((b, col, N, roff, r))
                        roff += r
                    col += N
                if not used:
                    continue
                a = self.A[lin][li, slot]
                rec[_FIELD["a"]] = a.data_ptr()
                rec[_FIELD["rank"]] = roff
                rec[_FIELD["parts"]] = len(used)
                for j, (b, c0, N, r0, r) in enumerate(used):
                    base = _FIELD["b0"] + j * _PART
                    rec[base: base + _PART] = torch.tensor([b.data_ptr(), c0, N, r0, r])
        self.names[slot] = ad.name

    def clear(self, slot: int) -> None:
        self.table[:, :, slot] = 0
        self.names[slot] = None

    def layer_table(self, li: int, lin: str) -> torch.Tensor:
        """The records of one layer's linear, one per slot (the kernel's `rec`)."""
        return self._tables[li, lin]

    @staticmethod
    def rows(row_slot: list[int]) -> Optional[LoraRows]:
        """The step's rows with an adapter (slot >= 0), grouped by slot; None when there are none."""
        by: dict[int, list[int]] = {}
        for r, s in enumerate(row_slot):
            if s >= 0:
                by.setdefault(s, []).append(r)
        if not by:
            return None
        lrows: list[int] = []
        litems = [0]
        lslot: list[int] = []
        for s in sorted(by):
            rs = by[s]
            for i in range(0, len(rs), LORA_RB):
                lrows.extend(rs[i: i + LORA_RB])
                litems.append(len(lrows))
                lslot.append(s)
        long = lambda xs: torch.tensor(xs, dtype=torch.long)
        return LoraRows(long(lrows), long(litems), long(lslot), {s: long(rs) for s, rs in by.items()})

    def apply(self, li: int, lin: str, x: torch.Tensor, y: torch.Tensor, rows: Optional[LoraRows],
              kernels=None) -> None:
        """y[row] += the update of each row's slot for layer li's linear `lin`, in place; x is the
        linear's input. The fused kernel where there is one, else the same sums in torch."""
        if rows is None:
            return
        if kernels is not None:
            kernels.lora(x, y, self.layer_table(li, lin), rows)
            return
        gi = _LINEARS.index(lin)
        for s, idx in rows.by_slot.items():
            rec = self.table[li, gi, s]
            if not int(rec[0]):
                continue
            a, R, used = self._slot_parts(li, lin, s)
            xs = x.index_select(0, idx).float()
            sh = xs @ a[:R].t()                                        # [n, R]
            for b, c0, N, r0, r in used:
                ys = y[:, c0: c0 + N].index_select(0, idx)
                upd = (ys.float() + sh[:, r0: r0 + r] @ b[:r]).to(y.dtype)
                y[:, c0: c0 + N].index_copy_(0, idx, upd)

    def _slot_parts(self, li: int, lin: str, slot: int):
        """(A rows, rank, parts) of a loaded slot, read back from its record (the torch path)."""
        gi = _LINEARS.index(lin)
        rec = self.table[li, gi, slot].tolist()
        K, parts = self.shapes[lin]
        used = []
        for j in range(rec[_FIELD["parts"]]):
            base = _FIELD["b0"] + j * _PART
            ptr, c0, N, r0, r = rec[base: base + _PART]
            p = next(i for i, t in enumerate(self.Bt[lin]) if t[li, slot].data_ptr() == ptr)
            used.append((self.Bt[lin][p][li, slot], c0, N, r0, r))
        return self.A[lin][li, slot], rec[_FIELD["rank"]], used


class LoraRegistry:
    """The adapters an engine serves (name -> folder, checked when registered) and the ones kept in
    host memory: at most `host_capacity`, least recently used out first (vLLM's max_cpu_loras); an
    adapter out of host memory is read from its folder again when it is next loaded into a slot."""

    def __init__(self, cfg: ModelConfig, max_rank: int, host_capacity: int):
        self.cfg = cfg
        self.max_rank = max_rank
        self.host_capacity = max(1, host_capacity)
        self.paths: dict[str, str] = {}
        self.host: dict[str, LoraAdapter] = {}      # insertion order = recency (oldest first)
        self.disk_reads = 0

    def __contains__(self, name: str) -> bool:
        return name in self.paths

    def names(self) -> list[str]:
        return list(self.paths)

    def register(self, name: str, path: str) -> LoraAdapter:
        """Read and check the adapter now (LoraError if it cannot be served) and keep it."""
        if not name or not isinstance(name, str):
            raise LoraError("an adapter needs a non-empty name")
        if name in self.paths:
            raise LoraError(f"an adapter named {name!r} is loaded already (from {self.paths[name]!r}); "
                            "unload it first")
        ad = read_adapter(name, path, self.cfg, self.max_rank)
        self.paths[name] = ad.path
        self._keep(ad)
        return ad

    def unregister(self, name: str) -> None:
        self.paths.pop(name, None)
        self.host.pop(name, None)

    def get(self, name: str) -> LoraAdapter:
        """The adapter's weights, from host memory or read again from its folder."""
        ad = self.host.pop(name, None)
        if ad is None:
            if name not in self.paths:
                raise LoraError(f"no adapter named {name!r} is loaded")
            ad = read_adapter(name, self.paths[name], self.cfg, self.max_rank)
            self.disk_reads += 1
        self._keep(ad)
        return ad

    def _keep(self, ad: LoraAdapter) -> None:
        self.host[ad.name] = ad
        while len(self.host) > self.host_capacity:
            self.host.pop(next(iter(self.host)))
