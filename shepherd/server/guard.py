"""The door of the HTTP servers: the key first, then the body's size, time and shape.

Each check runs before anything that costs more than it does, so that a
request without a key, or with a body nobody could serve, is refused before
it is read, parsed or tokenized:

  1. the bearer key (401), before one byte of the body is read, on every
     path except the open ones (/health, /metrics, /version, the docs);
  2. a Content-Length over the cap (413), at once; then the body is read
     with the cap (413) and a deadline for the whole body (408), so a
     slow-body connection cannot hold a request open;
  3. the JSON is parsed once (400 when malformed), then checked for depth
     and lone UTF-16 surrogates (400): FastAPI would hand a body nested
     100,000 deep to json.loads (a RecursionError) and lone surrogates to
     the tokenizer (a UnicodeEncodeError). Both checks look at the raw bytes
     first and walk the parsed object only when the bytes say they must.

The parsed object travels in the ASGI scope to the routes (`JsonRoute`), so
FastAPI does not parse the body a second time. Parsing holds the GIL (tens of
milliseconds for a body of a megabyte), so large bodies are parsed one per
turn of the event loop: between two of them, /health and the streams run. The gateway uses the same
pieces (`key_error`, `read_body`) on its own ASGI app.
"""
from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import re
import uuid
from typing import Any, Optional

import numpy as np      # at import, not on the first deep body: ~0.11 s under the event loop
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

logger = logging.getLogger("shepherd.server")

DEFAULT_MAX_JSON_DEPTH = 64
DEFAULT_BODY_TIMEOUT = 30.0
LARGE_BODY = 64 << 10        # bodies from this size are parsed one per turn of the event loop
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/docs", "/docs/oauth2-redirect", "/redoc",
                        "/openapi.json"})
SCOPE_JSON = "shepherd.json"
SCOPE_LARGE = "shepherd.large"      # the body is LARGE_BODY bytes or more: JsonRoute validates it off the loop
# a replica's /health answer names its body cap, so that a gateway or the Ray ingress in front of it
# refuses from Content-Length what every replica would refuse, instead of reading and parsing it
# first (10 bodies of 13 MB, parsed by the gateway and then refused by the replicas, held the
# gateway's event loop for 3.3 s: docs/SERVING.md, the stall table through the gateway)
BODY_CAP_HEADER = "x-shepherd-max-body-bytes"

# a lone surrogate can only enter as a \uD800-\uDFFF escape or as the raw (invalid) UTF-8 bytes
# of one, which json.loads accepts from bytes; without either the walk is skipped
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_NOT_SKELETON = bytes(b for b in range(256) if b not in b'"[]{}')     # all but quotes and brackets


def error_body(message: str, type_: str = "invalid_request_error", *, param: Optional[str] = None,
               code: Optional[str | int] = None) -> dict:
    """The OpenAI error body every answer of shepherd's uses: serve, the gateway, the Ray ingress,
    the endpoint picker. param and code by keyword: two builders with the two in opposite orders
    once sat side by side."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class Refusal(Exception):
    """An answer the door gives instead of the app: status, OpenAI-style error body."""

    def __init__(self, status: int, message: str, code: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.code, self.type, self.param = status, message, code, type_, param

    def payload(self) -> dict:
        return error_body(self.message, self.type, param=self.param, code=self.code)

    def body(self) -> bytes:
        return json.dumps(self.payload()).encode()


def bearer(scope) -> Optional[str]:
    for k, v in scope.get("headers", ()):
        if k.lower() == b"authorization":
            scheme, _, token = v.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def key_error(scope, key: Optional[str], what: str = "API key") -> Optional[Refusal]:
    """A 401 unless the request carries `Authorization: Bearer <key>` (None: no key is required)."""
    if not key:
        return None
    token = bearer(scope)
    if token is not None and hmac.compare_digest(token.encode(), key.encode()):
        return None
    return Refusal(401, f"Invalid or missing {what}: send 'Authorization: Bearer <key>'.", "invalid_api_key")


def content_length(scope) -> Optional[int]:
    for k, v in scope.get("headers", ()):
        if k.lower() == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None


async def read_body(receive, scope, max_bytes: int, timeout: Optional[float], flag: str) -> Optional[bytes]:
    """The whole body, or None if the client went away. Refusal 413 over `max_bytes` (from the
    Content-Length alone when it says so), 408 when it has not all arrived within `timeout` s.
    `flag` names the option that sets the cap, for the message."""
    declared = content_length(scope)
    if declared is not None and declared > max_bytes:
        raise Refusal(413, f"request body of {declared} bytes is larger than {max_bytes} bytes ({flag})",
                      "body_too_large")
    chunks, size = [], 0

    async def pull() -> bool:
        nonlocal size
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return False
            b = msg.get("body", b"")
            size += len(b)
            if size > max_bytes:
                raise Refusal(413, f"request body larger than {max_bytes} bytes ({flag})", "body_too_large")
            chunks.append(b)
            if not msg.get("more_body", False):
                return True
    try:
        whole = await asyncio.wait_for(pull(), timeout) if timeout else await pull()
    except asyncio.TimeoutError:
        raise Refusal(408, f"the request body did not arrive within {timeout:g} s (--body-timeout)",
                      "body_timeout") from None
    return b"".join(chunks) if whole else None


def body_cap_of(value: Optional[str]) -> Optional[int]:
    """The cap a replica's BODY_CAP_HEADER names, or None (absent or not a positive integer)."""
    try:
        cap = int(value) if value is not None else 0
    except ValueError:
        return None
    return cap if cap > 0 else None


def front_cap(own: int, own_flag: str, replica_caps: list) -> tuple[int, str]:
    """(the body cap of a proxy in front of replicas, what sets it, for the 413's message): its own,
    lowered to the largest of the replicas' caps once every replica has named one (None: it has
    not yet, or it is not shepherd), since a body over all of them would only be refused by them."""
    if replica_caps and None not in replica_caps and max(replica_caps) < own:
        return max(replica_caps), "the replicas' --max-body-bytes"
    return own, own_flag


def json_depth(body: bytes) -> int:
    """Deepest nesting of brackets outside strings (0 for a scalar). A regex that cut the strings
    out took ~22 ms on the event loop for a 1.2 MB body of 43,000 small objects (every string a
    match); this takes a few. Escapes go first, left to right as JSON reads them (an escaped
    backslash, then an escaped quote), so every quote left is a string's edge; the bytes are then
    cut to quotes and brackets (C calls), and a bracket counts when an even number of edges come
    before it (whole-array steps)."""
    if b"\\" in body:
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    a = np.frombuffer(body.translate(None, _NOT_SKELETON), dtype=np.uint8)
    if not len(a):
        return 0
    step = ((a == 91) | (a == 123)).astype(np.int32) - ((a == 93) | (a == 125))
    step[(np.cumsum(a == 34, dtype=np.int32) & 1).astype(bool)] = 0
    return max(0, int(np.cumsum(step).max()))


def surrogate_at(obj: Any) -> Optional[str]:
    """Where the parsed body holds a lone UTF-16 surrogate, or None."""
    stack = [(obj, "body")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(node, dict):
            for k, v in node.items():
                stack.append((k, f"{where} key"))
                stack.append((v, f"{where}.{k}" if isinstance(k, str) and k.isascii() else where))
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(node) if isinstance(v, (str, list, dict)))
    return None


def parse_body(body: bytes, max_depth: int) -> Any:
    """The parsed JSON body; Refusal 400 when it is malformed, too deep or holds a lone surrogate."""
    depth = json_depth(body) if body.count(b"[") + body.count(b"{") > max_depth else 0
    if depth > max_depth:
        raise Refusal(400, f"the JSON body is nested deeper than {max_depth} levels ({depth}; --max-json-depth)",
                      "invalid_body")
    try:
        obj = json.loads(body)
    except RecursionError:
        raise Refusal(400, f"the JSON body is nested deeper than {max_depth} levels", "invalid_body") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise Refusal(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
    # (memchr pre-checks: the regex alone scanned a 1.2 MB body in ~10 ms)
    if (b"\\u" in body or b"\xed" in body) and _SURROGATE_BYTES.search(body):
        where = surrogate_at(obj)
        if where is not None:
            raise Refusal(400, f"{where} contains a lone UTF-16 surrogate, which is not valid Unicode text",
                          "invalid_body")
    return obj


class Parser:
    """parse_body for an event loop: a large body is parsed one per turn of the loop (parsing holds
    the GIL), so that between two of them the loop serves /health and the streams."""

    def __init__(self, max_depth: int = DEFAULT_MAX_JSON_DEPTH):
        self.max_depth = max_depth
        self._large: Optional[asyncio.Lock] = None

    async def parse(self, body: bytes) -> Any:
        if len(body) < LARGE_BODY:
            return parse_body(body, self.max_depth)
        if self._large is None:
            self._large = asyncio.Lock()
        async with self._large:     # held across a turn of the loop: one large parse per turn
            await asyncio.sleep(0)
            return parse_body(body, self.max_depth)


FULL_GC_AFTER = 1000      # collections of the middle generation between two of the oldest (CPython's: 10)


def settle_heap() -> None:
    """Once a server's startup is done, before it serves (`shepherd serve`, the gateway, the Ray
    ingress): freeze the startup heap and collect the oldest generation rarely.

    The startup heap (the server's ~267,000 objects: app, tokenizer, models) is never garbage,
    yet every collection of the oldest generation walked it, ~145 ms with the event loop (every
    stream, /health) waiting. Frozen, the collector walks only what serving allocates (vLLM's API
    server does the same; the engine core freezes its own). That is still every body in flight:
    ten 1.2 MB chats of 43,000 messages each are ~1M objects, and the full collections their
    allocations set off held the loop for up to 0.18 s. So the oldest generation is collected
    after FULL_GC_AFTER younger collections instead of 10; the young ones, which find the cycles
    serving makes, run as before (docs/SERVING.md: the stall rows, and RSS flat over 4,500
    requests)."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_GC_AFTER)


async def answer(send, status: int, data: bytes, headers: Optional[list] = None) -> None:
    h = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": h + list(headers or ())})
    await send({"type": "http.response.body", "body": data})


async def json_500_on_error(handler, scope, receive, send, who: str, log) -> None:
    """`await handler(scope, receive, send)`; a bug it raises is logged and, when nothing was
    answered yet, answered as an OpenAI-style JSON 500, never as plain text, with the connection
    kept (the server, the gateway and the Ray ingress)."""
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
            body = error_body(f"{who} error: {type(e).__name__}", "server_error", code=500)
            await answer(send, 500, json.dumps(body).encode())


MAX_REQUEST_ID = 256      # bytes of a client's X-Request-Id echoed back; a longer one is replaced
SCOPE_REQUEST_ID = "shepherd.request_id"
_PRINTABLE = re.compile(rb"[\x20-\x7e]+")


def with_request_id(scope, send):
    """`send` that puts X-Request-Id on the answer: the client's own (what a gateway or a tracing
    client sent; printable ASCII, since it is also the answer's id), else a fresh uuid4 hex, as
    vLLM's --enable-request-id-headers does. On every answer, refusals included, so a client can
    name any request it made when it reports one. The id goes in the scope for `request_id_of`,
    and in its headers in place of the client's, so a gateway forwards the one it answers with
    (the replica's answer, relayed, then carries it already and it is not added twice)."""
    headers = scope["headers"]
    given = next((v for k, v in headers if k.lower() == b"x-request-id"), b"")
    ok = len(given) <= MAX_REQUEST_ID and _PRINTABLE.fullmatch(given)
    rid = given if ok else uuid.uuid4().hex.encode()
    scope[SCOPE_REQUEST_ID] = rid.decode("ascii")
    if not ok:
        scope["headers"] = [(k, v) for k, v in headers if k.lower() != b"x-request-id"] + [(b"x-request-id", rid)]

    async def send_with_id(msg):
        if msg["type"] == "http.response.start":
            out = msg.get("headers", ())
            if not any(k.lower() == b"x-request-id" for k, _ in out):
                msg = {**msg, "headers": [*out, (b"x-request-id", rid)]}
        await send(msg)
    return send_with_id


def request_id_of(request: Request) -> str:
    """The request's id as X-Request-Id names it; the answer's own id is built on it ("cmpl-<id>"),
    as vLLM's, so a client's trace id finds the answer in its logs and in the body alike."""
    return request.scope.get(SCOPE_REQUEST_ID) or uuid.uuid4().hex


class BodyGuard:
    """ASGI middleware of `shepherd serve`: steps 1-3 of the module doc for every POST
    (step 1 for every request); the parsed body goes on in scope["shepherd.json"]."""

    def __init__(self, app, max_body_bytes: int, max_depth: int = DEFAULT_MAX_JSON_DEPTH,
                 api_key: Optional[str] = None, body_timeout: Optional[float] = DEFAULT_BODY_TIMEOUT):
        self.app = app
        self.max_body_bytes = int(max_body_bytes)
        self.max_depth = int(max_depth)
        self.api_key = api_key
        self.body_timeout = body_timeout
        self.parser = Parser(self.max_depth)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        send = with_request_id(scope, send)
        try:
            if scope["path"] not in OPEN_PATHS:
                refused = key_error(scope, self.api_key)
                if refused is not None:
                    raise refused
            if scope.get("method") != "POST":
                return await self._run(scope, receive, send)
            body = await read_body(receive, scope, self.max_body_bytes, self.body_timeout, "--max-body-bytes")
            if body is None:
                return
            if body.strip():
                scope[SCOPE_JSON] = await self.parser.parse(body)
                scope[SCOPE_LARGE] = len(body) >= LARGE_BODY
                # the body is JSON whatever the client called it (curl -d says form-urlencoded)
                scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"] + [
                    (b"content-type", b"application/json")]
        except Refusal as r:
            return await answer(send, r.status, r.body())
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self._run(scope, replay, send)

    async def _run(self, scope, receive, send):
        # a bug is answered here, not by Starlette's handler, which re-raised after answering:
        # uvicorn then closed the connection, and a client's next request on it failed with a reset
        await json_500_on_error(self.app, scope, receive, send, "internal", logger)


class _ParsedRequest(Request):
    """A Request whose json() is the body BodyGuard already parsed."""

    async def json(self) -> Any:
        if SCOPE_JSON in self.scope:
            return self.scope[SCOPE_JSON]
        return await super().json()


class JsonRoute(APIRoute):
    """FastAPI route class that reads the body BodyGuard parsed instead of parsing it again.

    A body of LARGE_BODY bytes or more is also validated into its model here, in the app's work
    pool (`app.state.workpool`: the thread that tokenizes), and FastAPI is handed the instance,
    which it takes as it is. Validation holds the GIL for as long as it runs, and it grows with
    the body's items: a 1.4 MB chat of 44,000 empty messages took 110-220 ms, every other stream
    and /health waiting, on the event loop; in the thread the models' Python validators let the
    loop in between (its longest pause 27-35 ms; in process, with another job on the machine;
    served: docs/SERVING.md, "Bodies of many small objects")."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        model = self.body_field.field_info.annotation if self.body_field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            model = None

        async def route(request: Request):
            scope = request.scope
            if model is not None and scope.get(SCOPE_LARGE) and isinstance(scope.get(SCOPE_JSON), dict):
                scope[SCOPE_JSON] = await _validate(request, model, scope[SCOPE_JSON])
            return await handler(_ParsedRequest(scope, request.receive))
        return route


async def _validate(request: Request, model: type, parsed: dict):
    pool = getattr(request.app.state, "workpool", None)
    try:
        if pool is None:
            return model.model_validate(parsed)
        return await pool.run(model.model_validate, parsed, cost=LARGE_BODY)    # past the inline cost
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
