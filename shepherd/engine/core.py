"""The one engine step: schedule -> execute -> on_step, on a wall or a virtual clock.

    core = EngineCore(scheduler, executor, WallClock(executor.paced))   # serve (engine/build.py)
    core = EngineCore(scheduler, executor, VirtualClock())              # offline driver, calibrate,
                                                                        # the simulator's replicas
    step = core.step(now)     # Step: the batch, the outputs handed out, when it ran

Every driver calls this one method: the engine-core process (core_loop.py),
the offline driver (offline.py), the simulator's replica and calibrate. The
rules they used to write each their own way are kept here, once:

  - an empty batch (no sequences, no swaps) is not run: the executor is not
    called, the clock does not move, and the requests that ended wait in the
    scheduler for the next batch that runs (batch.finished); outputs made
    inside schedule() (a request that can never fit ends with an error) are
    still handed out;
  - a step that runs starts at clock.start(now) and ends at clock.end(start,
    step_time): on the wall clock the measured end (a paced executor's
    modelled time waited out first), on a virtual clock start + step_time;
    on_step sees the end;
  - inside a multi-step window (vLLM v0.6) the outputs are held and handed
    out together at the window's end, as vLLM processes a window's outputs
    after its last step;
  - with --max-prefill-ms-with-decodes set, every step that ran feeds its
    decode tokens, prompt tokens and end - start to the core's PrefillBudget
    (prefill_budget.py), and the scheduler is handed its token count before
    the next schedule(): one estimate for serve and the simulator alike.
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple, Optional, Protocol

from shepherd.engine.prefill_budget import PrefillBudget
from shepherd.request import RequestOutput
from shepherd.scheduler.scheduler import Scheduler
from shepherd.step import Executor, ScheduledBatch, StepResult


class Clock(Protocol):
    def start(self, now: float) -> float:
        """When the executor starts a batch scheduled at `now`."""

    def end(self, start: float, step_time: float) -> float:
        """When a step that started at `start` and took `step_time` (the executor's figure) ends."""


class WallClock:
    """The machine's monotonic clock. A paced executor (the simulated one behind `shepherd
    serve --executor sim`) takes as long on it as its modelled step time says."""

    def __init__(self, paced: bool = False):
        self.paced = paced

    def start(self, now: float) -> float:
        return time.monotonic()

    def end(self, start: float, step_time: float) -> float:
        if self.paced and step_time:
            left = step_time - (time.monotonic() - start)
            if left > 0:
                time.sleep(left)
        return time.monotonic()


class VirtualClock:
    """Time as the executor reports it: a step ends step_time after it starts. `charge`, when
    given, is what a step of that time costs on this clock (the simulator passes its step
    shape's window cost)."""

    def __init__(self, charge: Optional[Callable[[float], float]] = None):
        self.charge = charge

    def start(self, now: float) -> float:
        return now

    def end(self, start: float, step_time: float) -> float:
        return start + (self.charge(step_time) if self.charge is not None else step_time)


class Step(NamedTuple):
    batch: ScheduledBatch
    outputs: list[RequestOutput]     # handed out now (inside a multi-step window: none yet)
    start: float                     # when the executor started; == end when nothing ran
    end: float
    step_time: Optional[float]       # the executor's own figure; None when nothing ran
    scheduler_s: float               # wall seconds in schedule() + on_step() (calibrate fits them)
    schedule_s: float = 0.0          # of those, schedule()'s (sim/host_profile.py)

    @property
    def ran(self) -> bool:
        return self.step_time is not None


class EngineCore:
    """A scheduler and an executor stepped together (engine/build.py puts them together)."""

    def __init__(self, scheduler: Scheduler, executor: Executor, clock: Clock):
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        self.step_started: Optional[float] = None    # monotonic start of the execute in progress (watchdog)
        self.num_steps = 0
        self._held: list[RequestOutput] = []          # a multi-step window's outputs, until its end
        cfg = scheduler.cfg
        ms = cfg.max_prefill_ms_with_decodes
        self.prefill_budget = PrefillBudget(ms, cfg.max_num_tokens) if ms > 0 else None

    def step(self, now: float) -> Step:
        sched = self.scheduler
        t0 = time.perf_counter()
        budget = self.prefill_budget
        if budget is not None:
            sched.prefill_budget = budget.tokens
        batch = sched.schedule(now)
        if batch.empty:
            outs = self._hand_out(sched.on_step(batch, StepResult(), now), hold=False)
            t = time.perf_counter() - t0
            return Step(batch, outs, now, now, None, t, t)
        t1 = time.perf_counter()
        start = self.clock.start(now)
        self.step_started = time.monotonic()
        try:
            result = self.executor.execute(batch)
            end = self.clock.end(start, result.step_time)
        finally:
            self.step_started = None
        t2 = time.perf_counter()
        if budget is not None:
            budget.observe(*sched.last_work, end - start)
        outs = sched.on_step(batch, result, end)
        self.num_steps += 1
        outs = self._hand_out(outs, hold=sched.in_window)
        return Step(batch, outs, start, end, result.step_time, (t1 - t0) + (time.perf_counter() - t2), t1 - t0)

    def _hand_out(self, outs: list[RequestOutput], hold: bool) -> list[RequestOutput]:
        if hold:
            self._held.extend(outs)
            return []
        if self._held:
            outs, self._held = self._held + outs, []
        return outs
