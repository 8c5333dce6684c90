"""Checks on a JSON body before FastAPI parses it (an ASGI middleware).

FastAPI would hand a body nested 100,000 deep to json.loads (RecursionError,
a 500) and strings with lone surrogates to the tokenizer (UnicodeEncodeError,
a 500). Here every POST body is read once, capped in size, parsed, walked
without recursion for its depth and for lone surrogates, and then replayed to
the app unchanged. Failures are OpenAI-style 400 / 413 answers.
"""
from __future__ import annotations

import json
from typing import Any, Optional

DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_MAX_JSON_DEPTH = 64


def _error(message: str, param: Optional[str] = None, code: Optional[str] = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                 "code": code}}).encode()


def body_problem(obj: Any, max_depth: int) -> Optional[str]:
    """Why the parsed body is refused (too deep, a lone surrogate), or None."""
    stack = [(obj, 1, "body")]
    while stack:
        node, depth, where = stack.pop()
        if depth > max_depth:
            return f"the JSON body is nested deeper than {max_depth} levels (at {where})"
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return f"{where} contains a lone UTF-16 surrogate, which is not valid Unicode text"
        elif isinstance(node, dict):
            for k, v in node.items():
                stack.append((k, depth + 1, f"{where} key"))
                stack.append((v, depth + 1, f"{where}.{k}" if isinstance(k, str) and k.isascii() else where))
        elif isinstance(node, list):
            stack.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(node))
    return None


class BodyGuard:
    def __init__(self, app, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 max_depth: int = DEFAULT_MAX_JSON_DEPTH):
        self.app = app
        self.max_body_bytes = int(max_body_bytes)
        self.max_depth = int(max_depth)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            b = msg.get("body", b"")
            size += len(b)
            if size > self.max_body_bytes:
                return await _answer(send, 413, _error(
                    f"request body larger than {self.max_body_bytes} bytes (--max-body-bytes)",
                    code="body_too_large"))
            chunks.append(b)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        why = self._check(body)
        if why is not None:
            return await _answer(send, 400, _error(why, code="invalid_body"))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _check(self, body: bytes) -> Optional[str]:
        if not body.strip():
            return None
        try:
            obj = json.loads(body)
        except RecursionError:
            return f"the JSON body is nested deeper than {self.max_depth} levels"
        except (ValueError, UnicodeDecodeError):
            return None         # FastAPI reports malformed JSON with its position
        return body_problem(obj, self.max_depth)


async def _answer(send, status: int, data: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
