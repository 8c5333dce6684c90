"""The head of every HTTP request (its line and headers), bounded in bytes and in time.

uvicorn's httptools protocol, which it picks when httptools is installed (a
dependency of shepherd, as of vLLM through uvicorn[standard]), reads a head
with no bound of either kind, before any ASGI code (guard.py's door) runs:
- bytes: one 100 MB header was read whole and answered 200, and reading it
  is quadratic (the URL and each header value grow by concatenation), so one
  connection held the server's event loop for seconds (docs/SERVING.md, "The
  request's head");
- time: a connection that sends nothing, or its head a byte a second, was
  held open for ever, one file descriptor each, until nobody else could
  connect (slowloris).

`head_bounded(timeout)` is uvicorn's protocol class with both bounds:
- a head over MAX_HEAD_BYTES is answered 431 and the connection closed;
- a head not complete `timeout` seconds after the connection opened (its
  first request) or after its first byte (a later request on a kept-alive
  connection; uvicorn's own keep-alive timeout bounds the wait before it) is
  answered 408 and closed, or just closed when it sent nothing.

The ASGI app never sees these requests. h11, uvicorn's fallback without
httptools, refuses heads over 16 KiB itself (400); there only the time bound
is missing, and shepherd depends on httptools.
"""
from __future__ import annotations

import json
from typing import Optional

MAX_HEAD_BYTES = 64 << 10     # h11's limit is 16 KiB, Node's 16 KiB, nginx's 4 x 8 KiB lines
DEFAULT_HEAD_TIMEOUT = 10.0


def _refusal_body(message: str, code: str) -> bytes:
    from shepherd.server.guard import error_body      # fastapi, numpy: not for the CLI's --help
    return json.dumps(error_body(message, code=code)).encode()


def _refusal(status: int, reason: str, body: bytes) -> bytes:
    """A whole HTTP answer, written to the transport before any request exists to answer through."""
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def head_bounded(timeout: float = DEFAULT_HEAD_TIMEOUT, max_bytes: int = MAX_HEAD_BYTES):
    """uvicorn's HTTP protocol class with the module doc's two bounds (uvicorn.Config(http=...))."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:     # no httptools: uvicorn's h11 protocol, which bounds the size itself
        return "auto"
    large_body = _refusal_body(f"the request's URL and headers are larger than {max_bytes} bytes",
                               "header_too_large")
    too_large = _refusal(431, "Request Header Fields Too Large", large_body)
    too_slow = _refusal(408, "Request Timeout", _refusal_body(
        f"the request's line and headers did not arrive within {timeout:g} s (--header-timeout)", "header_timeout"))
    large_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(large_body)).encode()),
                     (b"connection", b"close")]

    async def answer_too_large(scope, receive, send) -> None:
        # a head that arrived whole in one read and is over the bound: answered through uvicorn's
        # own cycle (the parser is inside its callback; the connection closes after the answer)
        await send({"type": "http.response.start", "status": 431, "headers": large_headers})
        await send({"type": "http.response.body", "body": large_body})

    class HeadBounded(HttpToolsProtocol):
        # _in_head: a head's first byte is parsed and its last is not. While it is, _head_bytes
        # counts the reads that began inside it, to stop a head that keeps coming (the read that
        # starts it is not counted: a pipelined body before it would be); a head that completes is
        # measured exactly (its URL, names and values), so none over the bound reaches the app
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._in_head, self._head_bytes = False, 0
            self._head_timer = self.loop.call_later(timeout, self._head_late)

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._head_timer_off()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return      # refused: what is still arriving is not parsed
            was_in_head = self._in_head
            super().data_received(data)
            if was_in_head and self._in_head:
                self._head_bytes += len(data)
                if self._head_bytes > max_bytes:
                    self._refuse(too_large)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes = True, 0
            if self._head_timer is None:    # a later request: from its first byte
                self._head_timer = self.loop.call_later(timeout, self._head_late)

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._head_timer_off()
            if len(self.url) + sum(len(k) + len(v) for k, v in self.headers) <= max_bytes:
                return super().on_headers_complete()
            # the URL replaced too: httptools' URL parser refuses one over 64 KiB (uvicorn's plain-text 400)
            app, self.app, self.url = self.app, answer_too_large, b"/"
            try:
                super().on_headers_complete()
            finally:
                self.app = app

        def _head_timer_off(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self._in_head:
                self._refuse(too_slow)
            elif self.cycle is None and not self.transport.is_closing():
                self.transport.close()      # connected and sent nothing

        def _refuse(self, answer: bytes) -> None:
            self._in_head = False
            self._head_timer_off()
            if not self.transport.is_closing():
                self.transport.write(answer)
                self.transport.close()

    return HeadBounded
