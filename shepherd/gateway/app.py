"""The gateway: an OpenAI-compatible HTTP proxy across replicas.

    gw = Gateway(BackendPool(["http://127.0.0.1:8001", "http://127.0.0.1:8002"]),
                 make_policy("prefix-aware"), GatewayConfig(api_key="...", admin_key="..."))
    uvicorn.run(gw, ...)            # a plain ASGI app

Routes
  POST /v1/completions, /v1/chat/completions, /v1/responses, /tokenize, /detokenize
                                 routed by the policy, passed through; SSE relayed chunk by chunk
  GET  /v1/models, /v1/models/{id}   the union of the healthy backends' models
  GET  /health                   200 while at least one backend is healthy, else 503
  GET  /metrics                  the gateway's own Prometheus registry
  /admin/backends                off unless --admin-key (admin.py)

Credentials first. With `api_key` every route but /health and /metrics needs
`Authorization: Bearer <api_key>`, checked before the body is read (401).
The client's Authorization header goes on to the backend unless
`backend_api_key` is set, in which case the gateway sends that key instead
(and the client's never leaves the gateway).

Request life (the invariants tests/test_gateway.py checks):
- in-flight of the chosen backend is +1 when a request is dispatched and -1
  in a `finally` when that attempt ends, whatever way: success, backend
  error, retry, client abort (a watcher on http.disconnect cancels the
  handler), timeout.
- Retries and what counts against a replica: the table in proxy.py. In
  short: only before a backend may have run the request, never for a timeout,
  429 only onto a replica with room.
- After the first byte, a failure ends the stream with one SSE error event and
  [DONE]; nothing hangs: connect/read/write timeouts bound every wait.
- Bad input to the gateway itself (not JSON, not an object, no prompt /
  messages, body too large or too slow) gets an OpenAI-style error body.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Optional

import httpx
from prometheus_client import CollectorRegistry

from shepherd.gateway.admin import Admin
from shepherd.gateway.backends import Backend, BackendPool
from shepherd.gateway.gw_metrics import GatewayMetrics
from shepherd.gateway.http1 import Http1Pool
from shepherd.gateway.intake import (read_routed, send_json,
                                     send_metrics, split_headers, watch_disconnect)
from shepherd.gateway.kv_routing import KVRouting
from shepherd.gateway.proxy import Proxy
from shepherd.routing import RoutingPolicy
from shepherd.server.guard import (Parser, Refusal, error_body, front_cap, json_500_on_error, key_error,
                                   with_request_id)

log = logging.getLogger("shepherd.gateway")

PROXY_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/responses": "responses",
               "/tokenize": "tokenize", "/detokenize": "detokenize"}
OPEN_PATHS = ("/health", "/metrics")

@dataclass
class GatewayConfig:
    retries: int = 2                 # extra attempts on other replicas, when it is safe (proxy.py)
    retry_backoff: float = 0.02      # seconds before the first retry; doubles each time
    retry_backoff_max: float = 0.5
    connect_timeout: float = 2.0
    read_timeout: float = 600.0      # longest silence from a backend (a whole non-streamed answer)
    write_timeout: float = 30.0
    pool_timeout: float = 30.0
    max_keepalive: int = 512         # idle connections kept per backend
    max_body_bytes: int = 16 << 20   # 413 beyond; lowered to the replicas' own caps once they name them
    body_timeout: float = 30.0       # 408 when a body takes longer to arrive
    models_timeout: float = 5.0
    backend_header: bool = True      # add x-shepherd-backend to responses
    api_key: Optional[str] = None          # clients must send it (Bearer)
    backend_api_key: Optional[str] = None  # sent to backends instead of the client's Authorization
    admin_key: Optional[str] = None        # /admin/* is off without it


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
        self.count_output = getattr(policy, "name", "") == "vtc-basic" or getattr(
            getattr(policy, "fallback", None), "name", "") == "vtc-basic"
        self.proxy = Proxy(self)
        self.parser = Parser()
        self.admin = Admin(pool, self.cfg.admin_key, self.policy_name,
                           kv_status=kv.status if kv is not None else None)
        auth = self.cfg.backend_api_key
        self._backend_auth = [(b"authorization", f"Bearer {auth}".encode())] if auth else None
        pool.on_change = self._on_pool_change
        pool.on_health = self._on_health

    # --- lifecycle -----------------------------------------------------------------
    async def startup(self) -> None:
        if self._started:
            return
        c = self.cfg
        # the gateway's own calls (the /v1/models fan-out, KV routing's /tokenize) carry the backend key
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=c.connect_timeout, read=c.read_timeout,
                                  write=c.write_timeout, pool=c.pool_timeout),
            headers=dict(self._backend_auth or ()), trust_env=False, follow_redirects=False)
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
            await json_500_on_error(self._http, scope, receive, with_request_id(scope, send), "gateway", log)
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
        path, method = scope["path"], scope["method"]
        if path == "/admin/backends":
            return await self.admin.handle(scope, receive, send)
        if path not in OPEN_PATHS:
            refused = key_error(scope, self.cfg.api_key)
            if refused is not None:
                return await send_json(send, refused.status, refused.payload())
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
        if (path == "/v1/models" or path.startswith("/v1/models/")) and method == "GET":
            return await self._models(scope, send, path[len("/v1/models/"):] if path != "/v1/models" else None)
        return await send_json(send, 404, error_body(f"no route {method} {path}", "not_found_error"))

    # --- helpers -----------------------------------------------------------------------
    def _auth_headers(self, scope) -> list:
        if self._backend_auth is not None:
            return list(self._backend_auth)
        return [(k, v) for k, v in scope["headers"] if k.lower() == b"authorization"]

    async def _models(self, scope, send, model_id: Optional[str]) -> None:
        assert self.client is not None
        bs = [b for b in self.pool.backends() if b.healthy]
        fwd = self._auth_headers(scope)

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
        if model_id is None:
            return await send_json(send, 200, {"object": "list", "data": data})
        card = next((m for m in data if m["id"] == model_id), None)
        if card is None:
            return await send_json(send, 404, error_body(f"The model `{model_id}` does not exist.",
                                                         "invalid_request_error", code="model_not_found",
                                                         param="model"))
        await send_json(send, 200, card)

    def _forward_headers(self, scope) -> tuple[list, dict]:
        """(headers to send on, the x- headers the policies may read)."""
        fwd, hdrs = split_headers(scope["headers"])
        return [(k, v) for k, v in fwd if k.lower() != b"authorization"] + self._auth_headers(scope), hdrs

    # --- the proxy ---------------------------------------------------------------------
    async def _proxy(self, scope, receive, send, path: str) -> None:
        m, cfg = self.metrics, self.cfg
        try:
            cap, flag = front_cap(cfg.max_body_bytes, "gateway body cap",
                                  [b.max_body_bytes for b in self.pool.backends()])
            fwd, hdrs = self._forward_headers(scope)
            fill = None if self.kv is None else (
                lambda rr, payload, chat: self.kv.fill(rr, payload, chat, self.pool.replicas(), self.client))
            got = await read_routed(receive, scope, self.parser, cap, cfg.body_timeout, flag, PROXY_PATHS[path],
                                    hdrs, fill)
            if got is None:
                m.errors.labels("client_abort").inc()
                return
            body, rr, stream = got
        except Refusal as r:
            m.errors.labels("bad_request").inc()
            return await send_json(send, r.status, r.payload())
        self.in_flight += 1
        try:
            if not await watch_disconnect(receive, send, lambda s: self.proxy.dispatch(s, path, body, fwd, rr, stream)):
                m.errors.labels("client_abort").inc()
        finally:
            self.in_flight -= 1
