"""The gateway: an OpenAI-compatible HTTP proxy across replicas.

    gw = Gateway(BackendPool(["http://127.0.0.1:8001", "http://127.0.0.1:8002"]),
                 make_policy("prefix-aware"))
    uvicorn.run(gw, ...)            # a plain ASGI app

Routes
  POST /v1/completions, /v1/chat/completions   routed by the policy, passed through;
                                                SSE relayed chunk by chunk, byte for byte
  GET  /v1/models                               the union of the healthy backends' models
  GET  /health                                  200 while at least one backend is healthy, else 503
  GET  /metrics                                 the gateway's own Prometheus registry
  GET  /admin/backends                          backends with their state
  POST /admin/backends   {"url": URL}           add a backend
  DELETE /admin/backends {"url": URL} or ?url=  remove a backend

Request life (the invariants tests/test_gateway.py checks):
- in-flight of the chosen backend is +1 when a request is dispatched and -1
  in a `finally` when that attempt ends, whatever way: success, backend
  error, retry, client abort (a watcher on http.disconnect cancels the
  handler), timeout.
- A backend failure before the first byte reached the client (connect
  error, timeout, a stream that dies before its first chunk) or a 429/503
  overload answer is retried on another replica, at most `retries` times,
  with exponential backoff. Response headers go to the client only together
  with the first body chunk, so "nothing sent yet" is exact.
- After the first byte, a failure ends the stream with one SSE error event
  (`data: {"error": {...}}`); nothing hangs: connect/read/write timeouts
  bound every wait on a backend.
- Only connect errors, timeouts, broken streams and /health count toward
  ejecting a backend. Any HTTP answer (4xx, or a 5xx about one request's
  content) is passed through once and counts as a success: three hostile
  requests must not eject every replica.
- Bad input to the gateway itself (not JSON, not an object, no prompt /
  messages, body too large) gets a 400 with an OpenAI-style error body.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Optional
from urllib.parse import parse_qs

import httpx

from shepherd.gateway.backends import Backend, BackendPool, normalize_url
from shepherd.gateway.gw_metrics import GatewayMetrics
from shepherd.gateway.http1 import Http1Pool, Response, UpstreamError
from shepherd.gateway.intake import (BadRequest, Disconnected, error_body, json_500_on_error, json_object, read_body,
                                     route_request_from, send_json, send_metrics, split_headers, usage_tokens,
                                     watch_disconnect)
from shepherd.gateway.kv_routing import KVRouting
from shepherd.routing import NoReplicaAvailable, RouteRequest, RoutingPolicy

log = logging.getLogger("shepherd.gateway")

PROXY_PATHS = ("/v1/completions", "/v1/chat/completions")
# response headers never copied back to the client
_DROP_RESP = {"content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
              "upgrade", "date", "server"}


@dataclass
class GatewayConfig:
    retries: int = 2                 # extra attempts on other replicas, before the first byte only
    retry_backoff: float = 0.02      # seconds before the first retry; doubles each time
    retry_backoff_max: float = 0.5
    connect_timeout: float = 2.0
    read_timeout: float = 120.0      # longest silence from a backend (to headers, first and next chunks)
    write_timeout: float = 30.0
    pool_timeout: float = 30.0
    max_keepalive: int = 512         # idle connections kept per backend
    max_body_bytes: int = 32 << 20
    models_timeout: float = 5.0
    backend_header: bool = True      # add x-shepherd-backend to responses


class Gateway:
    """ASGI application. Create it, then serve it with uvicorn (lifespan on),
    or call `await gw.startup()` / `await gw.shutdown()` yourself."""

    def __init__(self, pool: BackendPool, policy: RoutingPolicy, config: Optional[GatewayConfig] = None,
                 policy_name: Optional[str] = None, registry: Optional[CollectorRegistry] = None,
                 kv: Optional[KVRouting] = None) -> None:
        self.pool = pool
        self.policy = policy
        self.policy_name = policy_name or policy.name
        self.cfg = config or GatewayConfig()
        self.metrics = GatewayMetrics(self, registry)
        self.kv = kv                  # KV-event streams and prompt token ids (kv_routing.py), when configured
        if kv is not None:
            self.metrics.registry.register(kv)
        self.client: Optional[httpx.AsyncClient] = None      # /v1/models fan-out
        self.upstream: Optional[Http1Pool] = None            # proxied requests
        self.in_flight = 0
        self._started = False
        self._count_output = getattr(policy, "name", "") == "vtc-basic" or getattr(
            getattr(policy, "fallback", None), "name", "") == "vtc-basic"
        pool.on_change = self._on_pool_change
        pool.on_health = self._on_health

    # --- lifecycle -----------------------------------------------------------------
    async def startup(self) -> None:
        if self._started:
            return
        c = self.cfg
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=c.connect_timeout, read=c.read_timeout,
                                  write=c.write_timeout, pool=c.pool_timeout),
            trust_env=False, follow_redirects=False)
        self.upstream = Http1Pool(connect_timeout=c.connect_timeout, read_timeout=c.read_timeout,
                                  max_idle_per_host=c.max_keepalive)
        await self.pool.start()
        if self.kv is not None:
            await self.kv.start()
        self._started = True

    async def shutdown(self) -> None:
        if not self._started:
            return
        self._started = False
        await self.pool.stop()
        if self.kv is not None:
            await self.kv.stop()
        if self.client is not None:
            await self.client.aclose()
            self.client = None
        if self.upstream is not None:
            await self.upstream.aclose()
            self.upstream = None

    def _on_pool_change(self, removed_url: Optional[str]) -> None:
        if removed_url:
            self.policy.forget(removed_url)

    def _on_health(self, b: Backend) -> None:
        if not b.healthy:
            self.metrics.ejections.labels(b.url).inc()

    # --- ASGI ------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        t = scope["type"]
        if t == "http":
            await json_500_on_error(self._http, scope, receive, send, "gateway", log)
        elif t == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as e:      # pragma: no cover
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope, receive, send) -> None:
        path = scope["path"]
        method = scope["method"]
        if path in PROXY_PATHS:
            if method != "POST":
                return await send_json(send, 405, error_body(f"{method} not allowed on {path}"))
            return await self._proxy(scope, receive, send, path)
        if path == "/health" and method in ("GET", "HEAD"):
            n = self.pool.healthy_count()
            return await send_json(send, 200 if n else 503,
                                    {"status": "ok" if n else "no healthy backend", "healthy_backends": n,
                                     "backends": len(self.pool.replicas())})
        if path == "/metrics" and method == "GET":
            return await send_metrics(send, self.metrics.registry)
        if path == "/v1/models" and method == "GET":
            return await self._models(scope, send)
        if path == "/admin/backends":
            return await self._admin(scope, receive, send, method)
        return await send_json(send, 404, error_body(f"no route {method} {path}", "not_found_error"))

    # --- helpers -----------------------------------------------------------------------
    async def _models(self, scope, send) -> None:
        assert self.client is not None
        bs = [b for b in self.pool.backends() if b.healthy]
        fwd = [(k, v) for k, v in scope["headers"] if k.lower() == b"authorization"]

        async def one(b: Backend):
            try:
                r = await self.client.get(b.url + "/v1/models", headers=fwd, timeout=self.cfg.models_timeout)
                if r.status_code == 200:
                    return r.json().get("data", [])
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
            return []

        seen, data = set(), []
        for lst in await asyncio.gather(*(one(b) for b in bs)):
            for m in lst if isinstance(lst, list) else []:
                mid = m.get("id") if isinstance(m, dict) else None
                if mid is not None and mid not in seen:
                    seen.add(mid)
                    data.append(m)
        await send_json(send, 200, {"object": "list", "data": data})

    async def _admin(self, scope, receive, send, method: str) -> None:
        if method == "GET":
            return await send_json(send, 200, {"policy": self.policy_name,
                                                "backends": [b.to_dict() for b in self.pool.backends()],
                                                "kv_events": self.kv.status() if self.kv is not None else {}})
        if method not in ("POST", "DELETE"):
            return await send_json(send, 405, error_body(f"{method} not allowed on /admin/backends"))
        try:
            body = await read_body(receive, self.cfg.max_body_bytes)
        except Disconnected:
            return
        except BadRequest as e:
            return await send_json(send, e.status, error_body(e.message))
        url = None
        qs = parse_qs(scope.get("query_string", b"").decode())
        if "url" in qs:
            url = qs["url"][0]
        elif body.strip():
            try:
                obj = json.loads(body)
                url = obj.get("url") if isinstance(obj, dict) else None
            except ValueError:
                return await send_json(send, 400, error_body("body must be JSON {\"url\": ...}"))
        if not isinstance(url, str) or not url:
            return await send_json(send, 400, error_body("a backend 'url' is required", param="url"))
        try:
            url = normalize_url(url)
        except ValueError as e:
            return await send_json(send, 400, error_body(str(e), param="url"))
        if method == "POST":
            b = self.pool.add(url, source="admin")
            return await send_json(send, 200, {"added": url, "backend": b.to_dict()})
        if not self.pool.remove(url):
            return await send_json(send, 404, error_body(f"no backend {url}", "not_found_error"))
        return await send_json(send, 200, {"removed": url})

    # --- the proxy ---------------------------------------------------------------------
    async def _proxy(self, scope, receive, send, path: str) -> None:
        m = self.metrics
        try:
            body = await read_body(receive, self.cfg.max_body_bytes)
            payload = json_object(body)
            fwd, hdrs = split_headers(scope["headers"])
            rr = route_request_from(payload, path == "/v1/chat/completions", hdrs, time.monotonic())
        except Disconnected:
            m.errors.labels("client_abort").inc()
            return
        except BadRequest as e:
            m.errors.labels("bad_request").inc()
            return await send_json(send, e.status, error_body(e.message, param=e.param, code=e.status))
        if self.kv is not None:
            await self.kv.fill(rr, payload, path == "/v1/chat/completions", self.pool.replicas(), self.client)
        self.in_flight += 1
        try:
            if not await watch_disconnect(receive, send, lambda s: self._dispatch(s, path, body, fwd, rr)):
                m.errors.labels("client_abort").inc()
        finally:
            self.in_flight -= 1

    async def _dispatch(self, send, path, body, fwd, rr: RouteRequest) -> None:
        m, cfg, pool = self.metrics, self.cfg, self.pool
        tried: set = set()
        last_answer = None            # (status, headers, body) of the last retryable HTTP answer
        last_error = "no backend"
        for attempt in range(cfg.retries + 1):
            cands = [r for r in pool.replicas() if r.healthy and r.url not in tried]
            if not cands:
                break
            try:
                replica = self.policy.choose(rr, cands)
            except NoReplicaAvailable:
                break
            m.decisions.labels(self.policy_name, self.policy.last_reason or "-").inc()
            backend = pool.get(replica.url)
            if backend is None:        # removed between choose and here (cannot happen on one loop)
                tried.add(replica.url)
                continue
            done, why, answer = await self._attempt(send, path, body, fwd, rr, backend)
            if done:
                return
            tried.add(backend.url)
            last_error = why
            if answer is not None:
                last_answer = answer
            if attempt < cfg.retries and any(r.healthy and r.url not in tried for r in pool.replicas()):
                m.retries.labels(why.split(":")[0]).inc()
                await asyncio.sleep(min(cfg.retry_backoff * (2 ** attempt), cfg.retry_backoff_max))
        # nothing reached the client: answer for the gateway
        if last_answer is not None:
            status, headers, data = last_answer
            m.errors.labels("upstream").inc()
            await send({"type": "http.response.start", "status": status,
                        "headers": headers + [(b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data})
            return
        if not tried:
            m.errors.labels("no_backend").inc()
            return await send_json(send, 503, error_body("no healthy backend", "service_unavailable", 503),
                                    [(b"retry-after", b"1")])
        m.errors.labels("upstream").inc()
        await send_json(send, 502, error_body(f"all backends failed: {last_error}", "upstream_error", 502))

    def _resp_headers(self, resp: Response, backend: Backend) -> list:
        out = [(k, v) for k, v in resp.headers_raw if k.decode("latin-1").lower() not in _DROP_RESP]
        if self.cfg.backend_header:
            out.append((b"x-shepherd-backend", backend.url.encode()))
        return out

    async def _attempt(self, send, path, body, fwd, rr, backend: Backend):
        """One try on one backend. Returns (done, why, retryable_answer):
        done=True when the client got a complete answer (or an error event
        after the first byte); else nothing was sent and the caller may retry."""
        assert self.upstream is not None
        m, pool, state = self.metrics, self.pool, backend.state
        state.in_flight += 1
        backend.total_requests += 1
        self.policy.on_dispatch(rr, state)
        out_tokens = 0
        status_label = "error"
        try:
            try:
                resp = await self.upstream.request("POST", backend.url, path, fwd, body)
            except UpstreamError as e:
                pool.record_failure(backend, f"{e.kind}: {e}")
                return False, f"{e.kind}: {e} ({backend.url})", None
            try:
                status = resp.status_code
                status_label = str(status)
                if status in (429, 503):
                    # "busy, try elsewhere": another replica may have room; not a failure
                    try:
                        data = await resp.read()
                    except UpstreamError:
                        data = json.dumps(error_body(f"backend answered {status}", "upstream_error",
                                                     status)).encode()
                    why = f"overloaded: HTTP {status} from {backend.url}"
                    return False, why, (status, self._resp_headers(resp, backend), data)
                # Any other answer, 4xx or 5xx, is about this request's content: passed through,
                # never retried (it would fail the same way elsewhere) and never held against the
                # replica, so a client cannot eject replicas by sending bad requests.
                pool.record_success(backend)
                if not resp.content_type.startswith("text/event-stream"):
                    try:
                        data = await resp.read()
                    except UpstreamError as e:
                        pool.record_failure(backend, f"{e.kind}: {e}")
                        return False, f"{e.kind}: {e} reading the body ({backend.url})", None
                    if self._count_output and status == 200:
                        out_tokens = usage_tokens(data)
                    headers = self._resp_headers(resp, backend)
                    headers.append((b"content-length", str(len(data)).encode()))
                    await send({"type": "http.response.start", "status": status, "headers": headers})
                    await send({"type": "http.response.body", "body": data})
                    return True, "", None
                # SSE: wait for the first chunk before anything goes to the client
                it = resp.iter_raw()
                try:
                    first = await it.__anext__()
                except StopAsyncIteration:
                    first = b""
                except UpstreamError as e:
                    pool.record_failure(backend, f"{e.kind}: {e}")
                    return False, f"{e.kind}: {e} before the first chunk ({backend.url})", None
                await send({"type": "http.response.start", "status": status,
                            "headers": self._resp_headers(resp, backend)})
                if first:
                    if self._count_output:
                        out_tokens += first.count(b"data: ")
                    await send({"type": "http.response.body", "body": first, "more_body": True})
                relayed, broken = await self._relay_rest(send, it, backend)
                out_tokens += relayed
                if broken:
                    status_label = "stream_error"
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return True, "", None
            finally:
                resp.close()
        finally:
            state.in_flight -= 1
            m.requests.labels(backend.url, status_label).inc()
            try:
                self.policy.on_finish(rr, state, max(0, out_tokens - 1) if out_tokens else out_tokens)
            except Exception:          # pragma: no cover - a policy bug must not leak in-flight
                log.exception("policy.on_finish")


    async def _relay_rest(self, send, it, backend: Backend) -> tuple[int, bool]:
        """Relay a stream after its first chunk: (data events seen, whether the backend broke it).
        After the first byte a failure is told in-band, with one SSE error event."""
        count, n = self._count_output, 0
        try:
            async for chunk in it:
                if count:
                    n += chunk.count(b"data: ")
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as e:
            self.pool.record_failure(backend, f"{e.kind}: {e} mid-stream")
            self.metrics.errors.labels("stream_error").inc()
            ev = error_body(f"backend {backend.url} failed mid-stream: {e}", "upstream_error", 502)
            await send({"type": "http.response.body",
                        "body": b"data: " + json.dumps(ev).encode() + b"\n\n", "more_body": True})
            return n, True
        return n, False
