"""A small HTTP/1.1 client for the gateway's hot path: keep-alive connection
pools per backend on plain asyncio streams.

Why not httpx for proxied requests: on this project's machines httpx's
AsyncClient needed 5-30 ms per request under 8-32 concurrent requests (its
connection pool and anyio layers), while a proxy must add well under a
millisecond. httpx is still used for health checks, metrics scrapes and
/v1/models, where that does not matter.

What it does: one request per connection at a time (no pipelining), body
framing by Content-Length, chunked transfer coding or connection close;
`Response.iter_raw()` yields the body as it arrives (one chunk of a chunked
body, or what one socket read returned), so SSE events go through one by
one. A connection goes back to the pool only when its response was read to
the end and both sides allow keep-alive; a response that is abandoned
(client gone, error) closes its connection. A request on a reused
connection that the server had already closed is retried once on a new one
(nothing of the response had arrived, so that is safe).

Timeouts: connect, and `read` as the longest wait for any bytes from the
server (headers or the next piece of body).
"""
from __future__ import annotations

import asyncio
import socket
import sys
import time
from typing import AsyncIterator, Optional
from urllib.parse import urlsplit

_HAS_TIMEOUT = sys.version_info >= (3, 11)


class UpstreamError(Exception):
    """Base class; `kind` is connect | timeout | protocol | closed."""
    kind = "protocol"


class ConnectError(UpstreamError):
    kind = "connect"


class UpstreamTimeout(UpstreamError):
    kind = "timeout"


class ProtocolError(UpstreamError):
    kind = "protocol"


class RemoteClosed(UpstreamError):
    kind = "closed"


async def _with_timeout(coro, timeout: Optional[float]):
    if timeout is None:
        return await coro
    if _HAS_TIMEOUT:
        try:
            async with asyncio.timeout(timeout):
                return await coro
        except TimeoutError:
            raise UpstreamTimeout(f"no data from the server in {timeout} s") from None
    try:
        return await asyncio.wait_for(coro, timeout)
    except asyncio.TimeoutError:
        raise UpstreamTimeout(f"no data from the server in {timeout} s") from None


class _Conn:
    __slots__ = ("reader", "writer", "key", "used", "idle_since")

    def __init__(self, reader, writer, key):
        self.reader, self.writer, self.key = reader, writer, key
        self.used = 0
        self.idle_since = 0.0

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:
            pass


class Response:
    def __init__(self, pool: "Http1Pool", conn: _Conn, status: int, reason: bytes, headers: list,
                 read_timeout: Optional[float], head_request: bool = False) -> None:
        self._pool, self._conn = pool, conn
        self.status_code = status
        self.reason = reason
        self.headers_raw = headers            # [(name, value)] as received (bytes)
        self._read_timeout = read_timeout
        self._done = False
        self._closed = False
        te = self.header(b"transfer-encoding")
        cl = self.header(b"content-length")
        self._keep_alive = (self.header(b"connection") or b"").lower() != b"close"
        if head_request or status in (204, 304) or 100 <= status < 200:
            self._mode, self._remaining = "none", 0
        elif te is not None and b"chunked" in te.lower():
            self._mode, self._remaining = "chunked", 0
        elif cl is not None:
            try:
                self._remaining = int(cl)
            except ValueError:
                raise ProtocolError(f"bad Content-Length {cl!r}") from None
            self._mode = "length"
        else:
            self._mode, self._remaining = "close", 0
            self._keep_alive = False
        if self._mode in ("none",) or (self._mode == "length" and self._remaining == 0):
            self._done = True

    def header(self, name: bytes) -> Optional[bytes]:
        for k, v in self.headers_raw:
            if k.lower() == name:
                return v
        return None

    @property
    def content_type(self) -> str:
        v = self.header(b"content-type")
        return v.decode("latin-1") if v else ""

    async def iter_raw(self) -> AsyncIterator[bytes]:
        r, t = self._conn.reader, self._read_timeout
        try:
            if self._mode == "length":
                while self._remaining > 0:
                    data = await _with_timeout(r.read(min(self._remaining, 1 << 16)), t)
                    if not data:
                        raise RemoteClosed("server closed the connection mid-body")
                    self._remaining -= len(data)
                    yield data
            elif self._mode == "chunked":
                while True:
                    line = await _with_timeout(r.readuntil(b"\r\n"), t)
                    try:
                        size = int(line.split(b";", 1)[0].strip(), 16)
                    except ValueError:
                        raise ProtocolError(f"bad chunk size line {line[:40]!r}") from None
                    if size == 0:
                        while (await _with_timeout(r.readuntil(b"\r\n"), t)) != b"\r\n":   # trailers
                            pass
                        break
                    data = await _with_timeout(r.readexactly(size + 2), t)
                    yield data[:-2]
            elif self._mode == "close":
                while True:
                    data = await _with_timeout(r.read(1 << 16), t)
                    if not data:
                        break
                    yield data
            self._done = True
        except asyncio.IncompleteReadError:
            raise RemoteClosed("server closed the connection mid-body") from None
        except asyncio.LimitOverrunError:
            raise ProtocolError("chunk header too long") from None
        except (ConnectionError, OSError) as e:
            raise RemoteClosed(f"connection lost mid-body: {type(e).__name__}") from None
        finally:
            self.close()

    async def read(self) -> bytes:
        return b"".join([c async for c in self.iter_raw()])

    def close(self) -> None:
        """Give the connection back if the body was read to the end, else close it."""
        if self._closed:
            return
        self._closed = True
        if self._done and self._keep_alive:
            self._pool.release(self._conn)
        else:
            self._conn.close()


class Http1Pool:
    def __init__(self, connect_timeout: float = 2.0, read_timeout: Optional[float] = 120.0,
                 max_idle_per_host: int = 512, idle_expiry: float = 30.0) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle_per_host = max_idle_per_host
        self.idle_expiry = idle_expiry
        self._idle: dict = {}
        self._closed = False

    @staticmethod
    def split(url: str) -> tuple:
        u = urlsplit(url)
        if u.scheme != "http":
            raise ConnectError(f"only http:// backends are supported by the fast path: {url}")
        return (u.hostname or "127.0.0.1", u.port or 80)

    async def _connect(self, key) -> _Conn:
        host, port = key
        try:
            reader, writer = await _with_timeout(asyncio.open_connection(host, port, limit=1 << 20),
                                                 self.connect_timeout)
        except UpstreamTimeout:
            raise ConnectError(f"connect to {host}:{port} timed out") from None
        except OSError as e:
            raise ConnectError(f"connect to {host}:{port}: {e.strerror or e}") from None
        sock = writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        return _Conn(reader, writer, key)

    def _get_idle(self, key) -> Optional[_Conn]:
        lst = self._idle.get(key)
        now = time.monotonic()
        while lst:
            c = lst.pop()
            if c.reader.at_eof() or c.writer.is_closing() or now - c.idle_since > self.idle_expiry:
                c.close()
                continue
            return c
        return None

    def release(self, c: _Conn) -> None:
        if self._closed or c.writer.is_closing():
            c.close()
            return
        lst = self._idle.setdefault(c.key, [])
        if len(lst) >= self.max_idle_per_host:
            c.close()
            return
        c.idle_since = time.monotonic()
        lst.append(c)

    async def request(self, method: str, base_url: str, path: str, headers: list, body: bytes,
                      read_timeout: Optional[float] = -1.0) -> Response:
        """Send a request and read the status line and headers. `headers`:
        [(bytes, bytes)] without Host / Content-Length / Connection."""
        key = self.split(base_url)
        rt = self.read_timeout if read_timeout == -1.0 else read_timeout
        host_hdr = f"{key[0]}:{key[1]}".encode()
        parts = [method.encode(), b" ", path.encode(), b" HTTP/1.1\r\nHost: ", host_hdr,
                 b"\r\nContent-Length: ", str(len(body)).encode(), b"\r\n"]
        for k, v in headers:
            parts += [k, b": ", v, b"\r\n"]
        parts.append(b"\r\n")
        head = b"".join(parts)
        for attempt in (0, 1):
            conn = self._get_idle(key) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect(key)
            try:
                conn.writer.write(head + body if len(body) < 65536 else head)
                if len(body) >= 65536:
                    conn.writer.write(body)
                    await conn.writer.drain()
                raw = await _with_timeout(conn.reader.readuntil(b"\r\n\r\n"), rt)
            except asyncio.IncompleteReadError as e:
                conn.close()
                if reused and not e.partial:
                    continue             # a stale keep-alive connection: once more on a new one
                raise RemoteClosed("server closed the connection before answering") from None
            except (ConnectionError, OSError) as e:
                conn.close()
                if reused:
                    continue
                raise RemoteClosed(f"connection lost before the answer: {type(e).__name__}") from None
            except asyncio.LimitOverrunError:
                conn.close()
                raise ProtocolError("response headers too long") from None
            except BaseException:
                conn.close()
                raise
            conn.used += 1
            try:
                lines = raw[:-4].split(b"\r\n")
                status_line = lines[0].split(b" ", 2)
                status = int(status_line[1])
                reason = status_line[2] if len(status_line) > 2 else b""
                hdrs = []
                for ln in lines[1:]:
                    k, sep, v = ln.partition(b":")
                    if not sep:
                        raise ValueError(ln)
                    hdrs.append((k.strip(), v.strip()))
                return Response(self, conn, status, reason, hdrs, rt, head_request=(method == "HEAD"))
            except (ValueError, IndexError):
                conn.close()
                raise ProtocolError(f"bad response head {raw[:80]!r}") from None
            except ProtocolError:
                conn.close()
                raise
        raise RemoteClosed("server closed the connection before answering")

    async def aclose(self) -> None:
        self._closed = True
        for lst in self._idle.values():
            for c in lst:
                c.close()
        self._idle.clear()
