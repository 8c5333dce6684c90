"""Backends of the gateway: their state, health and scraped metrics.

A `Backend` wraps the `ReplicaState` that the routing policy sees. The
gateway owns `state.in_flight` (+1 at dispatch, -1 when the request ends,
whatever way it ends); a periodic scrape of each backend's /metrics fills
`running`, `waiting` and `kv_usage` (vLLM, shepherd and SGLang names); a
periodic GET /health plus the outcome of real requests drive ejection
(`fail_threshold` consecutive failures) and re-admission (`success_threshold`
consecutive successful health checks). A client's 4xx is never a failure.

Slow is not dead. A replica that refuses connections or answers /health with
an error is failing; one whose /health is merely slow (a busy CPU) is not,
unless nothing at all has come from it (no health answer, no byte of any
request) for `stall_timeout` seconds: then it is stalled and counts as failing.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import urllib.parse
from dataclasses import dataclass
from typing import Iterable, Optional

import httpx

from shepherd.routing import ReplicaState
from shepherd.server.guard import BODY_CAP_HEADER, body_cap_of

log = logging.getLogger("shepherd.gateway")

# metric name -> (field, how to combine several label sets)
RUNNING_NAMES = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING_NAMES = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_WANTED = set(RUNNING_NAMES + WAITING_NAMES + KV_NAMES)
LORA_INFO = "vllm:lora_requests_info"     # labels running_lora_adapters / waiting_lora_adapters: "a,b"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_lora_info(text: str) -> tuple[frozenset, frozenset]:
    """(adapters the replica runs or queues, per vllm:lora_requests_info's newest series; the
    model_name labels of its vllm: metrics, i.e. its base model names)."""
    adapters: frozenset = frozenset()
    newest = None
    models = set()
    for line in text.splitlines():
        if not line.startswith("vllm:") or "{" not in line:
            continue
        name, _, rest = line.partition("{")
        labels = dict(_LABEL.findall(rest[:rest.rfind("}")]))
        if "model_name" in labels:
            models.add(labels["model_name"])
        if name != LORA_INFO:
            continue
        try:
            t = float(rest[rest.rfind("}") + 1:].split()[0])
        except (ValueError, IndexError):
            continue
        if newest is None or t >= newest:
            newest = t
            adapters = frozenset(a for k in ("running_lora_adapters", "waiting_lora_adapters")
                                 for a in labels.get(k, "").split(",") if a)
    return adapters, frozenset(models)


def parse_backend_metrics(text: str) -> dict:
    """Prometheus text -> {"running": int|None, "waiting": int|None, "kv_usage": float|None}.
    Several label sets of one metric (models, DP ranks) are summed for counts
    and maxed for KV use; the first known name found for each field wins, in
    the order of RUNNING_NAMES / WAITING_NAMES / KV_NAMES."""
    found: dict = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        cut = line.find("{")
        if cut < 0:
            cut = line.find(" ")
        if cut <= 0:
            continue
        name = line[:cut]
        if name not in _WANTED:
            continue
        rest = line[line.rfind("}") + 1:] if line[cut] == "{" else line[cut:]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if value != value:          # NaN
            continue
        found.setdefault(name, []).append(value)

    def first(names, combine):
        for n in names:
            if n in found:
                return combine(found[n])
        return None

    running = first(RUNNING_NAMES, sum)
    waiting = first(WAITING_NAMES, sum)
    kv = first(KV_NAMES, max)
    if kv is not None:
        if kv > 1.0:                # a percentage, not a fraction
            kv /= 100.0
        kv = min(max(kv, 0.0), 1.0)
    return {"running": None if running is None else int(round(running)),
            "waiting": None if waiting is None else int(round(waiting)),
            "kv_usage": kv}


def normalize_url(url: str) -> str:
    url = url.strip()
    if not url:
        raise ValueError("empty backend URL")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"backend URL must be http(s): {url!r}")
    try:        # a port past 65535 would fail only at the first request, as a replica "down"
        parts = urllib.parse.urlsplit(url)
        parts.port
    except ValueError as e:
        raise ValueError(f"backend URL {url!r}: {e}") from None
    if not parts.hostname:
        raise ValueError(f"backend URL {url!r} has no host")
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    return url


def read_backend_file(path: str) -> list[str]:
    """One URL per line (# comments, blank lines ignored), or a JSON list of
    URLs, or a JSON object {"backends": [...]}."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    stripped = text.strip()
    if stripped.startswith(("[", "{")):
        data = json.loads(stripped)
        if isinstance(data, dict):
            data = data.get("backends", [])
        return [normalize_url(str(u)) for u in data]
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(normalize_url(line))
    return out


@dataclass
class HealthConfig:
    fail_threshold: int = 3          # consecutive failures that eject a backend
    success_threshold: int = 2       # consecutive good health checks that re-admit it
    health_interval: float = 1.0     # seconds between GET /health of each backend
    health_timeout: float = 2.0
    metrics_interval: float = 0.25   # seconds between /metrics scrapes (0 = off)
    metrics_timeout: float = 1.0
    file_interval: float = 1.0       # seconds between checks of --backend-file
    stall_timeout: float = 30.0      # a replica silent this long (health and traffic) is failing


class Backend:
    def __init__(self, url: str, source: str = "cli") -> None:
        self.url = normalize_url(url)
        self.source = source                # "cli", "file" or "admin"
        self.state = ReplicaState(index=0, url=self.url, name=self.url)
        self.consecutive_failures = 0
        self.consecutive_successes = 0
        self.total_requests = 0
        self.total_failures = 0
        self.last_error: Optional[str] = None
        self.removed = False
        self.ejections = 0
        self.last_progress = time.monotonic()   # when a byte last came from it (health or traffic)
        self.max_body_bytes: Optional[int] = None   # its body cap, from its /health answer (shepherd's)

    @property
    def healthy(self) -> bool:
        return self.state.healthy

    def to_dict(self) -> dict:
        s = self.state
        return {"url": self.url, "source": self.source, "healthy": s.healthy,
                "in_flight": s.in_flight, "running": s.running, "waiting": s.waiting,
                "kv_usage": s.kv_usage, "metrics_at": s.metrics_at,
                "consecutive_failures": self.consecutive_failures,
                "total_requests": self.total_requests, "total_failures": self.total_failures,
                "ejections": self.ejections, "last_error": self.last_error}


class BackendPool:
    """The set of backends, their health and metrics loops. Runs inside one
    event loop (the gateway's); all mutations happen on that loop."""

    def __init__(self, urls: Iterable[str] = (), health: Optional[HealthConfig] = None,
                 backend_file: Optional[str] = None, on_change=None, on_health=None) -> None:
        self.health = health or HealthConfig()
        self.backend_file = backend_file
        self._backends: dict[str, Backend] = {}
        self._replicas: list[ReplicaState] = []
        self._file_sig: Optional[tuple] = None
        self._tasks: list[asyncio.Task] = []
        self._client: Optional[httpx.AsyncClient] = None
        self.on_change = on_change          # callback(removed_url or None) when the set changes
        self.on_health = on_health          # callback(backend) when a backend's health flips
        for u in urls:
            self.add(u, source="cli")
        if backend_file:
            self.reload_file(force=True)

    # --- membership -------------------------------------------------------------
    def add(self, url: str, source: str = "admin") -> Backend:
        url = normalize_url(url)
        b = self._backends.get(url)
        if b is None:
            b = Backend(url, source)
            self._backends[url] = b
            self._rebuild()
            log.info("backend added: %s (%s)", url, source)
        return b

    def remove(self, url: str) -> bool:
        url = normalize_url(url)
        b = self._backends.pop(url, None)
        if b is None:
            return False
        b.removed = True
        self._rebuild()
        log.info("backend removed: %s", url)
        if self.on_change:
            self.on_change(url)
        return True

    def _rebuild(self) -> None:
        self._replicas = []
        for i, b in enumerate(self._backends.values()):
            b.state.index = i
            self._replicas.append(b.state)

    def get(self, url: str) -> Optional[Backend]:
        return self._backends.get(url)

    def backends(self) -> list[Backend]:
        return list(self._backends.values())

    def replicas(self) -> list[ReplicaState]:
        return self._replicas

    def healthy_count(self) -> int:
        return sum(1 for r in self._replicas if r.healthy)

    def reload_file(self, force: bool = False) -> bool:
        """Re-read --backend-file if it changed; file backends not in it any
        more are removed, new ones added. Returns True if it was (re)read."""
        path = self.backend_file
        if not path:
            return False
        try:
            st = os.stat(path)
        except OSError as e:
            log.warning("backend file %s: %s", path, e)
            return False
        sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        if not force and sig == self._file_sig:
            return False
        try:
            urls = read_backend_file(path)
        except (OSError, ValueError) as e:
            log.warning("backend file %s unreadable, keeping the current set: %s", path, e)
            self._file_sig = sig
            return False
        self._file_sig = sig
        wanted = set(urls)
        for b in list(self._backends.values()):
            if b.source == "file" and b.url not in wanted:
                self.remove(b.url)
        for u in urls:
            self.add(u, source="file")
        return True

    # --- health bookkeeping -------------------------------------------------------
    @staticmethod
    def saw_progress(b: Backend) -> None:
        b.last_progress = time.monotonic()

    def record_success(self, b: Backend) -> None:
        b.consecutive_failures = 0
        b.last_progress = time.monotonic()

    def record_failure(self, b: Backend, reason: str) -> None:
        b.consecutive_failures += 1
        b.consecutive_successes = 0
        b.total_failures += 1
        b.last_error = reason
        if b.state.healthy and b.consecutive_failures >= self.health.fail_threshold:
            b.state.healthy = False
            b.ejections += 1
            log.warning("backend ejected after %d consecutive failures: %s (%s)",
                        b.consecutive_failures, b.url, reason)
            if self.on_health:
                self.on_health(b)

    def _health_ok(self, b: Backend) -> None:
        b.consecutive_failures = 0
        b.consecutive_successes += 1
        if not b.state.healthy and b.consecutive_successes >= self.health.success_threshold:
            b.state.healthy = True
            log.warning("backend re-admitted after %d good health checks: %s",
                        b.consecutive_successes, b.url)
            if self.on_health:
                self.on_health(b)

    # --- loops ----------------------------------------------------------------------
    async def check_health(self, b: Backend) -> bool:
        assert self._client is not None
        try:
            r = await self._client.get(b.url + "/health", timeout=self.health.health_timeout)
            ok = 200 <= r.status_code < 300
        except httpx.TimeoutException as e:
            if b.removed:
                return False
            silent = time.monotonic() - b.last_progress
            if silent < self.health.stall_timeout:
                log.info("backend %s slow to answer /health (%s); silent for %.1f s, not failing yet",
                         b.url, type(e).__name__, silent)
                return False
            self.record_failure(b, f"health: no answer, silent for {silent:.0f} s (stalled)")
            return False
        except (httpx.HTTPError, OSError) as e:
            ok = False
            reason = f"health: {type(e).__name__}"
        else:
            reason = f"health: HTTP {r.status_code}"
            b.last_progress = time.monotonic()
            b.max_body_bytes = body_cap_of(r.headers.get(BODY_CAP_HEADER))
        if b.removed:
            return ok
        if ok:
            self._health_ok(b)
        else:
            self.record_failure(b, reason)
        return ok

    async def scrape(self, b: Backend) -> bool:
        assert self._client is not None
        try:
            r = await self._client.get(b.url + "/metrics", timeout=self.health.metrics_timeout)
            if r.status_code != 200:
                return False
            m = parse_backend_metrics(r.text)
        except (httpx.HTTPError, OSError, UnicodeDecodeError):
            return False
        s = b.state
        if m["running"] is not None:
            s.running = m["running"]
        if m["waiting"] is not None:
            s.waiting = m["waiting"]
        if m["kv_usage"] is not None:
            s.kv_usage = m["kv_usage"]
        s.adapters, s.base_models = parse_lora_info(r.text)
        s.metrics_at = time.monotonic()
        return True

    async def _every(self, interval: float, fn) -> None:
        while True:
            try:
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception:           # a loop must never die
                log.exception("gateway background loop")
            await asyncio.sleep(interval)

    async def _health_round(self) -> None:
        bs = self.backends()
        if bs:
            await asyncio.gather(*(self.check_health(b) for b in bs))

    async def _metrics_round(self) -> None:
        bs = [b for b in self.backends() if b.healthy]
        if bs:
            await asyncio.gather(*(self.scrape(b) for b in bs))

    async def _file_round(self) -> None:
        self.reload_file()

    async def start(self) -> None:
        # a separate small client so that scrapes never queue behind traffic
        self._client = httpx.AsyncClient(limits=httpx.Limits(max_connections=64, max_keepalive_connections=32),
                                         trust_env=False)
        h = self.health
        if h.health_interval > 0:
            self._tasks.append(asyncio.create_task(self._every(h.health_interval, self._health_round)))
        if h.metrics_interval > 0:
            self._tasks.append(asyncio.create_task(self._every(h.metrics_interval, self._metrics_round)))
        if self.backend_file and h.file_interval > 0:
            self._tasks.append(asyncio.create_task(self._every(h.file_interval, self._file_round)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        if self._client is not None:
            await self._client.aclose()
            self._client = None
