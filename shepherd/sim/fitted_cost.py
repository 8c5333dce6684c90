"""Fitted cost models: a table over the tokens in a step plus linear terms,
fitted to measurements (`shepherd calibrate`), vidur operator profiles or
splitwise-sim's measured prompt/token times. See sim/cost_model.py for the
interface they share with the roofline.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from shepherd.paths import data_path
from shepherd.sim.cost_model import BatchShape, CostModel, RooflineCostModel
from shepherd.sim.hardware import GPUS, MODELS, GPUSpec, ModelSpec, get_gpu, get_model



FEATURES = ("ctx_tokens", "prefill_pairs", "num_seqs", "sampled")


@dataclass
class FittedCostModel(CostModel):
    """step = interp(num_tokens; grid_tokens, grid_s) + sum(coef[f] * shape.f) (+ swap).

    The table part carries everything that scales with the tokens fed (the
    linear layers, norms, the step's fixed overhead at its first point); the
    linear part carries attention over the KV (ctx_tokens), prefill attention
    (prefill_pairs) and per-sequence costs.

    Past the grid's last point (the profiled range) the table is extrapolated from its
    last two points, never downwards (a noisy last pair could slope down: a step of twice
    the tokens then cost less), and never below `floor`, the roofline of the same tokens'
    non-attention work (RooflineCostModel.linear_floor). `beyond_steps` counts the steps
    priced past the grid, `floored_steps` those the floor decided: the simulator reports
    both."""
    grid_tokens: list = field(default_factory=lambda: [1])
    grid_s: list = field(default_factory=lambda: [0.0])
    coef: dict = field(default_factory=dict)
    kv_bytes_per_token: int = 0
    pcie_bw: float = 25e9
    name: str = "fitted"
    meta: dict = field(default_factory=dict)
    cpu_fixed: float = 0.0          # per-step host overhead (scheduler, input prep), s
    cpu_per_req: float = 0.0        # ... per request in the batch, s
    overlap: bool = False           # cpu_per_req runs beside the GPU (CostModel.set_overhead)
    frontend: float = 0.0           # added to each request's TTFT (CostModel.frontend)
    floor: dict = field(default_factory=dict)   # past the grid: RooflineCostModel.linear_floor()

    def __post_init__(self):
        order = np.argsort(self.grid_tokens)
        self._gx = np.asarray(self.grid_tokens, dtype=np.float64)[order]
        self._gy = np.asarray(self.grid_s, dtype=np.float64)[order]
        self._c = {f: float(self.coef.get(f, 0.0)) for f in FEATURES}
        self._hi = float(self._gx[-1])
        gx, gy = self._gx, self._gy
        self._slope = max(0.0, float((gy[-1] - gy[-2]) / (gx[-1] - gx[-2]))) if len(gx) > 1 else 0.0
        self.beyond_steps = 0
        self.floored_steps = 0

    def _floor(self, x):
        f = self.floor
        if not f:
            return 0.0
        return np.maximum(f["mem_a"] + f["mem_tok"] * x, f["c_tok"] * x)

    def _beyond(self, x, count: int = 0):
        """The table past the grid (x > its last point); `count` steps are charged to the
        counters (0: a lookup, not a step)."""
        y = self._gy[-1] + self._slope * (x - self._hi)
        fl = self._floor(x)
        if count:
            self.beyond_steps += count
            if np.any(fl > y):
                self.floored_steps += count
        return np.maximum(y, fl)

    def _table(self, x, count: int = 0):
        gx, gy = self._gx, self._gy
        if np.ndim(x):
            x = np.asarray(x, dtype=np.float64)
            y = np.interp(x, gx, gy)
            hi = x > self._hi
            return np.where(hi, self._beyond(x), y) if hi.any() else y
        if x > self._hi:
            return float(self._beyond(float(x), count))
        return float(np.interp(x, gx, gy)) if len(gx) > 1 else float(gy[0])

    @property
    def profiled_tokens(self) -> tuple[int, int]:
        """The token counts the table was measured over."""
        return int(self._gx[0]), int(self._hi)

    def shape_time(self, s: BatchShape) -> float:
        if s.num_seqs == 0 and s.swap_tokens == 0:
            return 0.0
        c = self._c
        t = self._table(s.num_tokens, 1) if s.num_tokens else 0.0
        t += (c["ctx_tokens"] * s.ctx_tokens + c["prefill_pairs"] * s.prefill_pairs
              + c["num_seqs"] * s.num_seqs + c["sampled"] * s.sampled)
        if self.overlap:
            t = self._overlapped(t, s.num_seqs)
        else:
            t += self.cpu_fixed + self.cpu_per_req * s.num_seqs
        if s.swap_tokens:
            t += self.swap_time(s.swap_tokens)
        return max(t, 0.0)

    def _decode_base(self, n: int) -> float:
        cache = self.__dict__.setdefault("_base_cache", {})
        b = cache.get(n)
        if b is None:
            c = self._c
            b = float(self._table(n)) + (c["num_seqs"] + c["sampled"]) * n
            if not self.overlap:
                b += self.cpu_fixed + self.cpu_per_req * n
            cache[n] = b
        return b

    def decode_step_times(self, n: int, ctx0: int, k: int) -> np.ndarray:
        if n > self._hi:
            self._table(n, k)
        ctx = ctx0 + n * np.arange(k, dtype=np.float64)
        t = np.maximum(self._decode_base(n) + self._c["ctx_tokens"] * ctx, 0.0)
        return self._overlapped(t, n) if self.overlap else t

    def decode_step_lb(self, n: int, ctx: int) -> float:
        """decode_step_time without counting a step (the fast path plans with it)."""
        t = self._decode_base(n) + self._c["ctx_tokens"] * float(ctx)
        t = t if t > 0.0 else 0.0
        return self._overlapped(t, n) if self.overlap else t

    def decode_step_time(self, n: int, ctx: int) -> float:
        if n > self._hi:
            self._table(n, 1)
        return self.decode_step_lb(n, ctx)

    # -- persistence -------------------------------------------------------
    def set_overhead(self, fixed: Optional[float] = None, per_request: Optional[float] = None,
                     overlap: Optional[bool] = None) -> "CostModel":
        if (fixed is not None and fixed < 0) or (per_request is not None and per_request < 0):
            raise ValueError("overheads must be >= 0")
        if fixed is not None:
            self.cpu_fixed = fixed
        if per_request is not None:
            self.cpu_per_req = per_request
        if overlap is not None:
            self.overlap = bool(overlap)
        self.__dict__.pop("_base_cache", None)
        return self

    @property
    def overhead(self) -> tuple[float, float]:
        return (self.cpu_fixed, self.cpu_per_req)

    def to_json(self) -> dict:
        return {"kind": "fitted", "name": self.name, "grid_tokens": list(map(int, self.grid_tokens)),
                "grid_s": list(map(float, self.grid_s)), "coef": {k: float(v) for k, v in self.coef.items()},
                "kv_bytes_per_token": int(self.kv_bytes_per_token), "pcie_bw": float(self.pcie_bw),
                "cpu_fixed": float(self.cpu_fixed), "cpu_per_req": float(self.cpu_per_req),
                "overlap": bool(self.overlap), "frontend": float(self.frontend),
                "floor": {k: float(v) for k, v in self.floor.items()}, "meta": self.meta}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def from_json(cls, d: dict) -> "FittedCostModel":
        if d.get("kind") != "fitted":
            raise ValueError(f"not a fitted cost model (kind={d.get('kind')!r})")
        return cls(grid_tokens=d["grid_tokens"], grid_s=d["grid_s"], coef=d.get("coef", {}),
                   kv_bytes_per_token=d.get("kv_bytes_per_token", 0), pcie_bw=d.get("pcie_bw", 25e9),
                   name=d.get("name", "fitted"), meta=d.get("meta", {}),
                   cpu_fixed=d.get("cpu_fixed", 0.0), cpu_per_req=d.get("cpu_per_req", 0.0),
                   overlap=bool(d.get("overlap", False)), frontend=float(d.get("frontend", 0.0)),
                   floor=dict(d.get("floor") or {}))

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


_VIDUR_NAMES = {"Llama-3-8B": "meta-llama_Meta-Llama-3-8B", "Llama-2-7B": "meta-llama_Llama-2-7b-hf",
                "Llama-2-70B": "meta-llama_Llama-2-70b-hf"}
_VIDUR_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
              "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")


def _vidur_path(m: ModelSpec, g: GPUSpec) -> Optional[Path]:
    name = _VIDUR_NAMES.get(m.name)
    if name is None:
        return None
    return data_path("vidur", "profiling_compute", f"{g.name.split('-')[0].lower()}_{name}_mlp.csv")


def _vidur_table(path: Path, m: ModelSpec, tp: int) -> dict[int, float]:
    """Seconds by token count: the medians of every non-attention operator x layers, embedding once."""
    import csv
    table: dict[int, float] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            if int(row["num_tensor_parallel_workers"]) != tp:
                continue
            ms = sum(float(row[f"time_stats.{op}.median"]) for op in _VIDUR_OPS) * m.num_layers
            ms += float(row["time_stats.emb.median"])
            table[int(row["num_tokens"])] = ms / 1e3
    if not table:
        raise ValueError(f"{path}: no rows for tensor parallel {tp}")
    return table


def _vidur_transfer(m: ModelSpec, g: GPUSpec, tp: int) -> tuple[dict[int, float], str]:
    """No profile of `m` on `g`: a model R profiled on `g`, scaled token count by token count by
    m's / R's times on a GPU h where both were profiled: T(m, g) = T(R, g) x T(m, h) / T(R, h).
    Llama-3-8B on H100 comes from Llama-2-7B on H100 and both on A100. On A100 the ratio of the
    two measured profiles is their rooflines' ratio to 2 % (median over 259 token counts; at most
    13 %, near 300 tokens, where the two models' crossovers differ)."""
    for ref in MODELS.values():
        on_g = _vidur_path(ref, g)
        if ref.name == m.name or on_g is None or not on_g.exists():
            continue
        for h in GPUS.values():
            pm, pr = _vidur_path(m, h), _vidur_path(ref, h)
            if h.name != g.name and pm and pr and pm.exists() and pr.exists():
                a, b, c = _vidur_table(on_g, ref, tp), _vidur_table(pm, m, tp), _vidur_table(pr, ref, tp)
                return ({x: a[x] * b[x] / c[x] for x in sorted(set(a) & set(b) & set(c))},
                        f"{on_g.name} x {pm.name} / {pr.name}")
    raise FileNotFoundError(f"no vidur profile of {m.name} on {g.name}, and none to transfer from")


def from_vidur(model: str = "llama-2-7b", gpu: str = "h100", path: Optional[str | Path] = None,
               *, tp: int = 1) -> FittedCostModel:
    """Table model from vidur's profiled MLP-side operator times (shepherd/data/vidur/
    profiling_compute: medians of every non-attention operator x layers, embedding once, by
    token count) plus the LM head's weight read (the profile has no LM head; every step pays
    it), with attention over the KV, prefill attention and the LM head's FLOPs from the GPU's
    roofline and the preset's per-step overhead. Without a profile of this model on this GPU, a profiled one is
    transferred (`_vidur_transfer`; meta["source"] says which)."""
    m, g = get_model(model), get_gpu(gpu)
    own = Path(path) if path is not None else _vidur_path(m, g)
    if own is not None and own.exists():
        table, source = _vidur_table(own, m, tp), str(own)
    elif path is not None:
        raise FileNotFoundError(f"no vidur profile at {own}")
    else:
        table, source = _vidur_transfer(m, g, tp)
    roof = RooflineCostModel(m, g, tp=tp)
    lm_head = m.embedding_params * m.dtype_bytes / (g.hbm_bw * g.mem_eff * tp)
    xs = sorted(table)
    ys = [table[x] + lm_head for x in xs]
    coef = roof.unit_costs()
    # the preset's overhead as the model's own (not in the table), so --step-overhead replaces it
    # as it does the roofline's, and multi-step pays it once per window
    return FittedCostModel(grid_tokens=xs, grid_s=ys, coef=coef, kv_bytes_per_token=m.kv_bytes_per_token,
                           pcie_bw=roof.pcie_bw, name=f"vidur:{m.name}/{g.name}" + (f"x{tp}" if tp > 1 else ""),
                           meta={"source": source, "kv_capacity_tokens": roof.kv_capacity_tokens()},
                           cpu_fixed=roof.overhead[0], cpu_per_req=roof.overhead[1], floor=roof.linear_floor())


def from_splitwise(model: str = "llama-2-70b", gpu: str = "h100", tp: int = 8,
                   path: Optional[str | Path] = None) -> FittedCostModel:
    """Fit to splitwise-sim's measured prompt and per-token times (perf_model.csv:
    prompt_time for a batch of `batch_size` prompts of `prompt_size`; token_time
    per decode step of `batch_size` sequences at context ~prompt_size + token_size/2)."""
    import csv
    m, g = get_model(model), get_gpu(gpu)
    path = Path(path) if path else data_path("splitwise_sim", "perf_model.csv")
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
    fitted.floor = roof.linear_floor()
    return fitted



# --------------------------------------------------------------------------
# DistServe's time model
# --------------------------------------------------------------------------

class DistServeCostModel(CostModel):
    """DistServe's fitted A100 time model (shepherd/data/distserve: its simulator's
    profiler-a100-80g.distserve.json, Apache-2.0), per model and tensor-parallel degree, in
    milliseconds:

        prefill  a + b x (prompt tokens in the batch) + c x (sum of each prompt's tokens squared)
        decode   a + b x (context tokens over the batch, the new one included) + c x batch size,
                 with one (a, b, c) below `threshold` requests and another from it up

    A step that mixes both (DistServe never mixes) costs the sum. The squares come from the
    step's prefill query x key pairs: n(n+1)/2 per prompt of n tokens computed from 0, so
    sum n^2 = 2 x pairs - tokens (exact unless a prompt is chunked). KV capacity: DistServe's
    max_num_tokens.csv. The per-step overhead terms start at 0 (the fits include the engine's
    own) and `set_overhead` adds to them."""

    def __init__(self, model: str, tp: int, coeffs: dict, kv_capacity: int, kv_bytes_per_token: int,
                 pcie_bw: float, source: str):
        self.name = f"distserve:{model}/A100-80GB" + (f"x{tp}" if tp > 1 else "")
        self.prefill = tuple(coeffs["prefill"])
        self.decode_small = tuple(coeffs["decoding_smallbs"])
        self.decode_large = tuple(coeffs["decoding_largebs"])
        self.threshold = int(coeffs["decoding_large_small_bs_threshold"])
        self.kv_capacity = int(kv_capacity)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.pcie_bw = pcie_bw
        self.source = source
        self._ovh = (0.0, 0.0)

    def _decode_ms(self, n: int, ctx):
        a, b, c = self.decode_small if n < self.threshold else self.decode_large
        return a + b * ctx + c * n

    def shape_time(self, s: BatchShape) -> float:
        if s.num_seqs == 0 and s.swap_tokens == 0:
            return 0.0
        ms = 0.0
        pre = s.num_tokens - s.num_decode
        if pre:
            a, b, c = self.prefill
            ms += a + b * pre + c * (2 * s.prefill_pairs - pre)
        if s.num_decode:
            ms += self._decode_ms(s.num_decode, s.decode_ctx)
        t = ms / 1e3 + self._ovh[0] + self._ovh[1] * s.num_seqs
        return t + self.swap_time(s.swap_tokens) if s.swap_tokens else t

    def decode_step_times(self, n: int, ctx0: int, k: int) -> np.ndarray:
        ctx = ctx0 + n * np.arange(k, dtype=np.float64)
        return self._decode_ms(n, ctx) / 1e3 + (self._ovh[0] + self._ovh[1] * n)

    def decode_step_time(self, n: int, ctx: int) -> float:
        return self._decode_ms(n, float(ctx)) / 1e3 + (self._ovh[0] + self._ovh[1] * n)

    decode_step_lb = decode_step_time

    def set_overhead(self, fixed: Optional[float] = None, per_request: Optional[float] = None,
                     overlap: Optional[bool] = None) -> "CostModel":
        if overlap:
            raise ValueError("the DistServe time model has no overlapped output processing")
        f, p = self._ovh
        self._ovh = (f if fixed is None else fixed, p if per_request is None else per_request)
        return self

    @property
    def overhead(self) -> tuple[float, float]:
        return self._ovh

    def kv_capacity_tokens(self, *a, **k) -> int:
        return self.kv_capacity

    def describe(self) -> dict:
        return {"name": self.name, "kind": "distserve", "source": self.source, "prefill_ms": self.prefill,
                "decode_small_ms": self.decode_small, "decode_large_ms": self.decode_large,
                "threshold": self.threshold, "kv_capacity_tokens": self.kv_capacity}


_DISTSERVE_NAMES = {"OPT-13B": "facebook/opt-13b"}


def from_distserve(model: str = "opt-13b", gpu: str = "a100-80gb", tp: int = 1,
                   engine: str = "distserve") -> DistServeCostModel:
    """DistServe's time model of `model` on A100-80GB at tensor parallel `tp` (engine
    'distserve' or 'vllm': its two profile files)."""
    import csv
    m, g = get_model(model), get_gpu(gpu)
    if g.name != "A100-80GB":
        raise ValueError(f"DistServe's profiles are of A100-80GB, not {g.name}")
    key = _DISTSERVE_NAMES.get(m.name)
    path = data_path("distserve", f"profiler-a100-80g.{engine}.json")
    table = json.loads(path.read_text())
    if key not in table or str(tp) not in table[key]:
        have = {k: sorted(v) for k, v in table.items()}
        raise ValueError(f"{path.name}: no profile of {m.name} at tensor parallel {tp} (it has {have})")
    cap = None
    with data_path("distserve", "max_num_tokens.csv").open() as f:
        for row in csv.DictReader(f):
            if row["model"] == key and int(row["tp"]) == tp and int(row["pp"]) == 1:
                cap = int(row["max_num_tokens"])
    if cap is None:
        raise ValueError(f"max_num_tokens.csv: no KV capacity of {m.name} at tensor parallel {tp}")
    roof = RooflineCostModel(m, g, tp=tp)
    return DistServeCostModel(m.name, tp, table[key][str(tp)], cap, m.kv_bytes_per_token, roof.pcie_bw, str(path))


# --------------------------------------------------------------------------
# one entry point for the CLI
# --------------------------------------------------------------------------

def make_cost_model(model: str = "llama-3-8b", gpu: str = "h100", *, tp: int = 1,
                    cost_model: Optional[str] = None, step_overhead: Optional[float] = None,
                    seq_overhead: Optional[float] = None, overlap: Optional[bool] = None,
                    frontend: Optional[float] = None, host_path: Optional[str] = None) -> CostModel:
    """--cost-model: a JSON file written by `shepherd calibrate` (or any fitted
    model), 'roofline' (default), 'vidur', 'splitwise' or 'distserve' (OPT-13B on A100-80GB); --step-overhead and
    --seq-overhead replace the model's per-step overhead terms; --overlap-output
    sets overlap (None keeps the model's own: off, or what its JSON says). host_path ('default' or a
    FILE of `shepherd calibrate --host-path`): the per-step CPU from shepherd's measured parts
    instead of the overhead terms (sim/host_path.py)."""
    if cost_model in (None, "", "roofline"):
        cm: CostModel = RooflineCostModel(model, gpu, tp=tp)
    else:
        if cost_model == "vidur":
            cm = from_vidur(model, gpu, tp=tp)
        elif cost_model == "distserve":
            cm = from_distserve(model, gpu, tp=tp)
        elif cost_model == "splitwise":
            cm = from_splitwise(model, gpu, tp=tp)
        else:
            cm = load_cost_model(cost_model)
    if step_overhead is not None or seq_overhead is not None or overlap is not None:
        cm.set_overhead(step_overhead, seq_overhead, overlap)
    if frontend is not None:
        if frontend < 0:
            raise ValueError(f"frontend latency must be >= 0 seconds, got {frontend}")
        cm.frontend = float(frontend)
    if host_path:
        from shepherd.sim.host_path import HostPathCostModel, load_host_path
        if step_overhead is not None or seq_overhead is not None or overlap:
            raise ValueError("--host-path models the per-step overhead from its parts: "
                             "drop --step-overhead / --seq-overhead / --overlap-output")
        cm = HostPathCostModel(cm, load_host_path(host_path))
    return cm



__all__ = ["FEATURES", "FittedCostModel", "load_cost_model", "fit_cost_model", "from_vidur", "from_splitwise",
           "DistServeCostModel", "from_distserve", "make_cost_model"]
