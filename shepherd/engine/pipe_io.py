"""One end of a multiprocessing Pipe on an asyncio event loop: sends never block the loop, reads take whole messages.

    writer = PipeWriter(loop, conn.fileno(), on_error)   # the fd is made non-blocking
    writer.send(obj)             # framed at once; os.write what the socket takes, loop.add_writer for the rest
    await writer.drained()       # everything sent (stop: SHUTDOWN must reach the peer)
    reader = FrameReader(conn.fileno())
    for msg in reader.read(): ...     # in the loop's add_reader callback: complete messages only
    if reader.eof: ...                # the peer closed its end

Why: a blocking `Connection.send` of a message larger than the socket buffer
(~210 KB here: a 130 KB json_schema, a long prompt's token ids, many requests
in one flush) waits until the peer reads. The engine core reads only between
two steps, so the server's event loop (every other stream, /health) stood
still for up to a step. And a non-blocking `Connection` (uvloop's add_reader
makes the fd non-blocking) fails part-way through such a message. So the loop
side writes and reads the bytes itself, in `Connection`'s own wire format; the
peer (the engine-core process, the grammar worker) keeps a plain blocking
`Connection` in its own process.

The wire format is CPython's multiprocessing/connection.py (Connection.send,
_send_bytes, _recv_bytes, 3.11): the pickle of `ForkingPickler.dumps(obj)`,
behind a 4-byte big-endian signed length, or, above 0x7fffffff bytes, the
4-byte -1 and then an 8-byte big-endian unsigned length.
"""
from __future__ import annotations

import asyncio
import os
import pickle
import struct
from collections import deque
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Optional

_SMALL_MAX = 0x7fffffff
_HUGE = struct.pack("!i", -1)
_READ_SIZE = 1 << 18          # one read takes at most this much (a socket buffer's worth and more)


def frame(obj) -> bytes:
    """`obj` as `Connection.send(obj)` writes it: length header, then the pickle."""
    payload = ForkingPickler.dumps(obj)
    n = len(payload)
    header = struct.pack("!i", n) if n <= _SMALL_MAX else _HUGE + struct.pack("!Q", n)
    return b"".join((header, payload))


class PipeWriter:
    """Writes frames to a non-blocking fd from the event loop, in order, never waiting for the peer.

    What the socket does not take now stays queued and goes out from a
    loop.add_writer callback as the peer reads; a later send waits behind it.
    `on_error(exc)` is called once (on the loop) when a write fails: EPIPE,
    ECONNRESET (the peer is gone); the writer then drops what it holds.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, on_error: Callable[[OSError], None]):
        self._loop, self._fd, self._on_error = loop, fd, on_error
        os.set_blocking(fd, False)
        self._queue: deque[memoryview] = deque()
        self._pending = 0                 # bytes queued, not yet written
        self._watching = False            # loop.add_writer is on
        self._closed = False
        self._drained: Optional[asyncio.Future] = None

    @property
    def pending_bytes(self) -> int:
        """Bytes sent to this writer that the socket has not taken yet."""
        return self._pending

    def send(self, obj) -> None:
        if self._closed:
            raise BrokenPipeError("the pipe writer is closed (a write failed, or the pipe is being closed)")
        data = frame(obj)
        self._queue.append(memoryview(data))
        self._pending += len(data)
        if not self._watching:
            self._write()

    async def drained(self) -> None:
        """Returns when every byte sent has been written (or the writer failed or was closed)."""
        if not self._pending or self._closed:
            return
        if self._drained is None:
            self._drained = self._loop.create_future()
        await asyncio.shield(self._drained)

    def close(self) -> None:
        """Stop writing (before the fd is closed); what was not written is dropped."""
        if self._closed:
            return
        self._closed = True
        self._unwatch()
        self._queue.clear()
        self._pending = 0
        self._wake()

    def _write(self) -> None:
        try:
            while self._queue:
                head = self._queue[0]
                n = os.write(self._fd, head)
                self._pending -= n
                if n < len(head):
                    self._queue[0] = head[n:]
                    break
                self._queue.popleft()
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            self.close()
            self._on_error(e)
            return
        if self._queue and not self._watching:
            self._loop.add_writer(self._fd, self._write)
            self._watching = True
        elif not self._queue:
            self._unwatch()
            self._wake()

    def _unwatch(self) -> None:
        if self._watching:
            self._watching = False
            try:
                self._loop.remove_writer(self._fd)
            except (ValueError, OSError, RuntimeError):     # the loop or the fd is already closed
                pass

    def _wake(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None


class FrameReader:
    """Reads what a non-blocking fd holds and returns the complete messages in it, in order.

    recv on a non-blocking fd may see half a message (the peer's write of a
    large one is still under way): the bytes wait in a buffer until the rest
    comes. After the peer closes its end `eof` is True; a message cut short
    by that is an OSError, as in `Connection.recv`.
    """

    def __init__(self, fd: int):
        self._fd = fd
        os.set_blocking(fd, False)
        self._buf = bytearray()
        self.eof = False

    def read(self) -> list:
        while not self.eof:
            try:
                chunk = os.read(self._fd, _READ_SIZE)
            except (BlockingIOError, InterruptedError):
                break
            if not chunk:
                self.eof = True
                break
            self._buf += chunk
            if len(chunk) < _READ_SIZE:
                break                     # the socket is empty now: do not spin on a writer that keeps going
        msgs = self._messages()
        if self.eof and self._buf and not msgs:      # the whole messages before it are handed out first
            raise OSError("got end of file during message")
        return msgs

    def _messages(self) -> list:
        msgs, start, buf = [], 0, self._buf
        with memoryview(buf) as view:
            while len(buf) - start >= 4:
                (n,) = struct.unpack_from("!i", buf, start)
                head = 4
                if n < -1:
                    raise OSError(f"bad message header on the pipe: length {n}")
                if n == -1:
                    if len(buf) - start < 12:
                        break
                    (n,) = struct.unpack_from("!Q", buf, start + 4)
                    head = 12
                end = start + head + n
                if end > len(buf):
                    break
                with view[start + head:end] as payload:
                    msgs.append(pickle.loads(payload))
                start = end
        if start:
            del buf[:start]
        return msgs
