"""What uvicorn reads of a request outside the app's sight, bounded in bytes and in time: its
head (line and headers), a chunked body's trailers, and the rest of a request answered before
it all arrived.

uvicorn's httptools protocol, which it picks when httptools is installed (a
dependency of shepherd, as of vLLM through uvicorn[standard]), reads all
three with no bound, before or after any ASGI code (guard.py's door) runs:
- bytes: one 100 MB header was read whole and answered 200, and reading it
  is quadratic (the URL and each header value grow by concatenation), so one
  connection held the server's event loop for seconds; a 40 MB trailer the
  same (docs/SERVING.md, "The request's head");
- time: a connection that sends nothing, or its head a byte a second, was
  held open for ever, one file descriptor each, until nobody else could
  connect (slowloris); so was one that trickles the rest of a refused body.

`head_bounded(timeout)` is uvicorn's protocol class with these bounds:
- a head over MAX_HEAD_BYTES is answered 431 and the connection closed;
- a head not complete `timeout` seconds after the connection opened (its
  first request) or after its first byte (a later request on a kept-alive
  connection; uvicorn's own keep-alive timeout bounds the wait before it) is
  answered 408 and closed, or just closed when it sent nothing;
- trailers over MAX_HEAD_BYTES close the connection (the request is under way);
- the rest of a request answered early (a body refused from its
  Content-Length, a missing key) is read and dropped, as HTTP/1.1 needs to
  reach the next request and as a client that sends its whole body before
  it reads needs to see the answer, for at most LINGER_BYTES and `timeout`
  seconds; then the connection is closed.

The ASGI app never sees the refused heads. shepherd depends on httptools, so
uvicorn never falls back to h11 (which bounds a head at 16 KiB but not in time).
"""
from __future__ import annotations

import json
from typing import Optional

MAX_HEAD_BYTES = 64 << 10     # h11's limit is 16 KiB, Node's 16 KiB, nginx's 4 x 8 KiB lines
DEFAULT_HEAD_TIMEOUT = 10.0
# what is read and dropped of a request answered before it all arrived (a body refused from its
# Content-Length): enough for a client that sends its whole body before it reads (httpx, the
# openai client) to get its 413 with the largest --max-body-bytes' worth on top; past it, closed
LINGER_BYTES = 256 << 20


def _refusal_body(message: str, code: str) -> bytes:
    from shepherd.server.guard import error_body      # fastapi, numpy: not for the CLI's --help
    return json.dumps(error_body(message, code=code)).encode()


def _refusal(status: int, reason: str, body: bytes) -> bytes:
    """A whole HTTP answer, written to the transport before any request exists to answer through."""
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def head_bounded(timeout: float = DEFAULT_HEAD_TIMEOUT, max_bytes: int = MAX_HEAD_BYTES):
    """uvicorn's HTTP protocol class with the module doc's bounds (uvicorn.Config(http=...))."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from shepherd.server.guard import answer
    large_body = _refusal_body(f"the request's URL and headers are larger than {max_bytes} bytes",
                               "header_too_large")
    too_large = _refusal(431, "Request Header Fields Too Large", large_body)
    too_slow = _refusal(408, "Request Timeout", _refusal_body(
        f"the request's line and headers did not arrive within {timeout:g} s (--header-timeout)", "header_timeout"))

    async def answer_too_large(scope, receive, send) -> None:
        # a head that arrived whole in one read and is over the bound: answered through uvicorn's
        # own cycle (the parser is inside its callback; the connection closes after the answer)
        await answer(send, 431, large_body, [(b"connection", b"close")])

    class HeadBounded(HttpToolsProtocol):
        # What each count covers. _in_head: a head's first byte is parsed and its last is not;
        # while it is, _head_bytes counts the reads that began inside it, to stop a head that
        # keeps coming (the read that starts it is not counted: a pipelined body before it would
        # be). A head that completes is measured exactly (its URL, names and values), so none over
        # the bound reaches the app. _in_trailer: a chunk's size line is parsed and none of its
        # data: after the last chunk (size 0) come the trailers, counted in _trailer_bytes the
        # same way. _lingering: the request was answered before all of it arrived; what arrives
        # after is dropped, counted in _linger_bytes. The timer runs only while no answer is
        # being sent (a pipelined head's starts when the answer before it ends), so what it
        # writes never lands inside another answer.
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._in_head = self._in_trailer = self._lingering = False
            self._head_bytes = self._trailer_bytes = self._linger_bytes = 0
            self._timer = None
            self._timer_on()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._timer_off()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return      # refused: what is still arriving is not parsed
            head, trailer, linger = self._in_head, self._in_trailer, self._lingering
            super().data_received(data)
            if head and self._in_head:
                self._head_bytes += len(data)
                if self._head_bytes > max_bytes:
                    self._refuse(too_large)
            if trailer and self._in_trailer:
                self._trailer_bytes += len(data)
                if self._trailer_bytes > max_bytes:
                    self._refuse(b"")       # the request is under way: closed under it
            if linger and self._lingering:
                self._linger_bytes += len(data)
                if self._linger_bytes > LINGER_BYTES:
                    self._refuse(b"")

        def _answering(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes, self._trailer_bytes = True, 0, 0
            if self._timer is None and not self._answering():    # a later request: from its first byte
                self._timer_on()

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._timer_off()
            if len(self.url) + sum(len(k) + len(v) for k, v in self.headers) <= max_bytes:
                return super().on_headers_complete()
            # the URL replaced too: httptools' URL parser refuses one over 64 KiB (uvicorn's plain-text 400)
            app, self.app, self.url = self.app, answer_too_large, b"/"
            try:
                super().on_headers_complete()
            finally:
                self.app = app

        def on_chunk_header(self) -> None:      # httptools calls it when the protocol has it
            self._in_trailer = True

        def on_body(self, body: bytes) -> None:
            self._in_trailer = False
            super().on_body(body)

        def on_chunk_complete(self) -> None:
            self._in_trailer = False

        def on_message_complete(self) -> None:
            answered = self._lingering
            self._in_trailer = self._lingering = False
            self._timer_off()
            super().on_message_complete()
            if answered:            # idle now, and uvicorn's keep-alive timer was spent on the rest
                self._timer_on()

        def on_response_complete(self) -> None:
            # with no request queued behind it, self.cycle is the one just answered: its body
            # still coming (more_body) means it was answered early (a refused body)
            rest = not self.pipeline and self.cycle.more_body
            super().on_response_complete()
            if self.transport.is_closing():
                return
            if rest:
                # the rest is read and dropped, as an HTTP/1.1 server must to reach the next
                # request, but not for ever
                self._lingering, self._linger_bytes = True, 0
                self._timer_off()
                self._timer_on()
            elif self._in_head and self._timer is None:     # a pipelined head: from now
                self._timer_on()

        def _timer_on(self) -> None:
            self._timer = self.loop.call_later(timeout, self._late)

        def _timer_off(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _late(self) -> None:
            # a head too slow (408), or a connection that sent nothing, or the rest of an answered
            # request too slow (closed)
            self._timer = None
            self._refuse(too_slow if self._in_head else b"")

        def _refuse(self, answer: bytes) -> None:
            answering = self._answering()      # a pipelined head past the bound: no answer inside another
            self._in_head = self._in_trailer = self._lingering = False
            self._timer_off()
            if not self.transport.is_closing():
                if answer and not answering:
                    self.transport.write(answer)
                self.transport.close()

    return HeadBounded
