"""A tiny synchronous driver: EngineCore.step on a virtual clock until done.

    done = run_offline(scheduler, executor, requests, clock=0.0)
    done["r1"].output_ids, done["r1"].finish_reason, ...

Requests enter when the clock passes their `arrival` (sorted by arrival; the
clock jumps to the next arrival when nothing runs). `now` advances by the
step_time the executor reports (core.py's VirtualClock). A request the scheduler rejects
(RequestRejected) comes back FINISHED with FinishReason.ERROR and the reason in
`error`; one refused with QueueFull is retried at the next step (or, with
`reject_on_full=True`, ends like a rejected one).

Options:
  aborts={req_id: time}     abort a request once the clock reaches time
  observer=f                called as f(batch, outputs, t_start, t_end) after every step
  max_steps=N               safety net; raises RuntimeError when exceeded
Returns {req_id: Request} for every request given, each finished exactly once.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

from shepherd.engine.core import EngineCore, VirtualClock
from shepherd.request import FinishReason, Request, RequestState
from shepherd.scheduler.scheduler import QueueFull, RequestRejected, Scheduler
from shepherd.step import Executor


def run_offline(scheduler: Scheduler, executor: Executor, requests: Iterable[Request], clock: float = 0.0, *,
                aborts: Optional[dict[str, float]] = None,
                observer: Optional[Callable] = None,
                max_steps: int = 10_000_000,
                reject_on_full: bool = False) -> dict[str, Request]:
    core = EngineCore(scheduler, executor, VirtualClock())
    reqs = sorted(requests, key=lambda r: r.arrival)
    out: dict[str, Request] = {r.req_id: r for r in reqs}
    if len(out) != len(reqs):
        raise ValueError("duplicate req_id")
    now = clock
    i = 0
    pending: list[Request] = []          # refused with QueueFull, retried
    abort_at = sorted((t, rid) for rid, t in (aborts or {}).items())
    ai = 0
    ended: set[str] = set()
    steps = 0
    idle_steps = 0

    def _reject(r: Request, msg: str) -> None:
        r.state = RequestState.FINISHED
        r.finish_reason = FinishReason.ERROR
        r.error = msg
        r.finished_at = now
        ended.add(r.req_id)

    while True:
        # arrivals
        while i < len(reqs) and reqs[i].arrival <= now:
            pending.append(reqs[i])
            i += 1
        pending = _admit(scheduler, pending, now, _reject, reject_on_full)
        while ai < len(abort_at) and abort_at[ai][0] <= now:
            rid = abort_at[ai][1]
            ai += 1
            if scheduler.abort(rid, now) is not None:
                ended.add(rid)
        if not scheduler.has_work:
            if i < len(reqs):
                now = max(now, reqs[i].arrival)
                continue
            if pending:
                raise RuntimeError("requests refused with QueueFull while the scheduler is idle")
            break
        step = core.step(now)
        t0, now, batch, outs = now, step.end, step.batch, step.outputs
        for o in outs:
            if o.finished:
                assert o.req_id not in ended, f"{o.req_id} ended twice"
                ended.add(o.req_id)
        if observer is not None:
            observer(batch, outs, t0, now)
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"run_offline: more than {max_steps} steps")
        if batch.empty and not outs:
            idle_steps += 1
            if idle_steps > 1000:
                if i < len(reqs) or (ai < len(abort_at)):
                    # nothing can move until something arrives
                    nxt = [reqs[i].arrival] if i < len(reqs) else []
                    if ai < len(abort_at):
                        nxt.append(abort_at[ai][0])
                    now = max(now, min(nxt))
                    idle_steps = 0
                    continue
                raise RuntimeError("scheduler has work but makes no progress (stuck)")
        else:
            idle_steps = 0
    return out


def _admit(scheduler, pending: list[Request], now: float, reject: Callable[[Request, str], None],
           reject_on_full: bool) -> list[Request]:
    """Offer the waiting requests to the scheduler in arrival order; returns those to retry."""
    still: list[Request] = []
    for r in pending:
        if still:                # keep arrival order: once one is refused, the rest wait too
            still.append(r)
            continue
        try:
            scheduler.add(r, now)
        except RequestRejected as e:
            reject(r, str(e))
        except QueueFull as e:
            if reject_on_full:
                reject(r, f"queue full: {e}")
            else:
                still.append(r)
    return still
