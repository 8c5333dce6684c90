"""The engine the server talks to: async intake, streams out, abort, failure.

    engine = Engine(EngineConfig(...))          # core in a thread of this process (tests, benchmarks)
    engine = CoreProcessEngine(EngineConfig(...))   # core in a process of its own (`shepherd serve`)
    await engine.start()
    stream = await engine.submit(prompt_ids, SamplingParams(...), client="alice")
                                                # raises QueueFull (-> 429), RequestRejected (-> 400),
                                                # EngineDeadError (-> 503)
    async for out in stream:                    # EngineOutput deltas; the last one has finished=True
        ...
    engine.abort(req_id)                        # idempotent; KV is freed within one step
    await engine.stop()                         # aborts what is left, stops the core

Both share `EngineFront` (this module): it hands requests to the core, gets
one CoreStep per engine step back (core_loop.py), resolves admissions, turns token
ids into text with stop strings (output.py) and keeps the metrics. They differ
only in how items reach the core's loop and steps come back: a deque under a
Condition and loop.call_soon_threadsafe here; a pipe in core_client.py.

Failure behaviour. Every accepted request ends with exactly one terminal
EngineOutput (finished=True): stop, length, abort, or error. If the core
crashes (or its process dies), every pending request gets an error terminal
and the engine is marked dead (later submits raise EngineDeadError). If one
executor step runs longer than `watchdog_timeout` seconds, the watchdog dumps
the stacks of all threads (faulthandler) and exits the process with
WATCHDOG_EXIT_CODE: a hung server is worse than a restarted one.
"""
from __future__ import annotations

import asyncio
import collections
import copy
import itertools
import logging
import threading
import time
import uuid
from typing import Any, Callable, Optional

from shepherd.config import EngineConfig
from shepherd.engine.build import build_served_core
from shepherd.engine.core_loop import (ABORT, ADD, FINISH, LORA_LOAD, LORA_UNLOAD, RESET_PREFIX_CACHE, SHUTDOWN,
                                       WATCHDOG_EXIT_CODE, CoreInfo, CoreStep, run_loop, start_watchdog,
                                       stats_from_wire, watchdog_exit)
from shepherd.engine.metrics import EngineMetrics
from shepherd.engine.output import Backlog, EngineOutput, OutputProcessor, RequestStream, answer_admission
from shepherd.kv_events.hashing import BLOCK_SIZE
from shepherd.request import Request, SamplingParams
from shepherd.scheduler.scheduler import QueueFull, RequestRejected, SchedulerStats
from shepherd.step import Executor

logger = logging.getLogger("shepherd.engine")

__all__ = ["Engine", "EngineFront", "EngineOutput", "RequestStream", "EngineDeadError", "LoraOpError", "QueueFull",
           "RequestRejected", "WATCHDOG_EXIT_CODE"]


class EngineDeadError(RuntimeError):
    """The engine core has crashed or stopped; the server answers 503."""


class LoraOpError(ValueError):
    """A LoRA load or unload the core refused; `status` is the HTTP status the server answers."""
    STATUS = {"lora_bad": 400, "lora_off": 400, "lora_unknown": 404, "lora_busy": 409}

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind, self.status = kind, self.STATUS.get(kind, 400)


def _admission_error(err: tuple) -> BaseException:
    kind, message, retry_after = err
    if kind == "full":
        return QueueFull(message, retry_after)
    if kind == "rejected":
        return RequestRejected(message)
    return EngineDeadError(message)


class EngineFront:
    """What the server sees; subclasses deliver items to the core (`_send`) and feed `_on_step`."""

    def _init_front(self, cfg: EngineConfig, info: CoreInfo, tokenizer: Any, stats: SchedulerStats) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.kv_capacity = info.kv_capacity
        self.host_kv_capacity = info.host_kv_capacity
        self.max_model_len = info.max_model_len
        self.eos_token_ids = tuple(info.eos_token_ids)
        self.model_name = info.model_name
        self.metrics = EngineMetrics(self.model_name, lora=info.lora_enabled)
        # blocks in the sense of the KV events (16 tokens, whatever the allocation page size)
        self.metrics.set_cache_config(
            block_size=BLOCK_SIZE, num_gpu_blocks=info.kv_capacity // BLOCK_SIZE,
            num_cpu_blocks=info.host_kv_capacity // BLOCK_SIZE, cache_dtype=cfg.dtype,
            enable_prefix_caching=str(cfg.scheduler.prefix_cache).lower(), engine=0,
            kv_events=str(cfg.kv_events is not None and cfg.kv_events.enabled).lower())
        self.outputs = OutputProcessor(tokenizer, self.metrics, self.model_name)
        self._admitting: dict[str, tuple[RequestStream, Request]] = {}   # sent, not answered yet
        self._ids = itertools.count()
        self._dead: Optional[str] = None
        self._running = False
        self._stats = stats
        self.metrics.update_from_stats(self._stats)
        # LoRA adapters the core serves (name -> folder), as its answers to load/unload said
        self.lora_enabled = info.lora_enabled
        self.lora_adapters: dict[str, str] = dict(info.lora_adapters)
        self._lora_ops: dict[str, tuple[asyncio.Future, str, Optional[str]]] = {}
        self._resets: dict[str, asyncio.Future] = {}     # reset_prefix_cache ops sent, not answered yet

    # subclasses
    def _send(self, items: list) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    @property
    def dead_reason(self) -> Optional[str]:
        return self._dead

    def stats(self) -> SchedulerStats:
        """The scheduler stats after the last step the front has seen (a snapshot)."""
        return self._stats

    # ---------------------------------------------------------------- intake
    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{uuid.uuid4().hex[:16]}-{next(self._ids)}"

    def submit(self, prompt_ids: list[int], params: SamplingParams, req_id: Optional[str] = None,
               client: str = "default", priority: int = 0, adapter: Optional[str] = None,
               backlog: Optional[Backlog] = None) -> RequestStream:
        """Hand a request to the core (call from the running event loop).

        Returns a RequestStream at once; `await` it to learn whether the scheduler
        accepted the request (raises QueueFull, RequestRejected, EngineDeadError),
        then iterate it. Raises EngineDeadError right away if the engine is not running,
        ValueError if `req_id` names a request still in flight.
        adapter: the name of a loaded LoRA adapter to run with (None: the base model).
        backlog: shared by the streams of one streamed answer: past its limit of unsent output
        the answer's requests are cut (output.Backlog)."""
        loop = asyncio.get_running_loop()
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not self._running:
            raise EngineDeadError("engine is not running")
        req_id = req_id or self.new_request_id()
        if req_id in self.outputs.tracks:
            # a second stream under a live id would take the first one's outputs
            raise ValueError(f"request id {req_id!r} is in flight already")
        req = Request(req_id=req_id, prompt_ids=list(prompt_ids), params=params, arrival=time.monotonic(),
                      client=client or "default", priority=int(priority or 0),
                      eos_token_ids=self.eos_token_ids, adapter=adapter)
        stream = RequestStream(self, req_id, loop, backlog)
        self._admitting[req_id] = (stream, req)
        self.outputs.track(req, stream)
        self._send([(ADD, req)])
        return stream

    def abort(self, req_id: str) -> None:
        """Idempotent; unknown or finished ids are ignored."""
        if self._dead is not None or not self._running:
            return
        self._send([(ABORT, req_id)])

    async def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter folder `path` as `name` from the next step on (LoraOpError)."""
        await self._lora_op(LORA_LOAD, name, path)

    async def unload_lora(self, name: str) -> None:
        """Stop serving `name`; refused (LoraOpError, 409) while requests of it are in flight."""
        await self._lora_op(LORA_UNLOAD, name)

    async def _lora_op(self, kind: str, name: str, path: Optional[str] = None) -> None:
        if self._dead is not None or not self._running:
            raise EngineDeadError(self._dead or "engine is not running")
        op = self.new_request_id("lora")
        fut = asyncio.get_running_loop().create_future()
        self._lora_ops[op] = (fut, name, path)
        self._send([(kind, (op, name) if path is None else (op, name, path))])
        await fut

    async def reset_prefix_cache(self) -> None:
        """vLLM's reset_prefix_cache: returns once the core has emptied its prefix cache but for
        the blocks running requests use (they stay valid and cached: RadixCache.reset), and
        the reset's KV events (AllBlocksCleared first) are on their way to the publisher."""
        if self._dead is not None or not self._running:
            raise EngineDeadError(self._dead or "engine is not running")
        op = self.new_request_id("reset")
        fut = asyncio.get_running_loop().create_future()
        self._resets[op] = fut
        self._send([(RESET_PREFIX_CACHE, op)])
        await fut

    def _lora_answer(self, op: str, err) -> None:
        fut, name, path = self._lora_ops.pop(op)
        if err is not None:
            if not fut.done():
                fut.set_exception(LoraOpError(err[0], err[1]))
            return
        if path is None:
            self.lora_adapters.pop(name, None)
        else:
            self.lora_adapters[name] = path
        if not fut.done():
            fut.set_result(None)

    # -------------------------------------------------------- core -> front
    def _on_step(self, step: CoreStep) -> None:
        """One CoreStep, on the event loop."""
        now = time.monotonic()
        m = self.metrics
        for rid, err in step.answers:
            if rid in self._lora_ops:
                self._lora_answer(rid, err)
                continue
            fut = self._resets.pop(rid, None)
            if fut is not None:
                if not fut.done():
                    fut.set_result(None)
                continue
            pending = self._admitting.pop(rid, None)
            if pending is None:
                continue
            stream, req = pending
            if err is None:
                m.prompt_tokens.inc(len(req.prompt_ids))
                answer_admission(stream, None)
            else:
                self.outputs.forget(rid)
                answer_admission(stream, _admission_error(err))
        self._stats = stats_from_wire(step.stats)
        m.update_from_stats(self._stats)
        m.grammar_bytes.set(step.grammar_bytes)
        if step.step_time is not None:
            m.steps.inc()
            m.step_time.observe(step.step_time)
        if m.lora_load is not None:
            for s in step.lora_loads:
                m.lora_load.observe(s)
        finish = self.outputs.on_outputs(step.outputs, now)
        if finish and self._dead is None:
            self._send([(FINISH, rid) for rid in finish])

    def _on_dead(self, message: str, reason: str = "error") -> None:
        """The core is gone (crashed, killed, or stopped): end everything still pending, on the loop."""
        if self._dead is None or reason == "error":
            self._dead = message
        for stream, _ in self._admitting.values():
            answer_admission(stream, EngineDeadError(message))
        self._admitting.clear()
        for fut, _, _ in self._lora_ops.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(message))
        self._lora_ops.clear()
        for fut in self._resets.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(message))
        self._resets.clear()
        self.outputs.fail_all(message, time.monotonic(), reason=reason)


class Engine(EngineFront):
    """The core in a dedicated thread of this process (scheduler state is touched only there)."""

    def __init__(self, cfg: EngineConfig, executor: Optional[Executor] = None, tokenizer: Any = None,
                 on_watchdog: Optional[Callable[[float], None]] = None):
        self.served = build_served_core(cfg, executor, tokenizer)
        self.core = self.served.core
        self._init_front(cfg, self.served.info, self.served.tokenizer, copy.copy(self.core.scheduler.stats()))
        self._on_watchdog = on_watchdog or watchdog_exit(cfg.watchdog_timeout)
        self._cv = threading.Condition()
        self._intake: collections.deque = collections.deque()
        self._thread: Optional[threading.Thread] = None
        self._stop_evt = threading.Event()
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def executor(self):
        return self.core.executor

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    @property
    def alive(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        logger.info("KV cache: capacity %d tokens (host pool %d tokens), max_model_len %d, model %s, executor %s",
                    self.kv_capacity, self.host_kv_capacity, self.max_model_len, self.model_name,
                    self.cfg.executor)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="shepherd-engine", daemon=True)
        self._thread.start()
        if self.cfg.watchdog_timeout and self.cfg.watchdog_timeout > 0:
            start_watchdog(self.core, float(self.cfg.watchdog_timeout), self._on_watchdog, self._stop_evt)

    async def stop(self) -> None:
        if self._thread is None or not self._running:
            return
        self._send([(SHUTDOWN, None)])
        self._running = False
        await asyncio.to_thread(self._thread.join)
        self._on_dead("engine stopped", reason="abort")

    def _send(self, items: list) -> None:
        with self._cv:
            self._intake.extend(items)
            self._cv.notify()

    # ---------------------------------------------------------- engine thread
    def _recv(self, timeout: Optional[float]) -> list:
        with self._cv:
            if not self._intake and (timeout is None or timeout > 0):
                self._cv.wait(timeout)
                while timeout is None and not self._intake:
                    self._cv.wait()
            items = list(self._intake)
            self._intake.clear()
        return items

    def _deliver(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _run(self) -> None:
        try:
            run_loop(self.served, self._recv, lambda step: self._deliver(self._on_step, step))
        except BaseException as e:  # noqa: BLE001 - the engine must not hang its clients
            logger.exception("engine thread crashed")
            message = f"engine crashed: {type(e).__name__}: {e}"
            self._dead = message
            self._deliver(self._on_dead, message)
        finally:
            self._stop_evt.set()
