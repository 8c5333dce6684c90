"""Scraping a server's /metrics during a benchmark (Prometheus text format)."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import httpx


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum each metric over its label sets: {name: value} (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        try:
            name_part, value = line.rsplit(None, 1) if "}" not in line else line.rsplit("}", 1)
            name = name_part.split("{", 1)[0].strip()
            v = float(value.split()[0])
        except (ValueError, IndexError):
            continue
        out[name] = out.get(name, 0.0) + v
    return out


# the vLLM names shepherd serve exports too (and vLLM's older spellings)
_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_swapped": "swapped",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
}
_COUNTERS = {
    "vllm:num_preemptions_total": "preemptions",
    "vllm:num_preemptions": "preemptions",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
}


class MetricsPoller:
    """Polls the server's /metrics once a second; gives up quietly if there is none."""

    def __init__(self, api_key: Optional[str] = None):
        self.api_key = api_key
        self.series: dict[str, list[float]] = {"t": []}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.kv_capacity: Optional[float] = None
        self.kv_peak: Optional[float] = None

    def _take(self, t: float, m: dict[str, float]) -> None:
        row: dict[str, float] = {}
        for name, key in _GAUGES.items():
            if name in m:
                row[key] = m[name]
        for name, key in _COUNTERS.items():
            if name in m:
                self.first.setdefault(key, m[name])
                self.last[key] = m[name]
        for name, v in m.items():  # shepherd's own KV token gauges, if it exports them
            low = name.lower()
            if "kv" in low and "token" in low:
                if "capacity" in low:
                    self.kv_capacity = v
                elif "used" in low:
                    row["kv_used"] = v
                    self.kv_peak = v if self.kv_peak is None else max(self.kv_peak, v)
        if self.kv_capacity is not None and "kv_used" in row:
            row["kv_capacity"] = self.kv_capacity
        if not row:
            return
        self.series["t"].append(round(t, 4))
        for k, v in row.items():
            col = self.series.setdefault(k, [None] * (len(self.series["t"]) - 1))
            col.append(v)
        n = len(self.series["t"])
        for k, col in self.series.items():
            if len(col) < n:
                col.append(col[-1] if col else None)

    async def run(self, client: httpx.AsyncClient, t0: float, stop: asyncio.Event) -> None:
        async with client:
            await asyncio.sleep(0.05)  # let the first requests go out first
            await self._loop(client, t0, stop)

    async def _loop(self, client: httpx.AsyncClient, t0: float, stop: asyncio.Event) -> None:
        misses = 0
        while not stop.is_set():
            try:
                r = await client.get("/metrics", headers=auth_headers(self.api_key), timeout=2.0)
                if r.status_code == 200:
                    self._take(time.perf_counter() - t0, parse_prometheus(r.text))
                    misses = 0
                else:
                    misses += 1
            except httpx.HTTPError:     # metrics are optional; a bug in reading them is not swallowed
                misses += 1
            if misses >= 3:
                return
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    def totals(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        d = {k: self.last[k] - self.first.get(k, 0.0) for k in self.last}
        if "preemptions" in d:
            out["preemptions"] = int(d["preemptions"])
        if d.get("prefix_queries"):
            out["prefix_hit_rate"] = d.get("prefix_hits", 0.0) / d["prefix_queries"]
        if self.kv_capacity is not None:
            out["kv_capacity_tokens"] = int(self.kv_capacity)
        if self.kv_peak is not None:
            out["kv_peak_used_tokens"] = int(self.kv_peak)
        return out


# -- synthetic workloads ------------------------------------------------------


def auth_headers(api_key: Optional[str]) -> dict:
    h = {"Content-Type": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


__all__ = ["MetricsPoller", "parse_prometheus", "auth_headers"]
