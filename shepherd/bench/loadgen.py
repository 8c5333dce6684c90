"""Open-loop load against any OpenAI-compatible endpoint (shepherd, its gateway,
vLLM, llama.cpp's server, ...).

Each request is sent at its arrival time (seconds from the start of the run,
divided by `time_scale`) whether or not earlier ones have finished; with
`max_concurrency` a request whose turn comes while that many are in flight
waits on the client side (its record's `arrival` is when it was actually
sent; the wait shows as a ("queued", scheduled, sent) interval). Every request
streams with `stream_options.include_usage`, so TTFT and each inter-token gap
are measured here, on the client's clock; the token count comes from the
final usage chunk when the server sends one, else from the content chunks.

Failures are recorded, never dropped: `http_<status>`, `timeout`,
`disconnect` (the connection broke, or the stream ended without finishing)
and `error` (anything else, including an error event inside the stream).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import httpx

from shepherd.bench.metrics_poll import MetricsPoller, auth_headers, parse_prometheus  # noqa: F401 (re-exported)
from shepherd.bench.prompts import BuiltPrompt
from shepherd.bench.records import RequestRecord, TraceRequest
from shepherd.bench.synthetic import LengthDist


@dataclass
class LoadConfig:
    url: str
    model: Optional[str] = None
    endpoint: str = "completions"           # completions | chat
    api_key: Optional[str] = None
    max_concurrency: Optional[int] = None
    time_scale: float = 1.0                 # arrival times are multiplied by this (0.5 = twice as fast)
    timeout: float = 600.0                  # per request, whole stream
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: Optional[int] = 0
    progress: bool = True
    progress_interval: float = 0.5
    extra_body: dict = field(default_factory=dict)
    poll_metrics: bool = True               # poll GET /metrics (Prometheus, vLLM names) once a second


@dataclass
class BenchRequest:
    req_id: str
    trace: TraceRequest
    prompt: BuiltPrompt


@dataclass
class LoadResult:
    records: list[RequestRecord]
    timeseries: dict[str, list[float]]
    errors: list[dict]
    wall_s: float
    model: str
    server_timeseries: dict[str, list[float]] = field(default_factory=dict)
    server_metrics: dict[str, Any] = field(default_factory=dict)


def base_url(url: str) -> str:
    u = url.rstrip("/")
    for suffix in ("/chat/completions", "/completions", "/v1"):
        if u.endswith(suffix):
            u = u[: -len(suffix)]
    return u.rstrip("/")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a server this process starts)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, *, cwd: str, python: Optional[str] = None, env: Optional[dict] = None,
                 log: Optional[str] = None):
    """`python -m shepherd serve --port P ARGS` from `cwd` (the checkout it imports), in a
    session of its own so stop_server takes its engine core with it; stdout and stderr to `log`
    (default: discarded). Returns (the Popen, its URL) at once: wait_healthy(url, proc) waits."""
    import subprocess
    port = free_port()
    cmd = [python or sys.executable, "-m", "shepherd", "serve", "--port", str(port), *map(str, args)]
    out = open(log, "w") if log else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True, stdout=out,
                                stderr=subprocess.STDOUT if log else None)
    finally:
        if log:
            out.close()     # the child holds its own copy
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc) -> None:
    """SIGTERM the process group of a server this process started (start_new_session=True),
    SIGKILL after 30 s; returns once it has exited."""
    import os
    import signal
    import subprocess
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def exit_on_sigterm() -> None:
    """SIGTERM (`timeout`, a CI job's cancel, kill) ends this process as Ctrl-C would: through
    its `finally` blocks. Python's default SIGTERM action skips them, and a server started with
    start_new_session=True is not in our process group, so it was left serving (one sat on its
    port for an hour after a benchmark was cut off by `timeout`)."""
    import signal
    import sys
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def wait_healthy(url: str, proc=None, timeout: float = 600.0, what: str = "the server") -> None:
    """Poll GET url/health until it answers 200; raise if `proc` (a Popen) exits first or
    `timeout` seconds pass, so a server that dies at start-up fails fast with its exit code."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(base_url(url) + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} at {url} not healthy after {timeout:.0f} s")
        time.sleep(0.5)


def headers(api_key: Optional[str]) -> dict:
    return auth_headers(api_key)


async def discover_model(url: str, api_key: Optional[str] = None, timeout: float = 30.0) -> str:
    async with httpx.AsyncClient(timeout=timeout) as c:
        r = await c.get(base_url(url) + "/v1/models", headers=headers(api_key))
        r.raise_for_status()
        data = r.json().get("data") or []
        if not data:
            raise RuntimeError(f"{url}/v1/models lists no model")
        return data[0]["id"]


def request_body(cfg: LoadConfig, br: BenchRequest, model: str) -> dict:
    tr = br.trace
    body: dict[str, Any] = {
        "model": tr.adapter or model,          # a LoRA adapter by name (bench --adapters), else the model
        "max_tokens": int(tr.output_tokens),
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": cfg.temperature,
        "user": tr.client,
    }
    if cfg.seed is not None:
        body["seed"] = cfg.seed
    if cfg.ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = int(tr.output_tokens)
    if cfg.endpoint == "chat":
        p = br.prompt
        if p.prefix and len(p.prefix) < len(p.text):
            body["messages"] = [
                {"role": "system", "content": p.prefix.lstrip()},
                {"role": "user", "content": p.text[len(p.prefix):].lstrip()},
            ]
        else:
            body["messages"] = [{"role": "user", "content": p.text.lstrip()}]
    else:
        body["prompt"] = br.prompt.text
    body.update(cfg.extra_body)
    return body


class _Progress:
    def __init__(self, total: int, enabled: bool, interval: float):
        self.total, self.enabled, self.interval = total, enabled, interval
        self.done = self.failed = self.in_flight = self.sent = 0
        self.tokens = 0
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._last_line = 0.0
        self._hist: list[tuple[float, int]] = []
        self.series: dict[str, list[float]] = {"t": [], "in_flight": [], "completed": [],
                                               "failed": [], "output_tokens": [], "output_tok_s": []}

    def sample(self, final: bool = False) -> None:
        now = time.perf_counter() - self.t0
        self._hist.append((now, self.tokens))
        while len(self._hist) > 2 and self._hist[0][0] < now - 5.0:
            self._hist.pop(0)
        t_old, k_old = self._hist[0]
        rate = (self.tokens - k_old) / (now - t_old) if now > t_old else 0.0
        s = self.series
        s["t"].append(round(now, 4))
        s["in_flight"].append(self.in_flight)
        s["completed"].append(self.done)
        s["failed"].append(self.failed)
        s["output_tokens"].append(self.tokens)
        s["output_tok_s"].append(round(rate, 3))
        if not self.enabled:
            return
        if not (self.tty or final or now - self._last_line >= 5.0):
            return
        self._last_line = now
        width = 24
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        avg = self.tokens / now if now > 0 else 0.0
        line = (f"[{bar}] {self.done}/{self.total} done, {self.in_flight} in flight, "
                f"{self.failed} failed | out {rate:7.1f} tok/s (5s), {avg:7.1f} avg | {now:6.1f}s")
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if final else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, (asyncio.TimeoutError, httpx.TimeoutException)):
        return "timeout"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError,
                        httpx.ConnectError, httpx.CloseError, ConnectionError)):
        return "disconnect"
    return "error"


def _apply_usage(rec: RequestRecord, chunks: int, usage: Optional[dict], prog: _Progress) -> None:
    """Token counts from the server's usage block when there is one (a chunk can carry
    several tokens), else the streamed chunks."""
    if usage:
        ct = usage.get("completion_tokens")
        if isinstance(ct, int):
            extra = ct - chunks
            rec.output_tokens = ct
            if extra > 0:
                prog.tokens += extra
        pt = usage.get("prompt_tokens")
        if isinstance(pt, int) and pt > 0:
            rec.prompt_tokens = pt
        det = usage.get("prompt_tokens_details") or {}
        if isinstance(det.get("cached_tokens"), int):
            rec.cached_tokens = det["cached_tokens"]
    if not rec.output_tokens:
        rec.output_tokens = chunks
    if rec.ok and rec.first_token is None and rec.output_tokens > 0:
        rec.first_token = rec.finish  # tokens reported but none streamed: count at the end


async def _one(client: httpx.AsyncClient, cfg: LoadConfig, model: str, br: BenchRequest,
               t0: float, scheduled: float, prog: _Progress, errors: list[dict]) -> RequestRecord:
    now = lambda: time.perf_counter() - t0  # noqa: E731
    sent = now()
    rec = RequestRecord(req_id=br.req_id, client=br.trace.client, arrival=sent,
                        prompt_tokens=br.prompt.tokens)
    if sent - scheduled > 1e-3:
        rec.intervals.append(("queued", scheduled, sent))
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    body = request_body(cfg, br, model)
    prog.in_flight += 1
    prog.sent += 1
    state = {"chunks": 0, "usage": None, "finished": False}

    async def stream() -> None:
        async with client.stream("POST", path, json=body, headers=headers(cfg.api_key)) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")[:500]
                rec.ok, rec.error_kind = False, f"http_{resp.status_code}"
                errors.append({"req_id": br.req_id, "kind": rec.error_kind, "message": text})
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    state["finished"] = True
                    return
                try:
                    ev = json.loads(data)
                except json.JSONDecodeError:
                    continue
                if ev.get("error"):
                    rec.ok, rec.error_kind = False, "error"
                    errors.append({"req_id": br.req_id, "kind": "error",
                                   "message": json.dumps(ev["error"])[:500]})
                    return
                if ev.get("usage"):
                    state["usage"] = ev["usage"]
                for ch in ev.get("choices") or []:
                    if cfg.endpoint == "chat":
                        piece = (ch.get("delta") or {}).get("content")
                    else:
                        piece = ch.get("text")
                    if piece:
                        t = now()
                        if rec.first_token is None:
                            rec.first_token = t
                        rec.token_times.append(t)
                        state["chunks"] += 1
                        prog.tokens += 1
                    if ch.get("finish_reason"):
                        state["finished"] = True
            if rec.ok and not state["finished"]:
                rec.ok, rec.error_kind = False, "disconnect"
                errors.append({"req_id": br.req_id, "kind": "disconnect",
                               "message": "stream ended without a finish_reason or [DONE]"})

    try:
        await asyncio.wait_for(stream(), cfg.timeout)
    except asyncio.CancelledError:
        prog.in_flight -= 1
        raise
    except Exception as e:  # noqa: BLE001 - every failure is counted, none hidden
        rec.ok, rec.error_kind = False, _error_kind(e)
        errors.append({"req_id": br.req_id, "kind": rec.error_kind,
                       "message": f"{type(e).__name__}: {e}"[:500]})
    rec.finish = now()
    _apply_usage(rec, state["chunks"], state["usage"], prog)
    prog.in_flight -= 1
    if rec.ok:
        prog.done += 1
    else:
        prog.failed += 1
        prog.done += 1
    return rec


async def run_load(requests: Sequence[BenchRequest], cfg: LoadConfig) -> LoadResult:
    """Send every request at its arrival time; return one RequestRecord each, in input order."""
    model = cfg.model or await discover_model(cfg.url, cfg.api_key)
    n = len(requests)
    pool = cfg.max_concurrency or max(1, min(n, 4096))
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    timeout = httpx.Timeout(cfg.timeout, connect=min(30.0, cfg.timeout))
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    prog = _Progress(n, cfg.progress, cfg.progress_interval)
    errors: list[dict] = []
    scale = cfg.time_scale if cfg.time_scale and cfg.time_scale > 0 else 1.0
    poller = MetricsPoller(cfg.api_key) if cfg.poll_metrics else None
    order = sorted(range(n), key=lambda i: requests[i].trace.arrival)
    start_arrival = requests[order[0]].trace.arrival if n else 0.0
    results: list[Optional[RequestRecord]] = [None] * n

    # both clients are made before the clock starts: making one (its SSL context) takes a while
    mclient = httpx.AsyncClient(base_url=base_url(cfg.url)) if poller else None
    async with httpx.AsyncClient(base_url=base_url(cfg.url), limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()
        prog.t0 = t0
        stop = asyncio.Event()

        async def ticker():
            while not stop.is_set():
                prog.sample()
                try:
                    await asyncio.wait_for(stop.wait(), cfg.progress_interval)
                except asyncio.TimeoutError:
                    pass

        async def launch(i: int, scheduled: float):
            br = requests[i]
            if sem is None:
                results[i] = await _one(client, cfg, model, br, t0, scheduled, prog, errors)
                return
            async with sem:
                results[i] = await _one(client, cfg, model, br, t0, scheduled, prog, errors)

        tick = asyncio.create_task(ticker())
        poll = asyncio.create_task(poller.run(mclient, t0, stop)) if poller else None
        tasks = []
        for i in order:
            scheduled = (requests[i].trace.arrival - start_arrival) * scale
            delay = scheduled - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(launch(i, scheduled)))
        if tasks:
            await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        stop.set()
        await tick
        if poll:
            await poll
        prog.sample(final=True)
    res = LoadResult([r for r in results if r is not None], prog.series, errors, wall, model)
    if poller:
        res.server_timeseries, res.server_metrics = poller.series, poller.totals()
    return res


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Open-loop arrivals: gamma inter-arrival gaps with mean 1/rate and shape
    `burstiness` (1 = Poisson, <1 burstier, >1 smoother); rate inf = all at 0. A rate of 0, below
    0 or nan is refused: read as "all at once", a typo became a burst."""
    if math.isinf(rate) and rate > 0:
        return [0.0] * n
    if not rate > 0:
        raise ValueError(f"--rate must be > 0 requests per second, got {rate:g} (inf, the default, sends "
                         "every request at once)")
    t, out = 0.0, []
    shape = burstiness if burstiness and burstiness > 0 else 1.0
    scale = 1.0 / (rate * shape)
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(shape, scale)
    return out


def synthetic(num_requests: int, rate: float = math.inf, burstiness: float = 1.0,
              input_len: str = "256", output_len: str = "128", shared_prefix: int = 0,
              clients: int = 1, seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    din, dout = LengthDist(input_len).sampler(rng, "input"), LengthDist(output_len).sampler(rng, "output")
    times = arrival_times(num_requests, rate, burstiness, rng)
    out = []
    for i, t in enumerate(times):
        out.append(TraceRequest(
            arrival=t, prompt_tokens=shared_prefix + din(), output_tokens=dout(),
            client=f"client-{i % clients}" if clients > 1 else "default",
            prefix_group="shared" if shared_prefix > 0 else None))
    return out


def reshape(trace: list[TraceRequest], *, rate: Optional[float] = None, burstiness: float = 1.0,
            length_scale: float = 1.0, max_input: Optional[int] = None,
            max_output: Optional[int] = None, seed: int = 0) -> list[TraceRequest]:
    """Fit a real trace to this machine: keep its order and lengths (times
    `length_scale`, clipped), and, with `rate`, redraw its arrivals open-loop."""
    rng = random.Random(seed)
    times = arrival_times(len(trace), rate, burstiness, rng) if rate is not None else None
    out = []
    for i, tr in enumerate(sorted(trace, key=lambda r: r.arrival)):
        p = max(1, int(round(tr.prompt_tokens * length_scale)))
        o = max(1, int(round(tr.output_tokens * length_scale)))
        if max_input:
            p = min(p, max_input)
        if max_output:
            o = min(o, max_output)
        # every other field (prefix group and length, session, turn, ...) kept as the trace has it
        out.append(dataclasses.replace(tr, arrival=times[i] if times else tr.arrival, prompt_tokens=p,
                                       output_tokens=o,
                                       prefix_tokens=min(p, int(round(tr.prefix_tokens * length_scale)))))
    return out
