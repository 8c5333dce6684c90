"""The server's side of the engine-core process.

    engine = CoreProcessEngine(cfg, cpus=[0, 1])   # spawns the core, waits until it is built
    engine.on_dead = lambda reason: ...            # called once if the core dies or crashes
    await engine.start()                           # reads the pipe on the event loop
    ... same API as Engine (engine.py) ...
    await engine.stop()                            # SHUTDOWN, join; terminate/kill if it does not go

The pipe is read and written on the event loop (loop.add_reader / add_writer,
engine/pipe_io.py): no extra thread in the server process, so nothing there
competes with the core's cores for the GIL or the CPU except the HTTP work
itself. Intake items submitted in one event-loop turn go out as one message.
The loop never waits for the core: a message larger than the socket buffer
sent while the core is inside a step goes out as the core reads it, later
messages queue behind it, and the core's messages are taken whole from what
has arrived. The core's end is a plain blocking Connection (same wire format).

Failure: EOF on the pipe or a ("crash", message) from the core means the core
is gone; so does silence: with requests pending and no message from the core
for `watchdog_timeout + 10` s (the core's own watchdog could not fire: the
process is stopped, or stuck outside a step), the server kills it. Then every pending request gets an error terminal, /health turns 503
(`alive` is False) and `on_dead(reason)` is called (`shepherd serve` exits
non-zero with the reason).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import threading
import time
from typing import Callable, Optional

from shepherd.config import ConfigError, EngineConfig
from shepherd.engine.core_loop import SHUTDOWN, WATCHDOG_EXIT_CODE, CoreStep
from shepherd.engine.core_proc import core_main
from shepherd.engine.engine import EngineFront
from shepherd.engine.pipe_io import FrameReader, PipeWriter

logger = logging.getLogger("shepherd.engine")


class CoreStartError(ConfigError):
    """The core could not be built (bad model path, bad configuration, load failure)."""


class CoreProcessEngine(EngineFront):
    def __init__(self, cfg: EngineConfig, cpus: Optional[list[int]] = None, log_level: str = "info",
                 ready_timeout: float = 900.0):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=core_main, args=(child, cfg, log_level, cpus), name="shepherd-core",
                                daemon=True)
        self.proc.start()
        child.close()   # ours is closed: EOF on our end then means the core is gone
        self.on_dead: Optional[Callable[[str], None]] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_tid: Optional[int] = None
        self._outbox: list = []
        self._reader: Optional[FrameReader] = None     # the pipe on the loop, from start() on
        self._writer: Optional[PipeWriter] = None
        self._lock = threading.Lock()
        self._last_recv = time.monotonic()
        self._sent_at: Optional[float] = None    # oldest send not answered by a message yet
        self.hang_grace = float(cfg.watchdog_timeout or 0) + 10.0
        msg = self._wait_ready(ready_timeout)
        _, info, tokenizer, stats = msg
        self._init_front(cfg, info, tokenizer, stats)

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid

    def _wait_ready(self, timeout: float):
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                self._kill()
                raise CoreStartError(f"the engine core did not start: {self._exit_reason()}")
        try:
            msg = self._conn.recv()
        except EOFError:
            self._kill()
            raise CoreStartError(f"the engine core did not start: {self._exit_reason()}") from None
        if msg[0] != "ready":
            self.proc.join(10)
            self._kill()
            raise CoreStartError(msg[2])
        return msg

    @property
    def unsent_bytes(self) -> int:
        """Bytes sent to the core that its socket has not taken yet (it reads between two steps)."""
        return self._writer.pending_bytes if self._writer is not None else 0

    @property
    def alive(self) -> bool:
        return self._dead is None and self._running and self.proc.is_alive()

    async def start(self) -> None:
        if self._running or self._dead is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_tid = threading.get_ident()
        logger.info("KV cache: capacity %d tokens (host pool %d tokens), max_model_len %d, model %s, executor %s, "
                    "engine core pid %d", self.kv_capacity, self.host_kv_capacity, self.max_model_len,
                    self.model_name, self.cfg.executor, self.proc.pid)
        # From here the loop owns the fd, non-blocking (uvloop's add_reader makes it so anyway, and
        # Connection.send/recv then fail part-way through a message larger than the socket buffer):
        # the core reads only between two steps, and a blocking send would hold the loop until then.
        fd = self._conn.fileno()
        self._reader = FrameReader(fd)
        self._writer = PipeWriter(self._loop, fd, self._on_write_error)
        self._loop.add_reader(fd, self._on_readable)
        self._running = True
        self._loop.call_later(1.0, self._check_hang)

    def _check_hang(self) -> None:
        if not self._running:
            return
        # the core answers every message it reads, and sends one per step while it has work
        now = time.monotonic()
        quiet = now - self._last_recv
        unanswered = now - self._sent_at if self._sent_at is not None else 0.0
        if unanswered > self.hang_grace or (quiet > self.hang_grace and (self._admitting or self.outputs.tracks)):
            self.proc.kill()
            self._core_failed(f"engine core hung: no message for {max(quiet, unanswered):.0f}s with "
                              "requests pending (killed)")
            return
        self._loop.call_later(1.0, self._check_hang)

    async def stop(self) -> None:
        if self._running:
            self._running = False
            self._flush()
            try:    # behind whatever the core has not read yet; it reads within a step
                self._writer.send([(SHUTDOWN, None)])
                await asyncio.wait_for(self._writer.drained(), 30)
            except (OSError, asyncio.TimeoutError):
                pass    # the core is gone or stuck: join, then terminate/kill
            await asyncio.to_thread(self.proc.join, 30)
            self._drain()   # the core's last message: abort terminals of what was left
        self._close("engine stopped")
        self._on_dead("engine stopped", reason="abort")

    # --------------------------------------------------------------- sending
    def _send(self, items: list) -> None:
        with self._lock:
            self._outbox.extend(items)
            if len(self._outbox) > len(items):
                return          # a flush is already scheduled
        if threading.get_ident() == self._loop_tid:
            self._loop.call_soon(self._flush)
        else:
            self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            items, self._outbox = self._outbox, []
        if not items or self._dead is not None:
            return
        if self._sent_at is None:
            self._sent_at = time.monotonic()
        try:
            self._writer.send(items)     # never waits: what the socket does not take goes out as the core reads
        except OSError:                  # the writer failed before (the core is gone)
            self._on_write_error(None)

    def _on_write_error(self, err: Optional[OSError]) -> None:
        if self._running:
            self._core_failed(None)

    # ------------------------------------------------------------- receiving
    def _on_readable(self) -> None:
        self._drain()

    def _drain(self) -> None:
        if self._reader is None or self._conn.closed:
            return
        try:
            msgs = self._reader.read()      # whole messages only; a half-arrived one waits for its rest
        except OSError:
            msgs = None
        for msg in msgs or ():
            if self._dead is not None:
                return
            self._last_recv, self._sent_at = time.monotonic(), None
            if type(msg) is CoreStep:
                self._on_step(msg)
            elif msg[0] == "crash":
                self._core_failed(msg[1])
        if msgs is None or self._reader.eof:
            if self._running:
                self._core_failed(None)
            else:
                self._unwatch()     # stopping: an fd at EOF stays readable, the loop would call us again and again

    def _core_failed(self, message: Optional[str]) -> None:
        if self._dead is not None:
            return
        self._running = False
        if message is None:
            self.proc.join(2)
            message = f"engine core process died: {self._exit_reason()}"
        logger.error("%s; failing every pending request", message)
        self._close(message)
        self._on_dead(message)
        if self.on_dead is not None:
            self.on_dead(message)

    def close(self) -> None:
        """Synchronous last resort (the server never started, or exits): the core process goes."""
        if not self._conn.closed:
            self._close("closed")

    # --------------------------------------------------------------- cleanup
    def _exit_reason(self) -> str:
        code = self.proc.exitcode
        if code is None:
            return "still running"
        if code == WATCHDOG_EXIT_CODE:
            return f"exit code {code} (watchdog: a step ran longer than --watchdog-timeout)"
        if code < 0:
            try:
                return f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def _close(self, why: str) -> None:
        self._unwatch()
        self._kill()
        if not self._conn.closed:
            self._conn.close()

    def _unwatch(self) -> None:
        """The loop lets go of the fd (before it is closed)."""
        if self._writer is not None:
            self._writer.close()
        if self._loop is not None and not self._conn.closed:
            try:
                self._loop.remove_reader(self._conn.fileno())
            except (ValueError, OSError, RuntimeError):
                pass

    def _kill(self) -> None:
        """Make sure the core process is gone (no orphan)."""
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
