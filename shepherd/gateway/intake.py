"""What the gateway reads of a request before routing it, and its own JSON answers."""
from __future__ import annotations

import json
from typing import Optional

from shepherd.routing import RouteRequest


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
