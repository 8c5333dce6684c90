"""One proxied request: choose a replica, forward, relay the answer, retry only when it is safe.

When a try may be retried on another replica, and what counts against a replica:

| what happened                                   | retried elsewhere            | counts as a replica fault |
|---|---|---|
| could not connect                               | yes                          | yes                       |
| 429 (full now)                                  | only on a replica with room  | no; marked full for Retry-After |
| 503 (engine down or overloaded)                 | yes                          | no (its /health says)     |
| any other HTTP answer (4xx, a 500 about the request) | no, passed through      | no                        |
| stream broken before its first chunk            | yes (nothing reached the client) | yes                   |
| non-streaming: connection lost after sending    | no: the replica may have run it | yes                    |
| read timeout (slow, not dead)                   | no: 504                      | no                        |
| stream broken after the first chunk             | no: an error event, then [DONE] | yes                    |

A replica has room unless it answered 429 within its Retry-After; when every
candidate is full, the client gets the last 429 with the shortest Retry-After.
Every answer says where it went (`x-shepherd-backend`) and, after a retry,
what the earlier tries got (`x-shepherd-attempts`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Optional

from shepherd.gateway.backends import Backend
from shepherd.gateway.http1 import Response, UpstreamError
from shepherd.gateway.intake import send_json, usage_tokens
from shepherd.routing import NoReplicaAvailable, RouteRequest
from shepherd.server.guard import error_body

log = logging.getLogger("shepherd.gateway")

# response headers never copied back to the client
_DROP_RESP = {"content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
              "upgrade", "date", "server"}
DONE = b"data: [DONE]\n\n"


class _Try:
    """The outcome of one try: done (the client has its answer) or why not, and what it got."""
    __slots__ = ("done", "why", "answer", "retry")

    def __init__(self, done: bool, why: str = "", answer=None, retry: bool = True):
        self.done, self.why, self.answer, self.retry = done, why, answer, retry


def retry_after(resp: Response) -> float:
    try:
        return max(0.0, float(resp.header(b"retry-after") or b"1"))
    except ValueError:
        return 1.0


class Proxy:
    """The request path of the gateway (app.py builds one and calls `dispatch`)."""

    def __init__(self, gw) -> None:
        self.gw = gw
        self.full_until: dict[str, float] = {}      # backend url -> monotonic time its 429 expires

    def has_room(self, url: str, now: float) -> bool:
        return self.full_until.get(url, 0.0) <= now

    async def dispatch(self, send, path: str, body: bytes, fwd: list, rr: RouteRequest, stream: bool) -> None:
        gw = self.gw
        m, cfg, pool = gw.metrics, gw.cfg, gw.pool
        tried: set = set()
        attempts: list[str] = []
        last_answer = None            # (status, headers, body) of the last refusal (429 / 503)
        last_error = "no backend"
        for attempt in range(cfg.retries + 1):
            now = time.monotonic()
            cands = [r for r in pool.replicas() if r.healthy and r.url not in tried and self.has_room(r.url, now)]
            if not cands:
                break
            try:
                replica = gw.policy.choose(rr, cands)
            except NoReplicaAvailable:
                break
            m.decisions.labels(gw.policy_name, gw.policy.last_reason or "-").inc()
            backend = pool.get(replica.url)
            if backend is None:        # removed between choose and here (cannot happen on one loop)
                tried.add(replica.url)
                continue
            t = await self.attempt(send, path, body, fwd, rr, backend, stream, attempts)
            if t.done:
                return
            tried.add(backend.url)
            attempts.append(f"{backend.url} {t.answer[0] if t.answer else t.why.split(':')[0]}")
            last_error = t.why
            if t.answer is not None:
                last_answer = t.answer
            if not t.retry:
                break
            now = time.monotonic()
            if attempt < cfg.retries and any(r.healthy and r.url not in tried and self.has_room(r.url, now)
                                             for r in pool.replicas()):
                m.retries.labels(t.why.split(":")[0]).inc()
                await asyncio.sleep(min(cfg.retry_backoff * (2 ** attempt), cfg.retry_backoff_max))
        await self.give_up(send, tried, last_answer, last_error, attempts)

    async def give_up(self, send, tried: set, last_answer, last_error: str, attempts: list) -> None:
        """Nothing reached the client: answer for the gateway."""
        m = self.gw.metrics
        extra = [(b"x-shepherd-attempts", "; ".join(attempts).encode())] if attempts else []
        if last_answer is not None:
            status, headers, data = last_answer
            m.errors.labels("upstream").inc()
            await send({"type": "http.response.start", "status": status,
                        "headers": headers + extra + [(b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data})
            return
        if not tried:
            now = time.monotonic()
            full = [u - now for u in self.full_until.values() if u > now]
            if full:       # every healthy replica said "full" a moment ago: so does the gateway
                m.errors.labels("overloaded").inc()
                ra = max(1, int(min(full) + 0.999))
                return await send_json(send, 429, error_body("every replica is full; retry later", "rate_limit_error",
                                                             code="rate_limit_exceeded"),
                                       [(b"retry-after", str(ra).encode())])
            m.errors.labels("no_backend").inc()
            return await send_json(send, 503, error_body("no healthy backend", "service_unavailable", code=503),
                                   [(b"retry-after", b"1")])
        m.errors.labels("upstream").inc()
        status = 504 if last_error.startswith("timeout") else 502
        await send_json(send, status, error_body(f"backend failed: {last_error}", "upstream_error", code=status), extra)

    def _resp_headers(self, resp: Response, backend: Backend, attempts: list) -> list:
        out = [(k, v) for k, v in resp.headers_raw if k.decode("latin-1").lower() not in _DROP_RESP]
        if self.gw.cfg.backend_header:
            out.append((b"x-shepherd-backend", backend.url.encode()))
        if attempts:
            out.append((b"x-shepherd-attempts", "; ".join(attempts).encode()))
        return out

    async def attempt(self, send, path, body, fwd, rr, backend: Backend, stream: bool, attempts: list) -> _Try:
        """One try on one backend."""
        gw = self.gw
        m, pool, state = gw.metrics, gw.pool, backend.state
        state.in_flight += 1
        backend.total_requests += 1
        gw.policy.on_dispatch(rr, state)
        counted = {"tokens": 0, "status": "error"}
        try:
            try:
                resp = await gw.upstream.request("POST", backend.url, path, fwd, body)
            except UpstreamError as e:
                return self._failed(backend, e, "", stream, sent=e.kind != "connect")
            try:
                pool.saw_progress(backend)
                counted["status"] = str(resp.status_code)
                return await self._relay(send, resp, backend, stream, attempts, counted)
            finally:
                resp.close()
        finally:
            state.in_flight -= 1
            m.requests.labels(backend.url, counted["status"]).inc()
            out_tokens = counted["tokens"]
            try:
                gw.policy.on_finish(rr, state, max(0, out_tokens - 1) if out_tokens else out_tokens)
            except Exception:          # pragma: no cover - a policy bug must not leak in-flight
                log.exception("policy.on_finish")

    def _failed(self, backend: Backend, e: UpstreamError, where: str, stream: bool, sent: bool) -> _Try:
        """A try that ended without an answer. A timeout is a slow replica, not a dead one: not held
        against it, not retried (it has the request). A broken connection is held against it; the
        request is retried only if the replica cannot have run it (nothing sent, or a stream that
        gave nothing yet)."""
        why = f"{e.kind}: {e}{where} ({backend.url})"
        if e.kind == "timeout":
            return _Try(False, why, retry=False)
        self.gw.pool.record_failure(backend, f"{e.kind}: {e}{where}")
        return _Try(False, why, retry=stream or not sent)

    async def _relay(self, send, resp: Response, backend: Backend, stream: bool, attempts: list,
                     counted: dict) -> _Try:
        gw, status = self.gw, resp.status_code
        if status in (429, 503):
            # "not now": not a fault. 429: this replica is full for Retry-After; 503: try another
            try:
                data = await resp.read()
            except UpstreamError:
                data = json.dumps(error_body(f"backend answered {status}", "upstream_error", code=status)).encode()
            if status == 429:
                self.full_until[backend.url] = time.monotonic() + retry_after(resp)
            return _Try(False, f"overloaded: HTTP {status} from {backend.url}",
                        (status, self._resp_headers(resp, backend, []), data))
        # Any other answer, 4xx or 5xx, is about this request's content: passed through, never
        # retried (it would fail the same way elsewhere) and never held against the replica, so a
        # client cannot eject replicas by sending bad requests.
        gw.pool.record_success(backend)
        if not resp.content_type.startswith("text/event-stream"):
            try:
                data = await resp.read()
            except UpstreamError as e:
                return self._failed(backend, e, " reading the body", False, sent=True)
            if gw.count_output and status == 200:
                counted["tokens"] = usage_tokens(data)
            headers = self._resp_headers(resp, backend, attempts)
            headers.append((b"content-length", str(len(data)).encode()))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": data})
            return _Try(True)
        # SSE: wait for the first chunk before anything goes to the client
        it = resp.iter_raw()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            first = b""
        except UpstreamError as e:
            return self._failed(backend, e, " before the first chunk", True, sent=True)
        await send({"type": "http.response.start", "status": status,
                    "headers": self._resp_headers(resp, backend, attempts)})
        if first:
            counted["tokens"] += first.count(b"data: ") if gw.count_output else 0
            await send({"type": "http.response.body", "body": first, "more_body": True})
        relayed, broken = await self._relay_rest(send, it, backend)
        counted["tokens"] += relayed
        if broken:
            counted["status"] = "stream_error"
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return _Try(True)

    async def _relay_rest(self, send, it, backend: Backend) -> tuple[int, bool]:
        """Relay a stream after its first chunk: (data events seen, whether the backend broke it).
        After the first byte a failure is told in-band: one SSE error event, then [DONE], so a
        client waiting for [DONE] is not left hanging."""
        gw = self.gw
        count, n = gw.count_output, 0
        pool = gw.pool
        try:
            async for chunk in it:
                if count:
                    n += chunk.count(b"data: ")
                pool.saw_progress(backend)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as e:
            if e.kind != "timeout":
                pool.record_failure(backend, f"{e.kind}: {e} mid-stream")
            gw.metrics.errors.labels("stream_error").inc()
            ev = error_body(f"backend {backend.url} failed mid-stream: {e}", "upstream_error", code=502)
            await send({"type": "http.response.body",
                        "body": b"data: " + json.dumps(ev).encode() + b"\n\n" + DONE, "more_body": True})
            return n, True
        return n, False
