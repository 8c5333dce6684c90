"""What the gateway and the Ray ingress read of a request before routing it, and their own
JSON answers. The door itself (the key before the body, the body's size, time and shape) is
server/guard.py's, the same one `shepherd serve` uses."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Awaitable, Callable, Optional

from shepherd.routing import RouteRequest
from shepherd.server.guard import Parser, Refusal, answer, read_body


# request headers never forwarded to a replica (hop-by-hop, or the client's framing)
DROP_REQUEST_HEADERS = {b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding",
                        b"te", b"trailer", b"upgrade", b"proxy-connection", b"proxy-authorization",
                        b"accept-encoding", b"expect"}


async def send_json(send, status: int, obj, headers: Optional[list] = None) -> None:
    await answer(send, status, json.dumps(obj).encode(), headers)


def bad_request(message: str, param: Optional[str] = None) -> Refusal:
    return Refusal(400, message, "invalid_request", param=param)


async def read_json_object(receive, scope, parser: Parser, max_bytes: int, timeout: Optional[float],
                           flag: str) -> Optional[tuple[bytes, dict]]:
    """(the body, it parsed as a JSON object): guard.read_body, then parser.parse; None when the
    client went away; Refusal (400, 408, 413) otherwise."""
    body = await read_body(receive, scope, max_bytes, timeout, flag)
    if body is None:
        return None
    payload = await parser.parse(body)
    if not isinstance(payload, dict):
        raise bad_request("request body must be a JSON object")
    return body, payload


async def read_routed(receive, scope, parser: Parser, max_bytes: int, timeout: Optional[float], flag: str,
                      kind: str, headers: dict,
                      fill: Optional[Callable[[RouteRequest, dict, bool], Awaitable[None]]] = None
                      ) -> Optional[tuple[bytes, RouteRequest, bool]]:
    """(the body, what the policy sees of it, whether it streams) for a routed path: the body read
    and parsed (read_json_object), then route_request_from, then `fill(route, parsed, is_chat)`
    where the policy needs token ids. None when the client went away; Refusal (400, 408, 413) otherwise.
    Only the bytes go on to the replica: the parsed body is let go here, not held while the
    request is relayed (ten chats of 43,000 messages relayed at once kept ~430,000 objects alive
    for every collection of the gateway's heap to walk)."""
    got = await read_json_object(receive, scope, parser, max_bytes, timeout, flag)
    if got is None:
        return None
    body, payload = got
    route = route_request_from(payload, kind, headers, time.monotonic())
    if fill is not None:
        await fill(route, payload, kind == "chat")
    return body, route, payload.get("stream") is True


async def send_metrics(send, registry) -> None:
    """A Prometheus registry as the answer of GET /metrics."""
    from prometheus_client import generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST
    data = generate_latest(registry)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode()),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


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


def usage_tokens(data: bytes) -> int:
    """completion_tokens of a JSON answer's usage (0 when there is none). OpenAI-style answers
    (ours, vLLM's, SGLang's) put `usage` last, so only the object after its key is decoded: an
    answer of logprobs can be tens of MB, and parsing it whole held the gateway's event loop
    for as long as that took. Elsewhere (a key `"usage"` not followed by `:`), the whole answer."""
    at = data.rfind(b'"usage"')
    if at < 0:
        return 0
    try:
        rest = data[at + 7:].decode("utf-8").lstrip()
        if rest.startswith(":"):
            u, _ = json.JSONDecoder().raw_decode(rest[1:].lstrip())
        else:
            u = json.loads(data).get("usage")
        return int((u or {}).get("completion_tokens") or 0)
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


def _prompt_text(payload: dict) -> tuple[str, Optional[list]]:
    if "prompt" not in payload:
        raise bad_request("'prompt' is required", "prompt")
    prompt = payload["prompt"]
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        return " ".join(map(str, prompt)), prompt
    if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
        return prompt[0], None           # route a batch by its first prompt
    if isinstance(prompt, list) and prompt and all(isinstance(x, list) for x in prompt):
        ids = prompt[0] if all(isinstance(t, int) for t in prompt[0]) else None
        return " ".join(map(str, prompt[0])), ids
    raise bad_request("'prompt' must be a string, a list of strings, or token ids", "prompt")


def _chat_text(payload: dict, key: str = "messages") -> str:
    msgs = payload.get(key)
    if isinstance(msgs, str) and key == "input":              # /v1/responses: input may be a string
        return msgs
    if not isinstance(msgs, list) or not msgs:
        raise bad_request(f"'{key}' must be a non-empty list", key)
    parts = []
    for m in msgs:
        if not isinstance(m, dict):
            raise bad_request(f"each item of '{key}' must be an object", key)
        parts.append(f"<|{m.get('role', '')}|>{_flatten_content(m.get('content'))}\n")
    return "".join(parts)


def route_request_from(payload: dict, kind: str, headers: dict, now: float) -> RouteRequest:
    """What the routing policy sees of a request (kind: completions | chat | responses | tokenize |
    detokenize); raises Refusal (400) on bad input."""
    token_ids = None
    if kind == "chat" or (kind == "tokenize" and "messages" in payload):
        text = _chat_text(payload)
    elif kind == "responses":
        text = _chat_text(payload, "input")
    elif kind == "detokenize":
        text = ""                          # any replica: nothing to route on
    else:
        text, token_ids = _prompt_text(payload)
    # lone surrogates (legal in JSON, not in UTF-8) would break the policies' hashing; the
    # replica answers such a request with a 400, the gateway only needs something to route on
    text = text.encode("utf-8", "replace").decode("utf-8")
    stream = payload.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    user = payload.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string", "user")
    user = user or headers.get("x-client-id") or None
    mt = payload.get("max_tokens", payload.get("max_completion_tokens", payload.get("max_output_tokens")))
    model = payload.get("model")
    return RouteRequest(
        adapter=model if isinstance(model, str) and model else None,   # a base model's name: the
        # policy tells it from an adapter by the replicas' base_models
        text=text, token_ids=token_ids, user=user, session=headers.get("x-session-id"),
        headers=headers, input_tokens=len(token_ids) if token_ids else max(1, len(text) // 4),
        now=now, max_tokens=mt if isinstance(mt, int) and not isinstance(mt, bool) else 0)
