"""What the gateway reads of a request before routing it, and its own JSON answers."""
from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Callable, Optional

from shepherd.routing import RouteRequest


# request headers never forwarded to a replica (hop-by-hop, or the client's framing)
DROP_REQUEST_HEADERS = {b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding",
                        b"te", b"trailer", b"upgrade", b"proxy-connection", b"proxy-authorization",
                        b"accept-encoding", b"expect"}


def error_body(message: str, type_: str = "invalid_request_error", code=None, param=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def send_json(send, status: int, obj, headers: Optional[list] = None) -> None:
    data = json.dumps(obj).encode()
    h = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if headers:
        h.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": h})
    await send({"type": "http.response.body", "body": data, "more_body": False})


class BadRequest(Exception):
    def __init__(self, message: str, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


class Disconnected(Exception):
    pass


async def read_body(receive, max_bytes: int) -> bytes:
    """The whole request body; BadRequest (413) past max_bytes, Disconnected if the client left."""
    chunks = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise Disconnected()
        b = msg.get("body", b"")
        if b:
            size += len(b)
            if size > max_bytes:
                raise BadRequest(f"request body larger than {max_bytes} bytes", status=413)
            chunks.append(b)
        if not msg.get("more_body", False):
            return b"".join(chunks)


async def send_metrics(send, registry) -> None:
    """A Prometheus registry as the answer of GET /metrics."""
    from prometheus_client import generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST
    data = generate_latest(registry)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode()),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def json_object(body: bytes) -> dict:
    """The request body as a JSON object; BadRequest otherwise."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        raise BadRequest("request body is not valid JSON (or nested too deeply)") from None
    if not isinstance(payload, dict):
        raise BadRequest("request body must be a JSON object")
    return payload


def split_headers(headers) -> tuple[list, dict]:
    """ASGI headers -> (those to forward, the x-* ones lower-cased as str for the RouteRequest)."""
    fwd, xh = [], {}
    for k, v in headers:
        lk = k.lower()
        if lk.startswith(b"x-"):
            xh[lk.decode("latin-1")] = v.decode("latin-1")
        if lk not in DROP_REQUEST_HEADERS:
            fwd.append((k, v))
    return fwd, xh


async def watch_disconnect(receive, send, run: Callable[..., Awaitable[None]]) -> bool:
    """`await run(send)` while a watcher reads `receive` for the client's http.disconnect: one that
    comes before the answer is complete cancels `run` (every await in it may then raise
    CancelledError, every finally runs). Returns False when the client went away, else True.
    Once the last body message is handed over the answer is complete and a disconnect no longer
    matters (uvicorn reports one as soon as the response is complete)."""
    task = asyncio.current_task()
    flags = {"complete": False, "gone": False}

    async def send_tracked(msg):
        if msg["type"] == "http.response.body" and not msg.get("more_body", False):
            flags["complete"] = True
        await send(msg)

    async def watch():
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                if not flags["complete"]:
                    flags["gone"] = True
                    task.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await run(send_tracked)
        return True
    except asyncio.CancelledError:
        if not flags["gone"]:
            raise
        if hasattr(task, "uncancel"):       # Python >= 3.11
            task.uncancel()
        return False
    finally:
        watcher.cancel()


async def json_500_on_error(handler, scope, receive, send, who: str, log) -> None:
    """`await handler(scope, receive, send)`; a bug it raises is logged and, when nothing was
    answered yet, answered as an OpenAI-style JSON 500, never as plain text."""
    started = False

    async def send_seen(msg):
        nonlocal started
        started = started or msg["type"] == "http.response.start"
        await send(msg)
    try:
        await handler(scope, receive, send_seen)
    except Exception as e:  # noqa: BLE001 - the point of this function
        log.exception("%s error", who)
        if not started:
            await send_json(send, 500, error_body(f"{who} error: {type(e).__name__}", "server_error", 500))


def usage_tokens(data: bytes) -> int:
    """completion_tokens of a JSON answer's usage (0 when there is none)."""
    try:
        u = json.loads(data).get("usage") or {}
        return int(u.get("completion_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
        return 0


def _flatten_content(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):          # [{"type": "text", "text": ...}, ...]
        out = []
        for part in content:
            if isinstance(part, dict):
                t = part.get("text")
                if isinstance(t, str):
                    out.append(t)
            elif isinstance(part, str):
                out.append(part)
        return "".join(out)
    return str(content)


def route_request_from(payload: dict, chat: bool, headers: dict, now: float) -> RouteRequest:
    """What the routing policy sees of a request; raises BadRequest on bad input."""
    token_ids = None
    if chat:
        msgs = payload.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' must be a non-empty list", "messages")
        parts = []
        for m in msgs:
            if not isinstance(m, dict):
                raise BadRequest("each message must be an object", "messages")
            parts.append(f"<|{m.get('role', '')}|>{_flatten_content(m.get('content'))}\n")
        text = "".join(parts)
    else:
        if "prompt" not in payload:
            raise BadRequest("'prompt' is required", "prompt")
        prompt = payload["prompt"]
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool)
                                                         for x in prompt):
            token_ids = prompt
            text = " ".join(map(str, prompt))
        elif isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
            text = prompt[0]           # route a batch by its first prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(x, list) for x in prompt):
            token_ids = prompt[0] if all(isinstance(t, int) for t in prompt[0]) else None
            text = " ".join(map(str, prompt[0]))
        else:
            raise BadRequest("'prompt' must be a string, a list of strings, or token ids", "prompt")
    # lone surrogates (legal in JSON, not in UTF-8) would break the policies' hashing; the
    # replica answers such a request with a 400, the gateway only needs something to route on
    text = text.encode("utf-8", "replace").decode("utf-8")
    stream = payload.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    user = payload.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("'user' must be a string", "user")
    user = user or headers.get("x-client-id") or None
    mt = payload.get("max_tokens", payload.get("max_completion_tokens"))
    return RouteRequest(
        text=text, token_ids=token_ids, user=user, session=headers.get("x-session-id"),
        headers=headers, input_tokens=len(token_ids) if token_ids else max(1, len(text) // 4),
        now=now, max_tokens=mt if isinstance(mt, int) and not isinstance(mt, bool) else 0)
