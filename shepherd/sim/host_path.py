"""The engine's per-step CPU path, modelled from its parts, and a cost model that puts it beside
a GPU model instead of one fitted overhead.

Parts, each `fixed + per_req x requests in the step + per_token x tokens fed`, in seconds,
measured once on shepherd's own engine (sim/host_profile.py, `shepherd calibrate --host-path`):

    schedule   Scheduler.schedule()
    prepare    the executor's inputs (TorchExecutor.build_input) and its new / finished requests
    sample     the sampler's host work per row; the pass over the vocabulary is the device's work
               on a GPU and is taken out
    update     Scheduler.on_step, the core's output tuples, pickling the CoreStep for the pipe
    front      the server process: unpickling, OutputProcessor (detokenise, stop strings,
               metrics, the stream) and the SSE chunk of every output

How they combine is shepherd's process layout, not a fit: the core process runs schedule,
prepare, the forward, sample and update one after the other; the front process handles step
N's outputs while the core runs step N+1. So a step costs

    max(GPU + schedule + prepare + sample + update,  front)

Inside a multi-step window the scheduler's fixed part is what a continuing step saves
(`overhead[0]`, what step_shape.MultiStep.window_cost subtracts).

Not in the parts: kernel launches of the forward (a GPU profile such as vidur's times kernels;
launch gaps and CUDA graphs are not modelled), the host-to-device copy of the inputs, HTTP
framing by the ASGI server, and the client.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from shepherd.sim.cost_model import BatchShape, CostModel

CORE_PARTS = ("schedule", "prepare", "sample", "update")
PARTS = CORE_PARTS + ("front",)


@dataclass
class HostPart:
    """seconds = fixed + per_req x requests + per_token x tokens fed"""
    fixed: float = 0.0
    per_req: float = 0.0
    per_token: float = 0.0

    def time(self, n: int, tokens: int) -> float:
        return self.fixed + self.per_req * n + self.per_token * tokens


@dataclass
class HostPath:
    schedule: HostPart = field(default_factory=HostPart)
    prepare: HostPart = field(default_factory=HostPart)
    sample: HostPart = field(default_factory=HostPart)
    update: HostPart = field(default_factory=HostPart)
    front: HostPart = field(default_factory=HostPart)
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        core = [getattr(self, p) for p in CORE_PARTS]
        # the core's parts summed once: the step's serial CPU time is three numbers
        self._core = HostPart(sum(p.fixed for p in core), sum(p.per_req for p in core),
                              sum(p.per_token for p in core))

    def core_time(self, n: int, tokens: int) -> float:
        """The core process's CPU around the forward of a step of n requests and `tokens` fed."""
        return self._core.time(n, tokens)

    def front_time(self, n: int) -> float:
        """The front process's CPU for one step's outputs of n requests."""
        return self.front.time(n, n)

    def parts_time(self, n: int, tokens: int) -> dict[str, float]:
        return {p: getattr(self, p).time(n, n if p == "front" else tokens) for p in PARTS}

    # -- persistence -------------------------------------------------------
    def to_dict(self) -> dict:
        return {"kind": "host_path", **{p: asdict(getattr(self, p)) for p in PARTS}, "meta": self.meta}

    def save(self, path: str) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: dict) -> "HostPath":
        if d.get("kind") != "host_path":
            raise ValueError("not a host-path profile (kind != 'host_path'); write one with "
                             "`shepherd calibrate --host-path`")
        return cls(**{p: HostPart(**d[p]) for p in PARTS}, meta=dict(d.get("meta", {})))


def load_host_path(path: Optional[str] = None) -> HostPath:
    """A host-path profile: FILE, or None / 'default' for the one shipped with shepherd
    (shepherd/data/host_path/, measured once on the machine its meta names)."""
    if path in (None, "", "default"):
        from shepherd.paths import data_path
        path = str(data_path("host_path", "default.json"))
    return HostPath.from_dict(json.loads(Path(path).read_text()))


def fit_part(samples: list[tuple[int, int, float]], per_token: bool = False) -> HostPart:
    """Least squares of seconds over (requests, tokens) samples, every coefficient >= 0
    (a term the fit drives negative is dropped and the rest refitted)."""
    if not samples:
        return HostPart()
    a = np.array(samples, dtype=np.float64)
    cols = [np.ones(len(a)), a[:, 0]] + ([a[:, 1]] if per_token else [])
    names = ["fixed", "per_req"] + (["per_token"] if per_token else [])
    keep = list(range(len(cols)))
    while True:
        X = np.stack([cols[i] for i in keep], axis=1)
        coef, *_ = np.linalg.lstsq(X, a[:, 2], rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    out = {n: 0.0 for n in names}
    for i, c in zip(keep, coef):
        out[names[i]] = max(0.0, float(c))
    return HostPart(**out)


class HostPathCostModel(CostModel):
    """A GPU model (its own overhead set to 0) with shepherd's host path beside it:
    step = max(GPU + core parts, front). Everything else (KV capacity, swap, the profiled
    range's counters) is the GPU model's."""

    def __init__(self, gpu: CostModel, host: HostPath):
        gpu.set_overhead(0.0, 0.0, False)
        self.gpu_model = gpu
        self.host = host
        self.name = f"{gpu.name}+host-path"
        self.kv_bytes_per_token = gpu.kv_bytes_per_token
        self.pcie_bw = gpu.pcie_bw
        self.frontend = gpu.frontend
        c = host.core_time
        self._c0, self._cn = c(0, 0), c(1, 1) - c(0, 0)     # a decode step: n requests, n tokens
        self._f0, self._fn = host.front.fixed, host.front.per_req + host.front.per_token

    def __getattr__(self, name):          # beyond_steps, profiled_tokens, ...: the GPU model's
        if name in ("gpu_model", "host"):
            raise AttributeError(name)
        return getattr(self.gpu_model, name)

    def _combine(self, gpu, n: int):
        """One expression for floats and arrays, so the fast path's steps are the step-by-step ones."""
        core = self._c0 + self._cn * n
        front = self._f0 + self._fn * n
        if isinstance(gpu, np.ndarray):
            return np.maximum(gpu + core, front)
        t = gpu + core
        return t if t >= front else front

    def shape_time(self, s: BatchShape) -> float:
        if s.num_seqs == 0 and s.swap_tokens == 0:
            return 0.0
        t = self.gpu_model.shape_time(s) + self.host.core_time(s.num_seqs, s.num_tokens)
        f = self.host.front_time(s.num_seqs)
        return t if t >= f else f

    def decode_step_times(self, n: int, ctx0: int, k: int) -> np.ndarray:
        return self._combine(self.gpu_model.decode_step_times(n, ctx0, k), n)

    def decode_step_time(self, n: int, ctx: int) -> float:
        return self._combine(self.gpu_model.decode_step_time(n, ctx), n)

    def decode_step_lb(self, n: int, ctx: int) -> float:
        return self._combine(self.gpu_model.decode_step_lb(n, ctx), n)

    def swap_time(self, num_tokens: int) -> float:
        return self.gpu_model.swap_time(num_tokens)

    def kv_capacity_tokens(self, *a, **kw) -> int:
        return self.gpu_model.kv_capacity_tokens(*a, **kw)

    def set_overhead(self, fixed=None, per_request=None, overlap=None) -> "CostModel":
        if fixed or per_request or overlap:
            raise ValueError("--host-path models the per-step overhead from its parts: "
                             "drop --step-overhead / --seq-overhead / --overlap-output")
        return self

    @property
    def overhead(self) -> tuple[float, float]:
        # what a continuing step of a multi-step window does not pay: the scheduler's fixed part
        return (self.host.schedule.fixed, 0.0)

    def describe(self) -> dict:
        return {**self.gpu_model.describe(), "name": self.name, "host_path": self.host.to_dict()}


__all__ = ["HostPart", "HostPath", "HostPathCostModel", "load_host_path", "fit_part", "PARTS", "CORE_PARTS"]
