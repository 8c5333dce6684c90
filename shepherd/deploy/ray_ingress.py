"""The OpenAI ingress of shepherd on Ray Serve: an ASGI app in its own deployment.

Ray's HTTP proxy hands each request to an ingress replica; the ingress reads
it, builds the `RouteRequest` the gateway builds (gateway/intake.py), and
calls the replica deployment through a handle whose request router is
shepherd's policy (ray_router.py). The replica answers with shepherd's own
app (ray_replica.py); the ingress relays the ASGI messages as they come.

Routes: POST /v1/completions, /v1/chat/completions and /v1/responses are
routed by the policy; /metrics is the ingress's own registry (its requests, retries and
errors, each replica's in-flight, running, waiting, KV use and prefix-cache
counters, the policy's decisions); every other path (/health, /v1/models,
/tokenize, ...) goes to any replica and gets that replica's answer (/health
is 503 with Retry-After when no replica answers within `health_timeout`).

The gateway's rules, with a handle in place of HTTP (docs/ROUTING.md):
- the API key is checked before the body is read (401, OpenAI body), and the
  body is read and parsed by the same door as `shepherd serve`'s
  (server/guard.py: 413 over the cap, 408 when it is slower than
  `body_timeout`, 400 for malformed, too deep or lone-surrogate JSON); the
  cap is `max_body_bytes`, lowered to the replicas' own once a replica's
  /health answer names it, so a body every replica would refuse is refused
  from its Content-Length instead of being read and parsed here first;
- a failure before the first byte went to the client (the replica died,
  timed out, refused with 429/503) is retried on another replica, at most
  `retries` times with exponential backoff; the client then gets the last
  429/503 (with its Retry-After) or a 503 with Retry-After;
- response headers go out only with the first body chunk, so "nothing sent
  yet" is exact; after it, a failure ends an SSE stream with one
  `data: {"error": ...}` event (never a retry: the client has tokens);
- Ray's own queue in front of the replicas is bounded (`max_queued_requests`):
  past it the answer is 429 with Retry-After at once;
- every wait on a replica is bounded by `read_timeout`; a client that goes
  away cancels the replica's call, whose app then aborts the engine request.

With `tokenizer` set (the policy reads KV events: precise-prefix) the ingress
gives each routed request its prompt token ids, tokenized here as the
replicas tokenize it (the gateway's PromptTokens with a local tokenizer); a
prompt that does not tokenize is routed without them, never refused.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shepherd.deploy.ray_replica import REPLICA_HEADER
from shepherd.deploy.ray_call import HttpCall, live_router
from shepherd.gateway.intake import (read_routed, send_json,
                                     send_metrics, split_headers, usage_tokens, watch_disconnect)
from shepherd.gateway.kv_routing import PromptTokens
from shepherd.routing import RouteRequest
from shepherd.server.guard import (BODY_CAP_HEADER, DEFAULT_BODY_TIMEOUT, Parser, Refusal, body_cap_of, error_body,
                                   front_cap, json_500_on_error, key_error, read_body, settle_heap)

log = logging.getLogger("shepherd.deploy")

ROUTED_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat",   # path -> route_request_from's kind
                "/v1/responses": "responses"}
OPEN_PATHS = ("/health", "/metrics")        # no API key, as in `shepherd serve`


@dataclass
class IngressConfig:
    deployment: str = "ShepherdReplica"      # the replica deployment (whose router this process holds)
    api_key: Optional[str] = None
    max_body_bytes: int = 16 << 20
    body_timeout: float = DEFAULT_BODY_TIMEOUT   # 408 when a body takes longer to arrive
    retries: int = 2                         # extra attempts on other replicas, before the first byte only
    retry_backoff: float = 0.02              # seconds before the first retry; doubles each time
    retry_backoff_max: float = 0.5
    read_timeout: float = 120.0              # longest wait for a replica's next message
    health_timeout: float = 5.0
    retry_after_s: int = 1                   # Retry-After of the ingress's own 429 / 503
    tokenizer: Optional[str] = None          # prompt token ids for the policy: the replicas' model path, or
                                             # "default" (the default model); None: the policy does not read them


@dataclass
class _Outcome:
    done: bool                               # the client got a complete answer (or an in-band error)
    why: str = ""
    replica: Optional[str] = None            # who answered, when known
    answer: Optional[tuple] = None           # (status, headers, body) of a retryable 429/503
    final: bool = False                      # do not retry (Ray's own queue is full)


class IngressApp:
    """The ASGI app (see the module doc). `replicas` is a DeploymentHandle to ShepherdReplica."""

    def __init__(self, replicas: Any, cfg: Optional[IngressConfig] = None,
                 registry: Optional[CollectorRegistry] = None) -> None:
        self.handle = replicas.options(stream=True, method_name="serve_http")
        self.cfg = cfg or IngressConfig()
        self.metrics = IngressMetrics(self, registry)
        self.parser = Parser()
        self.tokens = PromptTokens(self.cfg.tokenizer) if self.cfg.tokenizer else None
        self.in_flight = 0
        # the replicas' body cap, from their /health answers: every replica of the deployment runs
        # the same flags, so one answer stands for all (None: none seen yet; the ingress's own cap)
        self.replica_cap: Optional[int] = None
        self._warmup: Optional[asyncio.Future] = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                kind = msg["type"].rsplit(".", 1)[-1]          # startup | shutdown
                if kind == "startup":
                    # the handle makes its router on its first call: make it now, so that /metrics
                    # shows the replicas before any traffic; the answer names the replicas' body cap
                    self._warmup = asyncio.ensure_future(self._health_probe())
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] == "http":
            await json_500_on_error(self._http, scope, receive, send, "ingress", log)

    async def _http(self, scope, receive, send) -> None:
        path, method = scope["path"], scope["method"]
        root = scope.get("root_path", "").rstrip("/")       # the application's route prefix
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if path == "/metrics" and method == "GET":
            return await send_metrics(send, self.metrics.registry)
        refused = key_error(scope, self.cfg.api_key) if path not in OPEN_PATHS else None
        if refused is not None:
            self.metrics.errors.labels("unauthorized").inc()
            return await send_json(send, refused.status, refused.payload())
        cfg = self.cfg
        if self.replica_cap is None and self._warmup is not None and self._warmup.done():
            # the probe at startup got no answer (no replica yet): ask again, one probe at a time
            self._warmup = asyncio.ensure_future(self._health_probe())
        cap, flag = front_cap(cfg.max_body_bytes, "ingress body cap", [self.replica_cap])
        try:
            headers, xh = split_headers(scope["headers"])
            body, route = b"", None
            if method not in ("GET", "HEAD"):
                if path in ROUTED_PATHS and method == "POST":
                    got = await read_routed(receive, scope, self.parser, cap, cfg.body_timeout, flag,
                                            ROUTED_PATHS[path], xh, self._fill_tokens if self.tokens else None)
                    if got is not None:
                        body, route, _ = got
                else:
                    got = body = await read_body(receive, scope, cap, cfg.body_timeout, flag)
                if got is None:
                    self.metrics.errors.labels("client_abort").inc()
                    return
        except Refusal as r:
            self.metrics.errors.labels("bad_request").inc()
            return await send_json(send, r.status, r.payload())
        call = HttpCall(method=method, path=path, query_string=scope.get("query_string", b""),
                        headers=headers, body=body, route=route)
        timeout = self.cfg.health_timeout if path == "/health" else self.cfg.read_timeout
        await self._guarded(receive, send, call, timeout)

    async def _fill_tokens(self, route: RouteRequest, payload: dict, chat: bool) -> None:
        if route.token_ids is None:
            route.token_ids = await self.tokens.ids(payload, chat, (), None)

    async def _health_probe(self) -> None:
        gen = self.handle.remote(HttpCall("GET", "/health"))
        try:
            self._learn_cap(await asyncio.wait_for(gen.__anext__(), self.cfg.read_timeout))
        except Exception:  # noqa: BLE001 - a replica not up yet; traffic will make the router anyway
            pass
        finally:
            _cancel(gen)

    def _learn_cap(self, batch: list) -> None:
        """Keep the body cap a replica's /health answer names (its first ASGI messages)."""
        for msg in batch:
            if msg["type"] == "http.response.start":
                cap = body_cap_of(_header(list(msg.get("headers") or []), BODY_CAP_HEADER.encode()))
                if cap is not None:
                    self.replica_cap = cap

    async def _guarded(self, receive, send, call: HttpCall, timeout: float) -> None:
        """Dispatch; a client that leaves cancels it (and so the replica's call)."""
        self.in_flight += 1
        try:
            if not await watch_disconnect(receive, send, lambda s: self._dispatch(s, call, timeout)):
                self.metrics.errors.labels("client_abort").inc()
        finally:
            self.in_flight -= 1

    async def _dispatch(self, send, base: HttpCall, timeout: float) -> None:
        cfg, m = self.cfg, self.metrics
        tried: set = set()
        last: Optional[_Outcome] = None
        for attempt in range(cfg.retries + 1):
            call = dataclasses.replace(base, exclude=frozenset(tried), call_id=uuid.uuid4().hex, decided=None,
                                       routed_to=None, ended=False)
            out = await self._attempt(send, call, timeout)
            if out.done:
                return
            if out.replica:
                tried.add(out.replica)
            if last is None or last.answer is None or out.answer is not None:
                last = out          # the last 429/503 answer wins over a later failure without one
            if out.final or attempt == cfg.retries:
                break
            m.retries.labels(out.why.split(":")[0]).inc()
            await asyncio.sleep(min(cfg.retry_backoff * (2 ** attempt), cfg.retry_backoff_max))
        if last is not None and last.answer is not None:
            status, headers, data = last.answer
            m.requests.labels(str(status)).inc()
            await send({"type": "http.response.start", "status": status, "headers": headers})
            return await send({"type": "http.response.body", "body": data})
        m.errors.labels("no_replica").inc()
        m.requests.labels("503").inc()
        why = last.why if last is not None else "no replica"
        await send_json(send, 503, error_body(f"no replica answered: {why}", "service_unavailable", code=503),
                        [(b"retry-after", str(self.cfg.retry_after_s).encode())])

    async def _attempt(self, send, call: HttpCall, timeout: float) -> _Outcome:
        """One try on one replica; see the module doc for what may be retried."""
        from ray.serve.exceptions import BackPressureError
        gen = None
        tokens, out = 0, _Outcome(done=False)
        try:
            try:
                gen = self.handle.remote(call)        # Ray may refuse it here already (its queue is full)
                batch = await asyncio.wait_for(gen.__anext__(), timeout)
            except BackPressureError as e:
                self.metrics.errors.labels("backpressure").inc()
                return _Outcome(False, f"overloaded: {e}", final=True, answer=self._busy_answer(str(e)))
            except (StopAsyncIteration, asyncio.TimeoutError, Exception) as e:  # noqa: BLE001 - any replica failure
                return _Outcome(False, f"{type(e).__name__}: {e}"[:300])
            start, pending = batch[0], list(batch[1:])
            # Ray's proxy puts X-Request-Id on every answer it relays (the id it gave the request,
            # which the replica's answer id is built on): the replica's own copy would be a second
            headers = [h for h in start.get("headers") or () if h[0].lower() != b"x-request-id"]
            status, start = start["status"], {**start, "headers": headers}
            if call.path == "/health":
                self._learn_cap(batch)
            out.replica = _header(headers, REPLICA_HEADER)
            if status in (429, 503):     # "busy, try elsewhere"; not a failure of the replica
                data = await self._rest_of_body(gen, pending, timeout)
                if data is None:
                    return _Outcome(False, f"replica failed after a {status}", out.replica)
                return _Outcome(False, f"overloaded: HTTP {status}", out.replica, (status, headers, data))
            # hold the headers until the first body chunk: nothing reaches the client before it
            while not any(msg["type"] == "http.response.body" for msg in pending):
                try:
                    pending += await asyncio.wait_for(gen.__anext__(), timeout)
                except (StopAsyncIteration, asyncio.TimeoutError, Exception) as e:  # noqa: BLE001
                    return _Outcome(False, f"{type(e).__name__} before the first byte: {e}"[:300], out.replica)
            await send(start)
            sse = (_header(headers, b"content-type") or "").startswith("text/event-stream")
            tokens = await self._relay(send, gen, pending, timeout, sse, call)
            self.metrics.requests.labels(str(status)).inc()
            return _Outcome(True)
        finally:
            if gen is not None:
                _cancel(gen)
            router = live_router(self.cfg.deployment)
            if router is not None:
                router.finished(call, tokens)

    async def _relay(self, send, gen, pending: list, timeout: float, sse: bool, call: HttpCall) -> int:
        """Send what is pending and the rest of the stream; returns output tokens (for vtc-basic)."""
        events, data = 0, b""
        while True:
            for msg in pending:
                if msg["type"] != "http.response.body":
                    continue
                chunk = msg.get("body", b"")
                events += chunk.count(b"data: ") if sse else 0
                data = data + chunk if not sse and len(data) < 1 << 20 else data
                await send(msg)
                if not msg.get("more_body", False):
                    return max(0, events - 1) if sse else usage_tokens(data)
            try:
                pending = await asyncio.wait_for(gen.__anext__(), timeout)
            except StopAsyncIteration:
                pending = [{"type": "http.response.body", "body": b"", "more_body": False}]
            except (asyncio.TimeoutError, Exception) as e:  # noqa: BLE001 - the replica failed mid-answer
                self.metrics.errors.labels("stream_error").inc()
                log.warning("replica failed mid-answer (%s): %s", call.path, e)
                tail = b""
                if sse:
                    ev = error_body(f"replica failed mid-stream: {type(e).__name__}", "upstream_error", code=502)
                    tail = b"data: " + json.dumps(ev).encode() + b"\n\n"
                pending = [{"type": "http.response.body", "body": tail, "more_body": False}]

    async def _rest_of_body(self, gen, pending: list, timeout: float) -> Optional[bytes]:
        data = b"".join(m.get("body", b"") for m in pending if m["type"] == "http.response.body")
        if any(m["type"] == "http.response.body" and not m.get("more_body", False) for m in pending):
            return data
        try:
            while True:
                for m in await asyncio.wait_for(gen.__anext__(), timeout):
                    data += m.get("body", b"")
                    if not m.get("more_body", False):
                        return data
        except StopAsyncIteration:
            return data
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001
            return None

    def _busy_answer(self, why: str) -> tuple:
        data = json.dumps(error_body(f"server busy: {why}", "rate_limit_exceeded", code=429)).encode()
        return (429, [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                      (b"retry-after", str(self.cfg.retry_after_s).encode())], data)


def _cancel(gen) -> None:
    """Cancel a handle call whatever state it is in (a no-op once it finished). Ray's cancel
    re-raises the call's own routing error (e.g. BackPressureError), handled by then."""
    try:
        gen.cancel()
    except Exception:  # noqa: BLE001
        pass


def _header(headers: list, name: bytes) -> Optional[str]:
    for k, v in headers:
        if k.lower() == name:
            return v.decode("latin-1")
    return None


class IngressMetrics:
    """The ingress's Prometheus registry; per-replica gauges are read from the router at scrape time."""

    def __init__(self, app: IngressApp, registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter("shepherd_ray_requests", "Answers relayed, by status", ["status"], registry=r)
        self.retries = Counter("shepherd_ray_retries", "Requests retried on another replica, by cause",
                               ["reason"], registry=r)
        self.errors = Counter("shepherd_ray_errors", "Requests that did not end normally, by kind (client_abort, "
                              "stream_error, no_replica, backpressure, bad_request, unauthorized)",
                              ["kind"], registry=r)
        in_flight = Gauge("shepherd_ray_in_flight", "Requests in flight through this ingress replica",
                          registry=r)
        in_flight.set_function(lambda: app.in_flight)
        r.register(_RouterCollector(app.cfg.deployment))


class _RouterCollector:
    def __init__(self, deployment: str) -> None:
        self.deployment = deployment

    def describe(self):
        return []

    def collect(self):
        router = live_router(self.deployment)
        if router is None:
            return []
        reps, reasons, kv = router.snapshot()
        fams = {name: GaugeMetricFamily(f"shepherd_ray_replica_{name}", doc, labels=["replica"])
                for name, doc in (("in_flight", "Requests this ingress has on the replica"),
                                  ("healthy", "1 while the replica's engine is alive"),
                                  ("running", "Running requests (routing stats)"),
                                  ("waiting", "Waiting requests (routing stats)"),
                                  ("kv_usage", "KV-cache use, 0..1 (routing stats)"),
                                  ("prefix_query_tokens", "Prompt tokens looked up in its prefix cache"),
                                  ("prefix_hit_tokens", "Of those, served from its prefix cache"))}
        info = GaugeMetricFamily("shepherd_ray_replica_info", "1 per replica; node: its Ray node id; url: its own "
                                 "HTTP server (--replica-http), else empty", labels=["replica", "node", "url"])
        for st, stats in reps:
            info.add_metric([st.name, str(stats.get("node") or ""), str(stats.get("url") or "")], 1.0)
            values = {"in_flight": st.in_flight, "healthy": 1.0 if st.healthy else 0.0, "running": st.running,
                      "waiting": st.waiting, "kv_usage": st.kv_usage,
                      "prefix_query_tokens": stats.get("prefix_query_tokens", 0),
                      "prefix_hit_tokens": stats.get("prefix_hit_tokens", 0)}
            for name, v in values.items():
                fams[name].add_metric([st.name], float(v))
        usable = GaugeMetricFamily("shepherd_ray_replica_kv_events_usable", "1 while the replica's KV-event "
                                   "index is used for routing (precise-prefix)", labels=["replica", "state"])
        blocks = GaugeMetricFamily("shepherd_ray_replica_kv_index_blocks", "Blocks the router's index holds for "
                                   "the replica, from its KV events", labels=["replica"])
        names = {st.key: st.name for st, _ in reps}
        for key, got in kv.items():
            name = names.get(key, key)
            usable.add_metric([name, got["state"]], 1.0 if got["state"] in ("complete", "partial") else 0.0)
            blocks.add_metric([name], float(got["blocks"]))
        decisions = CounterMetricFamily("shepherd_ray_routing_decisions", "Routing decisions by policy and reason",
                                        labels=["policy", "reason"])
        for reason, n in reasons.items():
            decisions.add_metric([router.policy_name, reason or "-"], n)
        return list(fams.values()) + [info, decisions] + ([usable, blocks] if kv else [])


class ShepherdIngress:
    """The Ray Serve deployment class of the ingress (ray_serve.py applies `serve.ingress`)."""

    def __init__(self, replicas: Any, cfg: Optional[IngressConfig] = None) -> None:
        self._app = IngressApp(replicas, cfg)
        settle_heap()       # its own actor process: as `shepherd serve` and the gateway do

    def __serve_build_asgi_app__(self) -> IngressApp:
        return self._app
