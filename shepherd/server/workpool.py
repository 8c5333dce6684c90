"""Work that grows with a request's size runs here, not on the event loop.

Tokenizing a long prompt, rendering a long chat, decoding a long token list
and encoding a long answer (logprobs) take time in proportion to their size.
On the event loop that time freezes every other request and /health; in an
unbounded thread pool, a few such requests take every core from the engine.
So the work runs in one worker thread at a lower priority (Linux: nice is
per thread), small jobs run inline (a thread hop costs more than they do),
and the queue is bounded both ways: at most `max_waiting` jobs wait, and a
job that could not start within `wait_budget` seconds is refused with 429
(Retry-After) instead of growing the line.

The tokenizer releases the GIL while it works (measured: a 1M-character
encode in a thread left the event loop's longest pause at 49 ms), so the
loop keeps serving while the worker runs. Python code in the worker gives
the GIL up every switch interval (5 ms); one long C call does not, which
is why answers are encoded a slice at a time (common.json_pieces).
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from shepherd.model.grammar import lower_thread_priority
from shepherd.server.common import APIError

INLINE_COST = 20_000        # characters or tokens: below this a job runs inline
MESSAGE_COST = 64           # a chat message's (or Responses input item's) share of the work, in characters


class WorkPool:
    def __init__(self, workers: int = 1, max_waiting: int = 16, wait_budget: float = 10.0):
        self.workers, self.max_waiting, self.wait_budget = workers, max_waiting, wait_budget
        self._pool: Optional[ThreadPoolExecutor] = None
        self._slots: Optional[asyncio.Semaphore] = None
        self._waiting = 0

    async def run(self, fn: Callable[..., Any], *args, cost: int = INLINE_COST, may_refuse: bool = True) -> Any:
        """fn(*args), inline when `cost` is small, else in the worker. Raises APIError 429 when
        the worker's queue is full or the job could not start within the wait budget, unless
        `may_refuse` is False: an answer the engine has already computed waits its turn instead
        (refusing it then would throw the work away)."""
        if cost < INLINE_COST:
            return fn(*args)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="shepherd-work",
                                            initializer=functools.partial(lower_thread_priority, 5))
            self._slots = asyncio.Semaphore(self.workers)
        if not may_refuse:
            await self._slots.acquire()
        else:
            if self._waiting >= self.max_waiting:
                raise self._busy(f"{self.max_waiting} large requests are already waiting to be prepared")
            self._waiting += 1
            try:
                await asyncio.wait_for(self._slots.acquire(), self.wait_budget)
            except asyncio.TimeoutError:
                raise self._busy(f"a large request could not start within {self.wait_budget:g} s") from None
            finally:
                self._waiting -= 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._slots.release()

    @staticmethod
    def _busy(why: str) -> APIError:
        return APIError(429, f"Server busy: {why}; retry later", "rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": "1"})

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
