"""What uvicorn reads outside the app's sight is bounded in bytes and time (server/http_head.py):
a request's line and headers, a chunked body's trailers, the rest of a request answered before it
all arrived. uvicorn with httptools read a 100 MB header whole (answered 200, the event loop held
for seconds), kept a connection that sends its head a byte at a time open for ever, and read a
refused body for as long as it came. A real uvicorn on loopback with the protocol `shepherd serve`
and `shepherd gateway` run; raw sockets, so that a request can be cut, slow or pipelined as no
HTTP client would send it."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import sys

import httpx
import pytest

from shepherd.server.http_head import LINGER_BYTES, MAX_HEAD_BYTES, head_bounded

sys.path.insert(0, os.path.dirname(__file__))
from gateway_fakes import ServerThread  # noqa: E402

TIMEOUT = 1.0


async def echo(scope, receive, send):
    """Answers each request with the number of body bytes it read and its header bytes; on
    /refuse at once with 413, the body unread (as guard.read_body refuses from Content-Length)."""
    if scope["path"] == "/refuse":
        await send({"type": "http.response.start", "status": 413, "headers": [(b"content-length", b"0")]})
        return await send({"type": "http.response.body", "body": b""})
    n = 0
    while True:
        msg = await receive()
        n += len(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    if scope["path"] == "/slow":        # work that outlasts the head timeout
        await asyncio.sleep(2 * TIMEOUT)
    body = json.dumps({"body": n, "headers": sum(len(k) + len(v) for k, v in scope["headers"])}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def server():
    with ServerThread(echo, lifespan="off", http=head_bounded(TIMEOUT)) as s:
        yield s


class Conn:
    """A raw connection and what it has read past the answers taken so far (pipelined answers
    can arrive in one read)."""

    def __init__(self, server):
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        self.buf = b""

    def __enter__(self) -> "Conn":
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, n: int) -> bytes:
        return self.sock.recv(n)

    def _more(self) -> bool:
        try:
            got = self.sock.recv(65536)
        except ConnectionResetError:
            return False
        self.buf += got
        return bool(got)

    def answer(self) -> tuple[int, bytes]:
        """(status, body) of the next answer (it has a Content-Length); (0, b"") when the server
        closed first."""
        while b"\r\n\r\n" not in self.buf:
            if not self._more():
                return 0, b""
        head, rest = self.buf.split(b"\r\n\r\n", 1)
        length = int(next(v for k, v in (ln.split(b":", 1) for ln in head.split(b"\r\n")[1:])
                          if k.strip().lower() == b"content-length"))
        while len(rest) < length:
            if not self._more():
                return 0, b""
            rest = self.buf.split(b"\r\n\r\n", 1)[1]
        self.buf = rest[length:]
        return int(head.split()[1]), rest[:length]


def get(header_bytes: int = 0, path: bytes = b"/") -> bytes:
    extra = b"X-Pad: " + b"a" * header_bytes + b"\r\n" if header_bytes else b""
    return b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n"


def test_a_head_up_to_the_bound_is_served_and_one_over_it_gets_431(server):
    under = MAX_HEAD_BYTES - 100        # "Host" + "x" + "X-Pad" + its value: just under the bound
    with Conn(server) as s:
        s.sendall(get(under))
        status, body = s.answer()
        assert status == 200 and json.loads(body)["headers"] > MAX_HEAD_BYTES - 200
        s.sendall(get())                # the connection is kept for the next request
        assert s.answer()[0] == 200
    with Conn(server) as s:
        s.sendall(get(MAX_HEAD_BYTES + 10))      # sent in one piece: measured whole
        status, body = s.answer()
        assert status == 431
        assert json.loads(body)["error"]["code"] == "header_too_large"
        assert s.recv(10) == b""        # and closed
    with Conn(server) as s:          # a URL over it too (httptools alone answers a plain-text 400)
        s.sendall(get(path=b"/?" + b"q" * (MAX_HEAD_BYTES + 10)))
        status, body = s.answer()
        assert status == 431 and json.loads(body)["error"]["type"] == "invalid_request_error"


def test_a_head_that_keeps_coming_is_cut_after_the_bound_not_read_whole(server):
    sent = 0
    with Conn(server) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        chunk = b"a" * (64 << 10)
        try:
            while sent < (256 << 20):   # 256 MB: read whole, the server took seconds of its loop
                s.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, _ = s.answer()
    assert status in (0, 431)           # the 431 is lost when the close meets unread bytes (a reset)
    # cut within the bound and a few reads; the socket buffers hold a few MB more
    assert sent < (16 << 20), f"{sent} bytes of one head were taken"
    with Conn(server) as s:
        s.sendall(get())
        assert s.answer()[0] == 200


def test_a_slow_or_silent_head_is_closed_after_the_timeout(server):
    with Conn(server) as slow, Conn(server) as silent, Conn(server) as kept:
        slow.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")      # and no more
        kept.sendall(get())
        assert kept.answer()[0] == 200
        kept.sendall(b"GET / HTTP/1.1\r\n")     # a later request on a kept-alive connection, cut short
        status, body = slow.answer()        # blocks until the server answers: TIMEOUT s
        assert status == 408 and json.loads(body)["error"]["code"] == "header_timeout"
        assert kept.answer()[0] == 408
        assert silent.recv(10) == b""           # connected, sent nothing: closed without an answer


def test_pipelined_requests_outlasting_the_timeout_are_answered(server):
    """A request queued behind another (its body unread until its turn) is not taken for the rest
    of an answered one, and its work may outlast the head timeout."""
    body = b"b" * (1 << 20)     # more than one read: the rest waits, unread, while the first is answered
    post = b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    with Conn(server) as s:
        s.sendall(get() + post)
        answers = [s.answer() for _ in range(2)]
    assert [a[0] for a in answers] == [200, 200]
    assert json.loads(answers[1][1])["body"] == len(body)


def test_a_body_and_the_next_head_in_one_read_are_not_taken_for_a_long_head(server):
    """A pipelined request's body is not counted against the next request's head."""
    body = b"b" * (200 << 10)
    post = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    with Conn(server) as s:
        s.sendall(post + get(1000))
        first, second = s.answer(), s.answer()
    assert first[0] == 200 and json.loads(first[1])["body"] == len(body)
    assert second[0] == 200


def send_until_cut(s: Conn, limit: int) -> int:
    """Bytes of 64 KiB pieces sent before the server closed the connection (at most `limit`)."""
    sent, chunk = 0, b"a" * (64 << 10)
    try:
        while sent < limit:
            s.sendall(chunk)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent


def test_trailers_that_never_end_are_cut(server):
    """A chunked body's trailers are headers too: uvicorn read them without bound, after the head."""
    with Conn(server) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nX-T: ")
        sent = send_until_cut(s, 256 << 20)
        assert s.answer() == (0, b"")
    assert sent < (16 << 20), f"{sent} bytes of one trailer were taken"


def test_the_rest_of_a_refused_body_is_read_within_bounds(server):
    """Answered before its body was read, a request's rest is read and dropped (so a client that
    sends it all before it reads, as httpx does, gets its answer), but not without end."""
    body = b"b" * (8 << 20)
    with Conn(server) as s:
        s.sendall(b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert s.answer()[0] == 413
        s.sendall(get())                # and the connection goes on
        assert s.answer()[0] == 200
    # a third-party client that sends it all before reading (httpx, which the openai client uses)
    assert httpx.post(server.url + "/refuse", content=body, timeout=30).status_code == 413
    with Conn(server) as s:             # the rest trickles: closed once the timeout passes
        s.sendall(b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nbb")
        assert s.answer()[0] == 413
        assert s.answer() == (0, b"")   # blocks until the server closes: TIMEOUT s
    with Conn(server) as s:             # the rest never ends: closed past LINGER_BYTES
        s.sendall(b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (1 << 40))
        sent = send_until_cut(s, 4 << 30)
    assert sent < LINGER_BYTES + (16 << 20), f"{sent} bytes of a refused body were read"
