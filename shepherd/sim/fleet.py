"""What a simulated fleet is made of, and what it costs.

    groups = parse_fleet("2xh100,1xa100-80gb/tp2")      # heterogeneous: replicas of several GPU types
    groups = parse_fleet("1xa100-80gb/tp2@prefill,1xa100-80gb@decode")   # prefill/decode disaggregation
    SimConfig(fleet=groups, pd=PDConfig(threshold=512))

A `ReplicaGroup` is `count` replicas of one GPU type at one tensor-parallel degree, with
a role: `both` (an ordinary replica), `prefill` or `decode`. A fleet with prefill replicas
disaggregates: a request is routed to a decode (or ordinary) replica first (the router of
`--router`); when the part of its prompt that replica has not cached is at least
`PDConfig.threshold` tokens (llm-d's and Dynamo's conditional decider), its prefill runs on
a prefill replica (least-request among them), which samples the first token; its KV then
crosses the link (`bytes / link_bw + link_latency`) and it decodes on the decode replica.
Shorter prompts are prefilled where they decode.

`FleetCost` prices a run: each GPU type's $/hour (`GPUSpec.price_hr`) and board power
(`GPUSpec.power_w`) times the GPUs of each group; cost per million tokens and goodput per
dollar over the run's duration; energy as board power x each replica's busy time (idle
draw is not modelled).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

from shepherd.sim.hardware import get_gpu

ROLES = ("both", "prefill", "decode")


@dataclass
class ReplicaGroup:
    count: int = 1
    gpu: str = "h100"
    tp: int = 1
    role: str = "both"                  # both | prefill | decode
    scheduler: dict = field(default_factory=dict)   # SchedulerConfig knobs of this group only

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"replica role must be one of {ROLES}, got {self.role!r}")
        if self.count < 1:
            raise ValueError(f"a replica group needs at least one replica, got {self.count}")
        get_gpu(self.gpu)   # unknown GPU: KeyError now, not half-way through a run

    @property
    def gpus(self) -> int:
        return self.count * self.tp

    def label(self) -> str:
        return f"{self.count}x{self.gpu}" + (f"/tp{self.tp}" if self.tp > 1 else "") + \
            (f"@{self.role}" if self.role != "both" else "")


@dataclass
class PDConfig:
    """Prefill/decode disaggregation (used when the fleet has prefill replicas)."""
    threshold: int = 0                  # disaggregate when at least this many prompt tokens are uncached
                                        # on the decode replica (0: always)
    link_bw: float = 50e9               # bytes/s of one request's KV transfer (default: a PCIe 5 x16 link)
    link_latency: float = 0.5e-3        # s per transfer (connection, handshake)
    prefill_router: str = "least-request"

    def transfer_time(self, tokens: int, kv_bytes_per_token: int) -> float:
        return self.link_latency + tokens * kv_bytes_per_token / self.link_bw


_GROUP = re.compile(r"^(?:(\d+)x)?([A-Za-z0-9.\-]+?)(?:/tp(\d+))?(?:@(\w+))?$")


def parse_fleet(spec: str) -> list[ReplicaGroup]:
    """'COUNTxGPU[/tpN][@ROLE],...': e.g. '2xh100,1xa100-80gb/tp2' or
    '1xa100-80gb/tp2@prefill,1xa100-80gb@decode'."""
    groups = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        m = _GROUP.match(part)
        if not m:
            raise ValueError(f"--fleet {part!r}: expected COUNTxGPU[/tpN][@prefill|@decode], e.g. 2xh100/tp2")
        count, gpu, tp, role = m.groups()
        groups.append(ReplicaGroup(int(count or 1), gpu.lower(), int(tp or 1), role or "both"))
    if not groups:
        raise ValueError("--fleet: no replica group given")
    return groups


def parse_prices(items: list[str], what: str) -> dict[str, float]:
    """['h100=2.5', 'a10g=1.0'] -> {gpu: value} (--gpu-price, --gpu-power)."""
    out = {}
    for it in items:
        if "=" not in it:
            raise ValueError(f"{what} {it!r}: expected GPU=VALUE")
        k, v = it.split("=", 1)
        get_gpu(k)
        try:
            value = float(v)
        except ValueError:
            value = math.nan
        if not 0 < value < math.inf:    # h100=-1 reported negative dollars per million tokens
            raise ValueError(f"{what} {it!r}: VALUE must be a number > 0")
        out[k.lower()] = value
    return out


@dataclass
class FleetCost:
    """$/hour and board power per GPU type (the presets', or overrides), for one fleet."""
    groups: list[ReplicaGroup]
    prices: dict = field(default_factory=dict)     # gpu -> $/hour per GPU, overriding GPUSpec.price_hr
    powers: dict = field(default_factory=dict)     # gpu -> W per GPU, overriding GPUSpec.power_w

    def price_hr(self, gpu: str) -> Optional[float]:
        p = self.prices.get(gpu, get_gpu(gpu).price_hr)
        return p if p else None

    def power_w(self, gpu: str) -> Optional[float]:
        w = self.powers.get(gpu, get_gpu(gpu).power_w)
        return w if w else None

    def dollars_per_hour(self) -> Optional[float]:
        prices = [self.price_hr(g.gpu) for g in self.groups]
        if any(p is None for p in prices):
            return None
        return sum(p * g.gpus for p, g in zip(prices, self.groups))

    def report(self, duration_s: float, busy_s: list[float], group_of: list[int], *, output_tokens: int,
               total_tokens: int, good_requests: Optional[int]) -> dict:
        """The run's cost: per group and in all. busy_s[i] is replica i's busy time, group_of[i]
        its group."""
        hours = duration_s / 3600.0 if duration_s > 0 else 0.0
        rows = []
        for gi, g in enumerate(self.groups):
            price, power = self.price_hr(g.gpu), self.power_w(g.gpu)
            busy = sum(b for b, k in zip(busy_s, group_of) if k == gi)
            rows.append({"group": g.label(), "gpu": g.gpu, "gpus": g.gpus, "price_hr_per_gpu": price,
                         "dollars_per_hour": price * g.gpus if price is not None else None,
                         "power_w_per_gpu": power,
                         "busy_fraction": busy / (g.count * duration_s) if duration_s > 0 else None,
                         "energy_kwh": power * g.tp * busy / 3.6e6 if power is not None else None})
        dph = self.dollars_per_hour()
        dollars = dph * hours if dph is not None else None
        energy = (sum(r["energy_kwh"] for r in rows) if all(r["energy_kwh"] is not None for r in rows) else None)
        return {
            "groups": rows, "gpus": sum(g.gpus for g in self.groups), "dollars_per_hour": dph,
            "dollars": dollars,
            "dollars_per_million_output_tokens": dollars / output_tokens * 1e6 if dollars and output_tokens else None,
            "dollars_per_million_tokens": dollars / total_tokens * 1e6 if dollars and total_tokens else None,
            "good_requests_per_dollar": (good_requests / dollars
                                         if dollars and good_requests is not None else None),
            "energy_kwh": energy,
            "joules_per_output_token": energy * 3.6e6 / output_tokens if energy and output_tokens else None,
        }


__all__ = ["ROLES", "ReplicaGroup", "PDConfig", "FleetCost", "parse_fleet", "parse_prices"]
