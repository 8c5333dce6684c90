"""Grammars are compiled in a worker process, on a time and size budget, before a request is queued.

A structured-output request is answered 400 when its grammar cannot be
enforced, before it reaches the engine. Finding that out means compiling it,
and compiling can take as long as the grammar likes: 10,000 `guided_choice`
strings took 13 s with xgrammar here as one alternation, a 5,000-value
json_schema enum 6.5 s (in this niced worker, under load). Both now compile
as a trie (model/grammar.py): the enum in 0.18-0.23 s against 3.3-3.5 s in
process (quiet, Intel Xeon family 6 model 207, 2 cores;
benchmarks/enum_compile.py). Other grammars can still be slow. So:

- a spec larger than `max_bytes` is refused at once (400 naming the limit);
- the rest is compiled by a worker process at a low priority, one spec at a
  time; one that has not compiled within `timeout` seconds is refused (400
  naming the limit) and the worker is killed and started again: a thread could
  not be stopped, and the compile would keep a core;
- verdicts are cached by spec (both ways), and the same spec asked for again
  while it compiles waits for that one compile;
- at most `max_waiting` specs wait for the worker; past that, 429.

The engine core compiles an accepted spec again for its own matchers, in a
background thread while the request waits outside the batch (model/grammar.py).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
from collections import OrderedDict, deque
from typing import Optional, Sequence

from shepherd.engine.pipe_io import FrameReader, PipeWriter
from shepherd.model.grammar import GrammarError, check_spec
from shepherd.server.common import APIError

log = logging.getLogger("shepherd.server")

Spec = tuple[str, str]


def _worker(conn, vocab: list[str], stop_ids: Sequence[int]) -> None:
    """The worker process: compile each spec received, answer None (compiled) or the error."""
    try:
        os.nice(10)
    except OSError:
        pass
    from shepherd.model.grammar import GrammarCompiler
    compiler = GrammarCompiler(vocab, stop_ids, cache_size=1)
    conn.send("ready")
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        try:
            compiler.compile(spec)
            conn.send(None)
        except GrammarError as e:
            conn.send(str(e))
        except Exception as e:  # noqa: BLE001 - anything xgrammar raises is the spec's fault
            conn.send(f"{type(e).__name__}: {e}")


class GrammarCheck:
    """The server's grammar verdicts: `await check(spec)` returns, or raises APIError 400/429."""

    def __init__(self, tokenizer, timeout: float, max_bytes: int, max_waiting: int = 8,
                 cache_size: int = 1024):
        from shepherd.model.grammar import encoded_vocab
        self.timeout, self.max_bytes, self.max_waiting = float(timeout), int(max_bytes), int(max_waiting)
        self._args = (encoded_vocab(tokenizer, tokenizer.vocab_size), tuple(tokenizer.eos_token_ids))
        self._verdicts: OrderedDict[Spec, Optional[str]] = OrderedDict()
        self._cache_size = cache_size
        self._inflight: dict[Spec, asyncio.Future] = {}
        self._lock: Optional[asyncio.Lock] = None
        self._waiting = 0
        self._proc = None
        self._conn = None
        self._ready = False
        self._reader: Optional[FrameReader] = None     # the pipe on the event loop (engine/pipe_io.py)
        self._writer: Optional[PipeWriter] = None
        self._inbox: deque = deque()

    # ------------------------------------------------------------------ worker
    def start(self) -> None:
        """Spawn the worker (it takes seconds to import xgrammar): at server start, off the request path."""
        if self._proc is not None and self._proc.is_alive():
            return
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(child,) + self._args, daemon=True,
                                 name="shepherd-grammar-check")
        self._proc.start()
        child.close()
        self._conn, self._ready = parent, False
        self._reader = self._writer = None
        self._inbox.clear()

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
            self._proc = None
        if self._writer is not None:
            self._writer.close()        # lets go of the fd before it is closed
            self._writer = None
        self._reader = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _attach(self) -> None:
        """The worker's pipe on the running loop, non-blocking: a spec larger than the socket buffer goes
        out as the worker reads it (a blocking send would hold the event loop until then), and its
        answer is taken whole from what has arrived."""
        if self._writer is None:
            self._reader = FrameReader(self._conn.fileno())
            self._writer = PipeWriter(asyncio.get_running_loop(), self._conn.fileno(), lambda err: None)

    async def _recv(self, timeout: Optional[float]):
        """The worker's next message, waiting on its pipe from the event loop; None on timeout."""
        if self._inbox:
            return ("msg", self._inbox.popleft())
        self._attach()
        loop = asyncio.get_running_loop()
        fd = self._conn.fileno()
        reader, got = self._reader, loop.create_future()

        def readable():
            if got.done():
                return
            try:
                self._inbox.extend(reader.read())       # whole messages only
            except OSError:
                got.set_result(("died", None))
                return
            if self._inbox:
                got.set_result(("msg", self._inbox.popleft()))
            elif reader.eof:
                got.set_result(("died", None))
        loop.add_reader(fd, readable)
        try:
            return await asyncio.wait_for(got, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            loop.remove_reader(fd)

    @property
    def ready(self) -> bool:
        """The worker has imported its compiler and takes specs."""
        return self._ready

    async def wait_ready(self, timeout: float = 120.0) -> bool:
        """Start the worker if needed and wait for its "ready" (imports take seconds); False if it did
        not come within `timeout` (the worker is stopped then, and the next compile starts another)."""
        self.start()
        if not self._ready:
            got = await self._recv(timeout)
            if got is None or got[0] != "msg":
                self.stop()
                return False
            self._ready = True
        return True

    async def _compile(self, spec: Spec) -> Optional[str]:
        if not await self.wait_ready():
            raise APIError(503, "the grammar compiler did not start", "server_error",
                           code="grammar_unavailable")
        self._attach()
        try:
            self._writer.send(spec)
        except OSError:
            pass                # a write failed: the worker is gone, and _recv sees its EOF
        got = await self._recv(self.timeout)
        if got is not None and got[0] == "msg":
            return got[1]
        self.stop()            # over the budget (or it died): it must not keep a core
        if got is None:
            return (f"the grammar did not compile within {self.timeout:g} s (--grammar-timeout); "
                    "make it smaller (fewer choices or enum values, simpler patterns)")
        return "the grammar compiler failed on this grammar"

    # ------------------------------------------------------------------ verdicts
    def _remember(self, spec: Spec, verdict: Optional[str]) -> None:
        self._verdicts[spec] = verdict
        while len(self._verdicts) > self._cache_size:
            self._verdicts.popitem(last=False)

    async def _run(self, spec: Spec) -> Optional[str]:
        """One compile, in its own task: a caller that goes away does not leave the pipe mid-answer."""
        try:
            if self._lock is None:
                self._lock = asyncio.Lock()
            try:
                await asyncio.wait_for(self._lock.acquire(), self.timeout * self.max_waiting)
            except asyncio.TimeoutError:
                raise APIError(429, "the grammar compiler is busy; retry later", "rate_limit_error",
                               code="grammar_queue_full", headers={"Retry-After": "1"}) from None
            try:
                verdict = await self._compile(spec)
            finally:
                self._lock.release()
            self._remember(spec, verdict)
            return verdict
        finally:
            self._waiting -= 1
            self._inflight.pop(spec, None)

    async def verdict(self, spec: Spec) -> Optional[str]:
        """None if `spec` compiles within the budget, else why not."""
        if spec in self._verdicts:
            self._verdicts.move_to_end(spec)
            return self._verdicts[spec]
        size = len(spec[1].encode("utf-8", "replace"))
        if size > self.max_bytes:
            return (f"the grammar is {size} bytes, more than the {self.max_bytes} allowed "
                    "(--max-grammar-bytes)")
        try:
            check_spec(spec)            # unsupported schema constructs: named without compiling
        except GrammarError as e:
            return str(e)
        task = self._inflight.get(spec)
        if task is None:
            if self._waiting >= self.max_waiting:
                raise APIError(429, f"too many grammars are waiting to be compiled ({self.max_waiting}); "
                                    "retry later", "rate_limit_error", code="grammar_queue_full",
                               headers={"Retry-After": "1"})
            self._waiting += 1
            task = self._inflight[spec] = asyncio.ensure_future(self._run(spec))
        return await asyncio.shield(task)

    async def check(self, spec: Spec, param: str) -> None:
        why = await self.verdict(spec)
        if why is not None:
            raise APIError(400, f"cannot enforce the requested {spec[0]}: {why}", param=param,
                           code="invalid_grammar")
