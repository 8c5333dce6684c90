"""The real serving loop: async intake, one engine thread, stream out, abort, watchdog.

    engine = Engine(EngineConfig(...))          # builds the executor (torch or sim) and the scheduler
    await engine.start()                        # starts the engine thread (and the watchdog)
    stream = await engine.submit(prompt_ids, SamplingParams(...), client="alice")
                                                # raises QueueFull (-> 429), RequestRejected (-> 400),
                                                # EngineDeadError (-> 503)
    async for out in stream:                    # EngineOutput deltas; the last one has finished=True
        ...
    engine.abort(req_id)                        # thread-safe, idempotent; KV is freed within one step
    await engine.stop()                         # aborts what is left, joins the thread

Threading model. The scheduler and the executor live in ONE dedicated engine
thread; scheduler state is touched only there. The asyncio side talks to it
through a thread-safe intake (a deque under a Condition): adds and aborts.
The engine thread answers each add through an asyncio Future (accepted or the
scheduler's exception) and streams RequestOutputs into a per-request
asyncio.Queue with loop.call_soon_threadsafe. When there is nothing to do the
thread blocks on the Condition; it never sleep-polls.

Iteration-level continuous batching: every step the engine drains the intake
(new requests join the very next schedule()), runs one batch, and hands the
sampled tokens to the scheduler, which finishes requests (EOS, stop ids,
max_tokens) and frees their KV in that same step.

Detokenisation is the engine's: one IncrementalDetokenizer per request. Stop
strings are searched in the accumulated text (so they are found when they span
tokens), cut from the output, and the request is finished with
Scheduler.finish(req_id, STOP). Text that could be the beginning of a stop
string is held back until it is known not to be one.

Failure behaviour. Every accepted request ends with exactly one terminal
EngineOutput (finished=True): stop, length, abort, or error. If the engine
thread crashes, every pending request gets an error terminal and the engine
is marked dead (later submits raise EngineDeadError). If one executor step
runs longer than `watchdog_timeout` seconds, the watchdog dumps the stacks of
all threads (faulthandler) and exits the process with WATCHDOG_EXIT_CODE: a
hung server is worse than a restarted one.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import faulthandler
import itertools
import logging
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from shepherd.config import EngineConfig
from shepherd.step import StepResult
from shepherd.engine.metrics import EngineMetrics, StepLogger
from shepherd.request import FinishReason, Request, RequestOutput, SamplingParams, TokenLogprob
from shepherd.scheduler.scheduler import QueueFull, RequestRejected, Scheduler, SchedulerStats

logger = logging.getLogger("shepherd.engine")

WATCHDOG_EXIT_CODE = 70  # EX_SOFTWARE

__all__ = ["Engine", "EngineOutput", "RequestStream", "EngineDeadError", "QueueFull", "RequestRejected",
           "WATCHDOG_EXIT_CODE"]


class EngineDeadError(RuntimeError):
    """The engine thread has crashed or stopped; the server answers 503."""


@dataclass
class EngineOutput:
    """One delta of one request, as streamed to the server.

    text / token_ids / logprobs are what is new since the previous output.
    The last output of a request has finished=True and a finish_reason
    ("stop", "length", "abort" or "error"; error carries a message).
    Usage counts are cumulative and present on every output.
    """
    req_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    error_kind: Optional[str] = None      # "request" (this request cannot be served) | "engine" (engine failed)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    stop_reason: Optional[Any] = None     # the stop string or stop token id that ended it (vLLM's field)

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class RequestStream:
    """One request's EngineOutputs: awaitable (admission) and async-iterable (deltas).

        stream = await engine.submit(...)   # waits until the scheduler accepted it (or raises)
        async for out in stream: ...        # ends after the terminal output
        async for out in engine.submit(...): ...   # also fine: admission is awaited first

    Leaving the iteration early does not abort by itself: call `abort()` (the
    server does so in a finally on every exit path)."""

    def __init__(self, engine: "Engine", req_id: str, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.req_id = req_id
        self.loop = loop
        self.queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self.finished = False
        self.admitted: asyncio.Future = loop.create_future()

    async def wait_admitted(self) -> "RequestStream":
        """Raises QueueFull, RequestRejected or EngineDeadError; a cancelled waiter aborts the request."""
        try:
            await asyncio.shield(self.admitted)
        except asyncio.CancelledError:
            self.engine.abort(self.req_id)
            raise
        return self

    def __await__(self):
        return self.wait_admitted().__await__()

    def __aiter__(self):
        return self

    async def __anext__(self) -> EngineOutput:
        if self.finished:
            raise StopAsyncIteration
        if not self.admitted.done() or self.admitted.exception() is not None:
            await self.wait_admitted()
        out = await self.queue.get()
        if out.finished:
            self.finished = True
        return out

    def abort(self) -> None:
        if not self.finished:
            self.engine.abort(self.req_id)

    # engine thread -> loop
    def _put(self, out: EngineOutput) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, out)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class _Track:
    """Engine-thread bookkeeping of one request: detokeniser and stop strings."""

    __slots__ = ("req", "stream", "detok", "text", "sent", "checked", "stops", "max_stop", "stop_ids",
                 "done", "t_last", "first", "matched", "stop_reason")

    def __init__(self, req: Request, stream: RequestStream, detok, stop_ids: set[int]):
        self.req = req
        self.stream = stream
        self.detok = detok
        self.text = ""          # generated text so far (cut at a stop string)
        self.sent = 0           # chars of text already streamed
        self.checked = 0        # chars of text already searched for stop strings
        self.stops = [s for s in req.params.stop if s]
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self.stop_ids = stop_ids
        self.done = False
        self.t_last: Optional[float] = None
        self.first = True
        self.matched = ""       # the stop string find_stop found
        self.stop_reason: Any = None

    def cut_at_stop(self, idx: int) -> None:
        """End the text at the stop string found at idx (keeping it when the request asks)."""
        keep = len(self.matched) if self.req.params.include_stop_str_in_output else 0
        self.text = self.text[:idx + keep]
        self.stop_reason = self.matched

    def find_stop(self) -> int:
        """Index in self.text where the earliest stop string starts, or -1."""
        if not self.stops:
            return -1
        start = max(0, self.checked - self.max_stop + 1)
        best = -1
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (best < 0 or i < best):
                best, self.matched = i, s
        self.checked = len(self.text)
        return best

    def holdback(self) -> int:
        """Chars at the end of the text that could start a stop string."""
        hold = 0
        avail = len(self.text) - self.sent
        for s in self.stops:
            for k in range(min(len(s) - 1, avail), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return hold


class _Add:
    __slots__ = ("req", "stream", "future", "loop")

    def __init__(self, req, stream, future, loop):
        self.req, self.stream, self.future, self.loop = req, stream, future, loop


def _answer(it: "_Add", exc: Optional[BaseException]) -> None:
    """Resolve an add's future from the engine thread (a closed loop is ignored)."""
    try:
        it.loop.call_soon_threadsafe(_resolve, it.future, exc)
    except RuntimeError:
        pass


def _resolve(fut: asyncio.Future, exc: Optional[BaseException]) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


class Engine:
    def __init__(self, cfg: EngineConfig, executor: Any = None, tokenizer: Any = None,
                 on_watchdog: Optional[Callable[[float], None]] = None):
        self.cfg = cfg
        if executor is None:
            executor, tokenizer = self._build_executor(cfg, tokenizer)
        elif tokenizer is None:
            tokenizer = getattr(executor, "tokenizer", None)
            if tokenizer is None:
                from shepherd.model.loader import load_tokenizer
                tokenizer = load_tokenizer(cfg.model)
        self.executor = executor
        self.tokenizer = tokenizer
        self._paced = bool(getattr(executor, "paced", False))
        self.kv_capacity = int(executor.kv_capacity)
        self.host_kv_capacity = int(getattr(executor, "host_kv_capacity", 0) or 0)
        self.max_model_len = int(executor.max_model_len)
        self.eos_token_ids = tuple(getattr(executor, "eos_token_ids", ()) or
                                   getattr(tokenizer, "eos_token_ids", ()) or ())
        self.model_name = getattr(executor, "model_name", None) or _model_name_from_path(cfg.model)
        self.model_name = str(self.model_name)
        sched_cfg = dataclasses.replace(cfg.scheduler, max_total_tokens=self.kv_capacity)
        if sched_cfg.max_total_tokens % sched_cfg.page_size:
            sched_cfg.max_total_tokens -= sched_cfg.max_total_tokens % sched_cfg.page_size
        sched_cfg.validate()
        self.scheduler = Scheduler(sched_cfg, host_kv_capacity=self.host_kv_capacity,
                                   max_model_len=self.max_model_len)
        self.metrics = EngineMetrics(self.model_name)
        self._step_logger = StepLogger(cfg.log_every_steps)
        self._on_watchdog = on_watchdog or self._watchdog_fire

        self._cv = threading.Condition()
        self._intake: collections.deque = collections.deque()
        self._tracks: dict[str, _Track] = {}        # engine thread only
        self._unanswered: list = []                 # engine thread only
        self._ids = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._watchdog_thread: Optional[threading.Thread] = None
        self._stop_evt = threading.Event()
        self._stopping = False
        self._dead: Optional[str] = None
        self._step_started: Optional[float] = None
        self._stats: SchedulerStats = self.scheduler.stats()
        self.metrics.update_from_stats(self._stats)
        self.num_steps = 0

    # ------------------------------------------------------------------ build
    @staticmethod
    def _build_executor(cfg: EngineConfig, tokenizer: Any):
        if cfg.executor == "sim":
            from shepherd.config import ModelConfig
            from shepherd.sim.sim_executor import SimExecutor
            if tokenizer is None:
                from shepherd.model.loader import load_tokenizer
                tokenizer = load_tokenizer(cfg.model)
            cap = int(cfg.max_total_tokens or cfg.scheduler.max_total_tokens)
            if cfg.host_kv_tokens:
                host = int(cfg.host_kv_tokens)
            else:
                host = cap if cfg.scheduler.preemption == "swap" else 0
            eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0
            ex = SimExecutor(kv_capacity=cap, host_kv_capacity=host,
                             max_model_len=min(ModelConfig().max_position_embeddings, cap),
                             eos_token_id=eos, vocab_size=tokenizer.vocab_size,
                             eos_token_ids=tuple(tokenizer.eos_token_ids), tokenizer=tokenizer,
                             model_name=_model_name_from_path(cfg.model), paced=True)
            return ex, tokenizer
        if cfg.executor == "torch":
            from shepherd.engine.torch_executor import TorchExecutor
            ex = TorchExecutor(cfg)
            return ex, tokenizer or ex.tokenizer
        raise ValueError(f"executor must be 'torch' or 'sim', got {cfg.executor!r}")

    # ------------------------------------------------------------- lifecycle
    @property
    def alive(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def dead_reason(self) -> Optional[str]:
        return self._dead

    async def start(self) -> None:
        if self._thread is not None:
            return
        logger.info("KV cache: capacity %d tokens (host pool %d tokens), max_model_len %d, model %s, executor %s",
                    self.kv_capacity, self.host_kv_capacity, self.max_model_len, self.model_name,
                    self.cfg.executor)
        self._thread = threading.Thread(target=self._run, name="shepherd-engine", daemon=True)
        self._thread.start()
        if self.cfg.watchdog_timeout and self.cfg.watchdog_timeout > 0:
            self._watchdog_thread = threading.Thread(target=self._watchdog, name="shepherd-watchdog",
                                                     daemon=True)
            self._watchdog_thread.start()

    async def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._stop_evt.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # ---------------------------------------------------------------- intake
    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{uuid.uuid4().hex[:16]}-{next(self._ids)}"

    def submit(self, prompt_ids: list[int], params: SamplingParams, req_id: Optional[str] = None,
               client: str = "default", priority: int = 0) -> RequestStream:
        """Hand a request to the engine thread (call from a running event loop).

        Returns a RequestStream at once; `await` it to learn whether the scheduler
        accepted the request (raises QueueFull, RequestRejected, EngineDeadError),
        then iterate it. Raises EngineDeadError right away if the engine is not running."""
        loop = asyncio.get_running_loop()
        req_id = req_id or self.new_request_id()
        req = Request(req_id=req_id, prompt_ids=list(prompt_ids), params=params, arrival=time.monotonic(),
                      client=client or "default", priority=int(priority or 0),
                      eos_token_ids=self.eos_token_ids)
        stream = RequestStream(self, req_id, loop)
        with self._cv:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            if self._stopping or self._thread is None:
                raise EngineDeadError("engine is not running")
            self._intake.append(_Add(req, stream, stream.admitted, loop))
            self._cv.notify()
        return stream

    def abort(self, req_id: str) -> None:
        """Thread-safe and idempotent; unknown or finished ids are ignored."""
        with self._cv:
            if self._dead is not None or self._thread is None:
                return
            self._intake.append(req_id)
            self._cv.notify()

    def stats(self) -> SchedulerStats:
        """The scheduler stats after the last step (a snapshot, safe from any thread)."""
        return self._stats

    # ----------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._intake and not self._stopping and not self.scheduler.has_work:
                        self._step_logger.idle()
                        self._cv.wait()
                    items = list(self._intake)
                    self._intake.clear()
                    stopping = self._stopping
                self._process_intake(items)
                if stopping:
                    self._abort_all()
                    break
                if self.scheduler.has_work:
                    self._step()
                else:
                    self._refresh_stats()
        except BaseException as e:  # noqa: BLE001 - the engine must not hang its clients
            logger.exception("engine thread crashed")
            self._fail_all(f"engine crashed: {type(e).__name__}: {e}")
        finally:
            self._stop_evt.set()

    def _process_intake(self, items: list) -> None:
        if not items:
            return
        now = time.monotonic()
        # adds not yet answered: if anything below raises, _fail_all answers them
        self._unanswered = [it for it in items if isinstance(it, _Add)]
        for it in items:
            if isinstance(it, _Add):
                try:
                    self.scheduler.add(it.req, now)
                except (QueueFull, RequestRejected) as e:
                    _answer(it, e)
                    continue
                self._tracks[it.req.req_id] = self._new_track(it.req, it.stream)
                self.metrics.prompt_tokens.inc(len(it.req.prompt_ids))
                _answer(it, None)
            else:
                out = self.scheduler.abort(it, now)
                tr = self._tracks.get(it)
                if tr is not None and not tr.done:
                    self._terminal(tr, FinishReason.ABORT.value, now)
                elif out is not None:
                    logger.debug("abort of untracked request %s", it)
        self._unanswered = []
        self._refresh_stats()

    def _new_track(self, req: Request, stream: RequestStream) -> _Track:
        from shepherd.model.tokenizer import IncrementalDetokenizer
        stop_ids = set(req.params.stop_token_ids or ())
        if not req.params.ignore_eos:
            stop_ids |= set(req.eos_token_ids)
        return _Track(req, stream, IncrementalDetokenizer(self.tokenizer, prompt_ids=req.prompt_ids), stop_ids)

    def _step(self) -> None:
        now = time.monotonic()
        batch = self.scheduler.schedule(now)
        if batch.empty and not batch.released:
            outs = self.scheduler.on_step(batch, StepResult(), now)
            self._handle_outputs(outs, now)
            self._refresh_stats()
            if not outs:
                # work exists but nothing could be scheduled this instant: wait for an
                # intake item (an abort may free room) instead of spinning.
                with self._cv:
                    if not self._intake and not self._stopping:
                        self._cv.wait(timeout=0.01)
            return
        t0 = self._step_started = time.monotonic()
        try:
            result = self.executor.execute(batch)
            if self._paced and result.step_time:
                # simulated executor: take as long as the cost model says the step takes
                left = result.step_time - (time.monotonic() - t0)
                if left > 0:
                    time.sleep(left)
        finally:
            self._step_started = None
        now = time.monotonic()
        self.num_steps += 1
        self.metrics.steps.inc()
        if result.step_time:
            self.metrics.step_time.observe(result.step_time)
        outs = self.scheduler.on_step(batch, result, now)
        generated = self._handle_outputs(outs, now)
        st = self._refresh_stats()
        self._step_logger.on_step(st, now, generated)

    def _refresh_stats(self) -> SchedulerStats:
        st = self.scheduler.stats()
        self._stats = st
        self.metrics.update_from_stats(st)
        return st

    # ------------------------------------------------------- outputs, detok
    def _handle_outputs(self, outs: list[RequestOutput], now: float) -> int:
        generated = 0
        for o in outs or ():
            tr = self._tracks.get(o.req_id)
            if tr is None or tr.done:
                continue
            generated += len(o.new_token_ids)
            self._on_output(tr, o, now)
        return generated

    def _on_output(self, tr: _Track, o: RequestOutput, now: float) -> None:
        req = tr.req
        reason = o.finish_reason.value if isinstance(o.finish_reason, FinishReason) else o.finish_reason
        if o.new_token_ids:
            self.metrics.generation_tokens.inc(len(o.new_token_ids))
            if tr.first:
                tr.first = False
                self.metrics.ttft.observe(max(0.0, now - req.arrival))
                if req.admitted_at is not None:
                    self.metrics.queue_time.observe(max(0.0, req.admitted_at - req.arrival))
            elif tr.t_last is not None:
                self.metrics.itl.observe(max(0.0, now - tr.t_last))
            tr.t_last = now
        ids: list[int] = []
        lps: list[TokenLogprob] = []
        stop_hit = False
        n = len(o.new_token_ids)
        for i, tid in enumerate(o.new_token_ids):
            ids.append(tid)
            if i < len(o.logprobs):
                lps.append(o.logprobs[i])
            final_stop_token = o.finished and reason == FinishReason.STOP.value and i == n - 1 \
                and tid in tr.stop_ids
            if final_stop_token and tid in (req.params.stop_token_ids or ()):
                tr.stop_reason = tid
            if not final_stop_token:
                tr.text += tr.detok.push(tid)
                idx = tr.find_stop()
                if idx >= 0:
                    tr.cut_at_stop(idx)
                    stop_hit = True
                    break
        if o.error is not None or reason == FinishReason.ERROR.value:
            self._emit(tr, ids, lps, now, finished=True, reason="error", error=o.error or "request failed",
                       error_kind="request")
            return
        finished = o.finished or stop_hit
        if finished and not stop_hit and reason != FinishReason.ABORT.value:
            try:
                tail = tr.detok.flush()
            except Exception:  # noqa: BLE001
                tail = ""
            if tail:
                tr.text += tail
                idx = tr.find_stop()
                if idx >= 0:
                    tr.cut_at_stop(idx)
                    stop_hit = True
        if stop_hit:
            if not o.finished:
                self.scheduler.finish(req.req_id, FinishReason.STOP, now)
            reason = FinishReason.STOP.value
        self._emit(tr, ids, lps, now, finished=finished, reason=reason if finished else None)

    def _emit(self, tr: _Track, ids, lps, now: float, finished: bool, reason: Optional[str],
              error: Optional[str] = None, error_kind: Optional[str] = None) -> None:
        end = len(tr.text) if finished else len(tr.text) - tr.holdback()
        text = tr.text[tr.sent:end] if end > tr.sent else ""
        tr.sent = max(tr.sent, end)
        if not finished and not text and not ids and not lps:
            return
        req = tr.req
        out = EngineOutput(req_id=req.req_id, text=text, token_ids=ids, logprobs=lps, finished=finished,
                           finish_reason=reason, error=error, error_kind=error_kind,
                           prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
                           cached_tokens=int(req.num_cached or 0),
                           stop_reason=tr.stop_reason if finished else None)
        if finished:
            tr.done = True
            self._tracks.pop(req.req_id, None)
            self.metrics.e2e.observe(max(0.0, now - req.arrival))
            self.metrics.request_success.labels(self.model_name, reason or "unknown").inc()
        tr.stream._put(out)

    def _terminal(self, tr: _Track, reason: str, now: float, error: Optional[str] = None,
                  error_kind: Optional[str] = None) -> None:
        """Finish a tracked request without new tokens (abort, engine error)."""
        tr.sent = len(tr.text)  # held-back text of an aborted request is dropped
        self._emit(tr, [], [], now, finished=True, reason=reason, error=error, error_kind=error_kind)

    def _abort_all(self) -> None:
        now = time.monotonic()
        for rid, tr in list(self._tracks.items()):
            try:
                self.scheduler.abort(rid, now)
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s during shutdown failed", rid)
            if not tr.done:
                self._terminal(tr, FinishReason.ABORT.value, now)
        self._refresh_stats()
        with self._cv:
            self._dead = self._dead or "engine stopped"
            leftover = list(self._intake)
            self._intake.clear()
        for it in leftover:
            if isinstance(it, _Add):
                _answer(it, EngineDeadError("engine stopped"))

    def _fail_all(self, message: str) -> None:
        with self._cv:
            self._dead = message
            leftover = list(self._intake)
            self._intake.clear()
        leftover = list(self._unanswered) + leftover
        self._unanswered = []
        now = time.monotonic()
        for it in leftover:
            if isinstance(it, _Add):
                _answer(it, EngineDeadError(message))
        for tr in list(self._tracks.values()):
            if not tr.done:
                try:
                    self._terminal(tr, "error", now, error=message, error_kind="engine")
                except Exception:  # noqa: BLE001
                    tr.done = True
                    tr.stream._put(EngineOutput(req_id=tr.req.req_id, finished=True, finish_reason="error",
                                                error=message, error_kind="engine"))
        self._tracks.clear()

    # --------------------------------------------------------------- watchdog
    def _watchdog(self) -> None:
        timeout = float(self.cfg.watchdog_timeout)
        interval = min(1.0, max(0.01, timeout / 4))
        while not self._stop_evt.wait(interval):
            t0 = self._step_started
            if t0 is not None and time.monotonic() - t0 > timeout:
                self._on_watchdog(time.monotonic() - t0)
                return

    def _watchdog_fire(self, elapsed: float) -> None:
        msg = (f"shepherd watchdog: one engine step has run for {elapsed:.1f}s "
               f"(> --watchdog-timeout {self.cfg.watchdog_timeout}s); dumping all thread stacks and exiting")
        logger.critical(msg)
        try:
            print(msg, file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        finally:
            os._exit(WATCHDOG_EXIT_CODE)


def _model_name_from_path(path: Optional[str]) -> str:
    try:
        from shepherd.model.loader import model_name_for
        return model_name_for(path)
    except Exception:  # noqa: BLE001
        pass
    if not path:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(path))
    for ext in (".gguf", ".safetensors"):
        if base.endswith(ext):
            base = base[: -len(ext)]
    return base or str(path)
