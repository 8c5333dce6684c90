"""The engine core as the server sees it: intake, the step loop, one message per step.

    served = build_served_core(cfg)              # engine/build.py: executor, scheduler, EngineCore
    run_loop(served, recv, send)                 # until a SHUTDOWN item arrives

The loop is the same whether the core runs in a thread of the server process
(`Engine`, tests and in-process benchmarks) or in a process of its own
(`CoreProcessEngine`, `shepherd serve`): only `recv` and `send` differ.

    recv(timeout) -> list of intake items      # timeout None = block until something comes
    send(CoreStep)                             # one message per step: every request's new tokens

Each iteration drains the intake (adds, aborts, finishes), runs one
EngineCore.step on the wall clock, and sends one CoreStep. Nothing in here
grows with the number of streams beyond the scheduler's own work and building
the outputs: detokenisation, stop strings and SSE are the front's (output.py).
When there is nothing to do the loop blocks in recv; it never spins.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import logging
import operator
import os
import sys
import threading
import time
from typing import Any, Callable, NamedTuple, Optional

from shepherd.engine.core import EngineCore
from shepherd.engine.metrics import StepLogger
from shepherd.request import FinishReason, Request, RequestOutput, TokenLogprob
from shepherd.scheduler.scheduler import QueueFull, RequestRejected, SchedulerStats
from shepherd.step import ExecutorFull

logger = logging.getLogger("shepherd.engine")

WATCHDOG_EXIT_CODE = 70  # EX_SOFTWARE

# intake items (tuples: cheap to pickle)
ADD, ABORT, FINISH, SHUTDOWN = "add", "abort", "finish", "shutdown"
# LoRA adapters at run time: (LORA_LOAD, (op_id, name, path)), (LORA_UNLOAD, (op_id, name)); each
# is answered in CoreStep.answers as (op_id, None) or (op_id, (kind, message, 0.0)) with kind
# "lora_bad" (400), "lora_unknown" (404), "lora_busy" (409) or "lora_off" (400)
LORA_LOAD, LORA_UNLOAD = "lora_load", "lora_unload"
# vLLM's reset_prefix_cache: (RESET_PREFIX_CACHE, op_id), answered (op_id, None) once the cache is
# empty but for the blocks running requests use (RadixCache.reset); the KV events of the reset
# (AllBlocksCleared, then the kept blocks) go out with this iteration's batch
RESET_PREFIX_CACHE = "reset_prefix_cache"


class CoreOutput(NamedTuple):
    """What one step produced for one request. On the wire it is a plain tuple in this field
    order (a NamedTuple pickles several times slower: benchmarks/ipc_cost.py); the front
    reads it back with CoreOutput._make."""
    req_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: Optional[str]
    error: Optional[str]
    completion_tokens: int
    cached_tokens: int
    queue_time: Optional[float]     # arrival -> first admission, on the request's first output only
    prompt_logprobs: Optional[list]  # RequestOutput.prompt_logprobs: with the first token, when asked


# SchedulerStats travels as a plain tuple of its fields in this order: pickled as a dataclass it
# carries every field's name in every message (900 bytes a step against 210), and the server
# process unpickles one per step, which at one stream is a step per token.
STATS_FIELDS = tuple(f.name for f in dataclasses.fields(SchedulerStats))
_stats_values = operator.attrgetter(*STATS_FIELDS)


def stats_to_wire(st: SchedulerStats) -> tuple:
    return _stats_values(st)


def stats_from_wire(values: tuple) -> SchedulerStats:
    return SchedulerStats(*values)


class CoreStep(NamedTuple):
    """One message from the core to the front: all of one iteration."""
    answers: list[tuple]            # (req_id, None) accepted | (req_id, (kind, message, retry_after))
    outputs: list[tuple]            # CoreOutput fields, as plain tuples
    stats: tuple                    # SchedulerStats fields (stats_to_wire); the front reads stats_from_wire
    step_time: Optional[float]      # executor time of the step, None when no step ran
    generated: int
    lora_loads: tuple = ()          # seconds of each LoRA adapter load (host -> adapter slot) since the last
    grammar_bytes: int = 0          # the executor's compiled grammars held for requests, bytes (after this turn)


class CoreInfo(NamedTuple):
    """What the front needs to know about the core once it is built."""
    kv_capacity: int
    host_kv_capacity: int
    max_model_len: int
    eos_token_ids: tuple
    model_name: str
    lora_adapters: tuple = ()       # (name, path) of the adapters served at start (--lora-modules)
    lora_enabled: bool = False      # adapters can be loaded at run time


class ServedCore:
    """An EngineCore behind the server: intake items in, CoreOutput tuples out."""

    def __init__(self, core: EngineCore, info: CoreInfo, tokenizer: Any, log_every_steps: int,
                 kv_events: Any = None):
        self.core = core
        self.scheduler = core.scheduler
        self.info = info
        self.tokenizer = tokenizer
        self.kv_events = kv_events                    # KVEventPublisher (vLLM's ZMQ stream), when configured
        self.step_logger = StepLogger(log_every_steps)
        self.last_stats = self.scheduler.stats()
        self.last_step = None                          # the last EngineCore Step (sim/host_profile.py times its parts)
        self._reqs: dict[str, Request] = {}
        self._first: set[str] = set()                  # requests that have not produced a token yet
        # requests whose grammar the executor is still compiling: outside the scheduler, so no
        # step waits for a compile; admitted (or rejected) once executor.grammar_ready says so
        self._parked: dict[str, Request] = {}
        # the executor's adapter loads of the last step (seconds each), for shepherd:lora_load_seconds
        self.lora_loads: tuple[float, ...] = ()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._parked)

    # ---------------------------------------------------------------- intake
    def intake(self, items: list, now: float) -> tuple[list, list[tuple]]:
        """Adds, aborts, finishes and control ops -> (answers to the adds and ops, abort terminals)."""
        answers: list = []
        outs: list[tuple] = []
        for kind, arg in items:
            if kind == ADD:
                req: Request = arg
                req.arrival = min(req.arrival, now)
                if req.adapter is not None and req.adapter not in self.core.executor.lora_names():
                    # unloaded after the front checked the name (items arrive in order)
                    answers.append((req.req_id, ("rejected", f"no LoRA adapter named {req.adapter!r} is loaded",
                                                 0.0)))
                elif req.params.grammar is not None:    # admitted below once its grammar is compiled
                    self._parked[req.req_id] = req
                else:
                    self._admit(req, now, answers)
            elif kind == ABORT:
                if arg in self._parked:    # answered as accepted, then ended as aborted
                    req = self._parked.pop(arg)
                    answers.append((arg, None))
                    outs.append(self._output(req, [], [], True, FinishReason.ABORT.value, None))
                    continue
                self.scheduler.abort(arg, now)
                req = self._reqs.pop(arg, None)
                if req is not None:
                    self._release(req)
                    outs.append(self._output(req, [], [], True, FinishReason.ABORT.value, None))
            elif kind == FINISH:   # the front matched a stop string and has answered already
                self.scheduler.finish(arg, FinishReason.STOP, now)
                req = self._reqs.pop(arg, None)
                if req is not None:
                    self._release(req)
            elif kind in (LORA_LOAD, LORA_UNLOAD):
                answers.append((arg[0], self._lora_op(kind, *arg[1:])))
            elif kind == RESET_PREFIX_CACHE:
                freed, kept = self.scheduler.kv.reset_prefix_cache()
                logger.info("prefix cache reset: %d tokens freed, %d kept (in use by running requests)",
                            freed, kept)
                answers.append((arg, None))
        if self._parked:
            self._unpark(now, answers)
        return answers, outs

    def _admit(self, req: Request, now: float, answers: list) -> bool:
        """Whether the scheduler took `req`; the answer to its add is appended either way."""
        try:
            self.scheduler.add(req, now)
        except QueueFull as e:
            answers.append((req.req_id, ("full", str(e), float(e.retry_after or 1.0))))
            return False
        except RequestRejected as e:
            answers.append((req.req_id, ("rejected", str(e), 0.0)))
            return False
        self._reqs[req.req_id] = req
        self._first.add(req.req_id)
        answers.append((req.req_id, None))
        return True

    def _release(self, req: Request) -> None:
        """An ended request gives its compiled grammar back now, not with the next batch that runs
        (batch.finished: an idle engine runs none), so that the executor's bound on held grammars
        (ExecutorFull) counts only the requests in flight."""
        if req.params.grammar is not None:
            self.core.executor.drop_grammar(req.req_id)

    def _unpark(self, now: float, answers: list) -> None:
        """Admit the parked requests whose grammar is ready; reject those whose grammar failed."""
        for rid, req in list(self._parked.items()):
            try:
                if not self.core.executor.grammar_ready(rid, req.params.grammar):
                    continue
            except ExecutorFull as e:       # overload, as a full queue: 429 with Retry-After
                del self._parked[rid]
                answers.append((rid, ("full", str(e), float(e.retry_after))))
                continue
            except Exception as e:  # noqa: BLE001 - the server compiled it first; this request ends, not the core
                del self._parked[rid]
                answers.append((rid, ("rejected", f"cannot enforce the requested {req.params.grammar[0]}: {e}", 0.0)))
                continue
            del self._parked[rid]
            if not self._admit(req, now, answers):
                self.core.executor.drop_grammar(rid)      # refused: the executor never sees it

    # ------------------------------------------------------------------ LoRA adapters
    def _lora_op(self, kind: str, name: str, path: Optional[str] = None) -> Optional[tuple]:
        """Load or unload an adapter between steps: None, or the (kind, message, 0.0) error."""
        ex = self.core.executor
        if not ex.lora_enabled:
            return ("lora_off", "this server serves no LoRA adapters: start it with --enable-lora "
                                "(or --lora-modules)", 0.0)
        if kind == LORA_LOAD:
            from shepherd.model.lora import LoraError
            try:
                ex.register_lora(name, path)
            except LoraError as e:
                return ("lora_bad", f"cannot load LoRA adapter {name!r} from {path!r}: {e}", 0.0)
            return None
        if name not in ex.lora_names():
            return ("lora_unknown", f"no LoRA adapter named {name!r} is loaded", 0.0)
        # the documented rule (docs/SERVING.md): refused while requests of it are in the system
        # (parked ones, waiting for their grammar, included)
        if any(r.adapter == name for r in self._parked.values()) or not self.scheduler.adapters.drop(name):
            return ("lora_busy", f"LoRA adapter {name!r} has requests in flight; unload it once they "
                                 "have finished", 0.0)
        ex.unregister_lora(name)
        return None

    def abort_all(self, now: float) -> list[tuple]:
        return self.intake([(ABORT, rid) for rid in list(self._reqs) + list(self._parked)], now)[1]

    def publish_kv_events(self) -> None:
        """Once per loop iteration: the prefix cache's changes go to the publisher's thread (a list
        handed over; hashing, encoding and sending never run on this thread)."""
        if self.kv_events is not None:
            self.kv_events.submit(time.time())

    def close(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()

    # ------------------------------------------------------------------ step
    def step(self) -> tuple[list[tuple], Optional[float], int]:
        """One EngineCore.step now: (outputs, executor step time or None, tokens generated).
        The scheduler's stats after a step that ran are kept in `self.last_stats`."""
        step = self.last_step = self.core.step(time.monotonic())
        outs = self._outputs(step.outputs)
        if not step.ran:
            return outs, None, 0
        generated = sum(len(o[1]) for o in outs)
        self.last_stats = self.scheduler.stats()     # a fresh snapshot: logged here, sent by the loop
        self.lora_loads = tuple(self.core.executor.take_lora_loads())
        self.step_logger.on_step(self.last_stats, step.end, generated)
        return outs, float(step.step_time or (step.end - step.start)), generated

    def _outputs(self, ros: list[RequestOutput]) -> list[tuple]:
        outs = []
        for o in ros:
            req = self._reqs.get(o.req_id)
            if req is None:
                continue
            reason = o.finish_reason.value if isinstance(o.finish_reason, FinishReason) else o.finish_reason
            if o.finished:
                del self._reqs[o.req_id]
                self._release(req)
            outs.append(self._output(req, o.new_token_ids, o.logprobs, o.finished, reason, o.error,
                                     o.prompt_logprobs))
        return outs

    def _output(self, req: Request, ids, lps, finished: bool, reason, error, plp=None) -> tuple:
        qt = None
        if (ids or finished) and req.req_id in self._first:
            self._first.discard(req.req_id)
            if req.admitted_at is not None:
                qt = max(0.0, req.admitted_at - req.arrival)
        return (req.req_id, list(ids), list(lps), finished, reason, error, len(req.output_ids),
                int(req.num_cached or 0), qt, plp)


def run_loop(served: ServedCore, recv: Callable[[Optional[float]], list], send: Callable[[CoreStep], None]) -> None:
    """The engine loop (see the module doc). Returns after a SHUTDOWN item, having aborted what was left."""
    stalled = False
    while True:
        if not served.has_work:
            served.step_logger.idle()
        # work exists but nothing could be scheduled last time: wait a little for an intake
        # item (an abort may free room) instead of spinning
        items = recv(None if not served.has_work else (0.01 if stalled else 0.0))
        now = time.monotonic()
        stop = any(kind == SHUTDOWN for kind, _ in items)
        items = [it for it in items if it[0] != SHUTDOWN]
        answers, outs = served.intake(items, now)
        if stop:
            outs += served.abort_all(now)
            served.publish_kv_events()
            served.close()
            send(CoreStep(answers, outs, stats_to_wire(served.scheduler.stats()), None, 0,
                          grammar_bytes=served.core.executor.grammar_bytes))
            return
        step_time, generated = None, 0
        if served.has_work:
            step_outs, step_time, generated = served.step()
            outs += step_outs
        served.publish_kv_events()
        stalled = not (answers or outs or step_time is not None or items)
        if not stalled:
            stats = served.last_stats if step_time is not None else served.scheduler.stats()
            send(CoreStep(answers, outs, stats_to_wire(stats), step_time, generated,
                          served.lora_loads if step_time is not None else (),
                          served.core.executor.grammar_bytes))


# ------------------------------------------------------------------ watchdog
def start_watchdog(core: EngineCore, timeout: float, on_fire: Callable[[float], None],
                   stop_evt: threading.Event) -> threading.Thread:
    """A thread that calls on_fire(elapsed) once if one executor step runs longer than `timeout`."""
    interval = min(1.0, max(0.01, timeout / 4))

    def watch():
        while not stop_evt.wait(interval):
            t0 = core.step_started
            if t0 is not None and time.monotonic() - t0 > timeout:
                on_fire(time.monotonic() - t0)
                return

    t = threading.Thread(target=watch, name="shepherd-watchdog", daemon=True)
    t.start()
    return t


def watchdog_exit(timeout: float) -> Callable[[float], None]:
    """The default watchdog action: dump every thread's stack and exit the process."""
    def fire(elapsed: float) -> None:
        msg = (f"shepherd watchdog: one engine step has run for {elapsed:.1f}s "
               f"(> --watchdog-timeout {timeout}s); dumping all thread stacks and exiting")
        logger.critical(msg)
        try:
            print(msg, file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        finally:
            os._exit(WATCHDOG_EXIT_CODE)
    return fire
