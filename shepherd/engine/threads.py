"""How many OpenMP threads the engine core uses, decided again as the machine's load changes.

Measured on this 2-core machine (benchmarks/threads_contention.py, docs/SERVING.md
"Threads on a shared machine"): with one thread per core and libgomp's default
spinning, a 32-token request took 0.32 s alone and 29.9 s beside one busy
process: a thread waiting at a barrier spins on its core while the partner it
waits for sits on the run queue behind the other process, at every one of the
hundreds of barriers a step has. Sleeping instead of spinning
(OMP_WAIT_POLICY=passive) survives the load but makes every step pay to wake
the team (0.51 s alone); one thread never waits for a partner (0.59 s beside
one or two busy processes) but leaves a core idle on a quiet machine.

So, unless --num-threads fixes the count, the core keeps one thread per core
while it has the cores, and drops to one thread while it does not:

  - every `window` seconds it reads how long its own threads (the main thread
    and OpenMP's workers, not its Python helpers) waited on a run queue
    against how long they ran (/proc/self/task/*/schedstat); a wait share
    above `contended` in two windows in a row means someone else holds the
    cores: one thread;
  - at one thread, when its CPUs were idle for at least `free` of one CPU's
    time in two windows in a row, the cores are back: all threads again;
  - inside a step (the model calls `between_layers` before each layer), every
    `probe` s it compares the process's CPU time with the wall time; at two
    looks in a row within one forward that found fewer than threads x
    (1 - `contended`) CPUs' worth, it reads its threads' run-queue waits at
    both, and when they waited more than `sharp` of the time in between, one
    thread at once, in the middle of the step. A quiet look costs a clock and
    a CPU-time read (~1 us); schedstat (~45 us) is read only when the CPUs
    were short. `sharp` (49 %) is above `contended`: 10-80 ms are noisier than
    0.5 s. Measured (benchmarks/threads_contention.py, stall_attacks.py
    --profile): 64 local openai streams, where two threads still win, had
    looks of 45-48 % (at 45 % the rule flapped and cost 14 % of their tok/s);
    the 413 attacks below, 50-62 %;
  - after such a drop the way back is looked for in windows of `recheck`
    (0.1 s), between steps and inside them: the first with `free` of a CPU
    idle brings all threads back.

Why the last rule: a burst of load shorter than two windows never met the
window rule, yet one step of it cost the most. Ten 10-15 MB bodies refused
with 413 (benchmarks/stall_attacks.py --profile) kept a core busy in the
attacking client for 0.5-0.7 s; the two-thread team waited 50-60 % of its
time for a CPU, and one decode step of ~25 ms took 0.39-0.63 s (every
barrier of the step waited for the partner thread behind the other process).
The governor's ticks come between steps, so it saw that step only when it
was over. At one thread the same attack left the steps at ~25 ms.
Where the model runs the layer stack in one C call (kernels.layer_stack, on
AVX-512F CPUs since 0f973e1, this Xeon too), the C call looks itself: every
`probe` s, at an op boundary (between layers, or between the ops of one: a
layer took 30-92 ms under the stall attacks, so looks at layer boundaries
came one or two layers into the step), each OpenMP thread's own CPU time (exact, where another thread's or
the process's lags by up to a scheduler tick) against the wall time, and it
returns to the hook only at a look where a thread got less than `least`
(0.65) of the wall, then at the next look whatever it finds; so a quiet step
runs as one call. Measured (benchmarks/step_time.py --watch probe, in
process, 10 ms looks): at 64 rows the least share was 0.72 at p1 and 0.96 at
p50 quiet, 0.45-0.47 at p75 beside one or two busy processes (every look
under 0.65), at one row 0.41-0.45 at p75 beside them. Served, 64 local
streams make the first 1-3 looks of most steps short (least 0.1-0.6 over
10-76 ms): the server and the local openai client working on the last
step's output (over 8.2 s: server 0.28 s CPU, the client 1.35 s, the engine
11.9 s). That is contention, but it ends inside
the step, and two threads still win there: the two-look rule ignores most of
it, and a drop it causes comes back at the next 0.1 s window with a CPU idle
(100-140 ms later, measured), where the two-window rule held one thread for
2-6 s (the cost of the rule on this path before: 2-10 % of 64 streams'
tok/s). SHEPHERD_GOVERNOR_MID_STEP=0 turns the mid-step rule off
(engine/core_proc.py mid_step_rule).

The stretch rule, in steps of at most `stretch_rows` (8) rows: under the stall attacks the
10 ms looks came 13-28 ms apart, so a one-row step ran at two threads for 42-73 ms beside the
attacker before the second look dropped one (docs/SERVING.md "Where the gap goes"). At a few
rows an op takes 0.02-0.4 ms (a temporary probe timing every op of the stack: in process at 1-8
rows, 23 of 99,291 ops took longer, 2 of 370 forwards had one of 3.2 ms or more), and a thread
taken off its CPU stretches the op it is in to a scheduler slice: the first such op of each
refused attack's gap took 3.2-12.1 ms. So the stack also looks at the op boundary right after
an op of `stretch` (4 ms) or more and returns there (kernels.StackWatch.stretch, StackLook.op).
At such a look in which a thread lost at least half of `stretch` of CPU, the governor drops to
one thread at once when more tasks besides the team's threads are runnable right then than the
machine has CPUs left beside the team (/proc/loadavg counts every CPU's; the team's threads all
run at a look, so such a task is one still waiting for a CPU: the attacking client was; on this
2-CPU machine, any other runnable task), or at the second such look within `pair` (50 ms); no /proc/self read
before it. A stretched op alone is not enough: a served quiet stream had an op of 3.2 ms or
more in 22 of 2,096 steps (bursts of other processes on the machine), and a variant dropping at
every such look had 7 and 12 drops in a quiet `one_stream_budget.py --rounds 3` (0 and 0
before) and 2.6 % fewer tok/s; with the runnable test, 1 and 2 drops in two such runs (before:
0, 0, 2 and 0 in four). Waiting for the second alone dropped 20-27 ms after the first under the
attacks: too late for 2x in about half the rows. A step of more rows never looks so: the 64-stream reason for two 10 ms looks holds there.

Measured wait shares: 7-8 % beside one busy process when the kernel placed
it well (the request then took 1.7x its quiet time at two threads), 39-52 %
beside two (one thread: 1.6x instead of 2.9x). The openai client of 64 local
streams keeps a busy server at 14-17 %, below `contended` (35 %): there
spinning threads still win (docs/BENCHMARKS.md).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

from shepherd.model.kernels import StackLook, StackWatch, Watch

log = logging.getLogger("shepherd.engine")


def thread_times(exclude: set) -> Optional[tuple[int, int]]:
    """(ns run, ns waited on a run queue), summed over this process's threads but `exclude`;
    None where the kernel does not say (no schedstat)."""
    run = wait = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        if int(tid) in exclude:
            continue
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                r, w, _ = f.read().split()
        except (OSError, ValueError):
            continue            # the thread ended meanwhile
        run, wait = run + int(r), wait + int(w)
    return run, wait


def runnable() -> Optional[int]:
    """Tasks (threads) running or waiting for a CPU on the whole machine now (/proc/loadavg's
    fourth field); None where the kernel does not say."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def cpu_idle(cpus: set) -> Optional[tuple[int, int]]:
    """(idle, total) jiffies of `cpus` since boot (/proc/stat)."""
    idle = total = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu") or line[3] == " ":
                    continue
                name, *vals = line.split()
                if int(name[3:]) in cpus:
                    nums = [int(v) for v in vals[:8]]
                    idle, total = idle + nums[3] + nums[4], total + sum(nums)
    except (OSError, ValueError, IndexError):
        return None
    return idle, total


class ThreadGovernor:
    """Call `tick()` after every engine step (cheap: it looks at the clock, and at /proc once a
    window); it calls `set_threads(n)` when the count should change."""

    def __init__(self, max_threads: int, set_threads: Callable[[int], None], window: float = 0.5,
                 contended: float = 0.35, free: float = 0.5, clock: Callable[[], float] = time.monotonic,
                 probe: float = 0.01, sharp: float = 0.49, cpu_clock: Callable[[], float] = time.process_time,
                 times: Optional[Callable[[], Optional[tuple[int, int]]]] = None, least: float = 0.65,
                 recheck: float = 0.1, idle: Optional[Callable[[set], Optional[tuple[int, int]]]] = None,
                 stretch: float = 0.004, stretch_rows: int = 8, pair: float = 0.05,
                 tasks: Callable[[], Optional[int]] = runnable, machine_cpus: Optional[int] = None):
        self.max_threads, self.set_threads = max_threads, set_threads
        self.least, self.recheck = least, recheck
        self.stretch, self.stretch_rows, self.pair = stretch, stretch_rows, pair
        self._stretched_at = -float("inf")     # the clock at the last stretch look
        # /proc/loadavg counts the runnable tasks of every CPU of the machine, not only ours: only
        # more of them than the machine has CPUs beside our threads means one waits for a CPU
        self._tasks, self._machine_cpus = tasks, machine_cpus or os.cpu_count() or 1
        self._idle_fn = idle or cpu_idle
        self._quick, self._dropped_at = False, 0.0   # after a mid-step drop: windows of `recheck` s
        self.window, self.contended, self.free, self.clock = window, contended, free, clock
        self.probe, self.sharp, self.cpu_clock = probe, sharp, cpu_clock
        self._times_fn = times or self._sample_times
        self.threads = max_threads
        self.cpus = os.sched_getaffinity(0)
        self._last = self.clock()
        self._times = self._times_fn()
        self._idle = self._idle_fn(self.cpus)
        self._streak = 0
        self.last_wait_share: Optional[float] = None     # for logs and tests
        self._look: tuple = (0.0, 0.0, None)   # the last mid-step look: clock, process CPU s, run/wait ns or None
        self.mid_step_drops = 0         # for logs and tests

    @staticmethod
    def _sample_times() -> Optional[tuple[int, int]]:
        main = threading.main_thread()
        helpers = {t.native_id for t in threading.enumerate() if t is not main and t.native_id}
        return thread_times(helpers)

    def tick(self) -> None:
        if self.max_threads < 2:
            return
        now = self.clock()
        if self._quick:
            if now - self._last >= self.recheck:
                self._recheck(now)
            return
        if now - self._last < self.window:
            return
        self._last = now
        times, idle = self._times_fn(), self._idle_fn(self.cpus)
        if times is None or idle is None or self._times is None or self._idle is None:
            return
        d_run, d_wait = times[0] - self._times[0], times[1] - self._times[1]
        d_idle, d_total = idle[0] - self._idle[0], idle[1] - self._idle[1]
        self._times, self._idle = times, idle
        if d_run + d_wait <= 0 or d_total <= 0:
            return
        share = d_wait / (d_run + d_wait)
        self.last_wait_share = share
        idle_cpus = len(self.cpus) * d_idle / d_total
        log.debug("engine threads %d: run-queue wait %.1f%%, %.2f CPUs idle", self.threads, 100 * share, idle_cpus)
        self.decide(share, idle_cpus)

    def _recheck(self, now: float) -> None:
        """One of the `recheck` s windows after a mid-step drop (between steps, or between layers
        at one thread): all threads again at once when `free` of a CPU stood idle in it."""
        self._last = now
        times, idle = self._times_fn(), self._idle_fn(self.cpus)
        if idle is None or self._idle is None:
            return
        d_idle, d_total = idle[0] - self._idle[0], idle[1] - self._idle[1]
        self._times, self._idle = times, idle
        if d_total <= 0 or len(self.cpus) * d_idle / d_total < self.free:
            return
        log.info("engine threads 1 -> %d (the cores are free again %.0f ms after a drop in a step: %.1f CPUs idle)",
                 self.max_threads, 1e3 * (now - self._dropped_at), len(self.cpus) * d_idle / d_total)
        self._quick, self._streak = False, 0
        self.threads = self.max_threads
        self.set_threads(self.max_threads)

    def between_layers(self, layer: int, look: Optional[StackLook] = None) -> Watch:
        """The model's hook before a layer of a forward (model/llama.py): the mid-step rule of
        the module doc. A look every `probe` s, the first at the forward's first layer (the time
        between two steps is not a step's). On the per-op paths (look None) it reads the
        process's CPU time itself; on the one-call layer stack the C call looks (each thread's
        own CPU time, kernels.StackLook) and returns only at a look where a thread got less than
        `least` of the wall, then once more at the next look, so that a quiet step runs as one
        call. Returns what the stack watches for next (kernels.StackWatch), or None at one
        thread once the short windows after a drop are over: nothing to look for (the model runs
        the rest in one call)."""
        if self.threads < 2:
            if not self._quick:
                return None
            now = self.clock()     # after a mid-step drop: its short windows go on inside the step
            if now - self._last >= self.recheck:
                self._recheck(now)
            if self.threads < 2:
                return StackWatch(max(0.0, self.recheck - (now - self._last)))
            self._look = (now, self.cpu_clock(), None)    # all threads again: looks from here
            return self._watch(False)
        now = self.clock()
        t0, cpu0, sched0 = self._look
        if look is not None:
            cpu, short = cpu0, look.least < self.least
        else:
            if layer and now - t0 < self.probe:
                return self._watch(sched0 is not None)   # called early: the per-op paths call every layer
            cpu = self.cpu_clock()
            short = layer > 0 and (cpu - cpu0) / (now - t0) < self.threads * (1.0 - self.contended)
        if look is not None and self.stretch > 0 and look.op >= self.stretch \
                and (1.0 - look.least) * look.wall >= self.stretch / 2:
            # an op of a small step (0.02-0.4 ms quiet) took `stretch` or more and a thread lost
            # at least half that of CPU since the last look: one thread at once, without the 10 ms
            # looks' /proc test, when another task is runnable now (it still wants our CPUs) or
            # at the second such look within `pair` s; one alone, the other task done (a burst of
            # a few ms from another process), goes on (the module doc: what each costs)
            apart, self._stretched_at = now - self._stretched_at, now
            others = self._tasks()
            others = None if others is None else others - self.threads   # ours all run at a look
            if apart <= self.pair or (others is not None and others > self._machine_cpus - self.threads):
                self._stretched_at = -float("inf")
                why = (f"a second op of {1e3 * look.op:.1f} ms {1e3 * apart:.0f} ms after the first"
                       if apart <= self.pair else f"an op of {1e3 * look.op:.1f} ms and {others} other task(s) "
                       "runnable after it")
                return self._drop(now, self._times_fn(), f"{why}, the least thread got {look.least:.2f} of the last "
                                  f"{1e3 * look.wall:.0f} ms", look.cpus)
        sched = self._times_fn() if short else None
        self._look = (now, cpu, sched)
        if sched is None or sched0 is None:
            if look is not None:
                log.debug("engine threads %d, layer %d: stack look over %.1f ms, least thread %.2f, %.2f CPUs%s",
                          self.threads, layer, 1e3 * look.wall, look.least, look.cpus, " (short)" if short else "")
            return self._watch(short)
        d_run, d_wait = sched[0] - sched0[0], sched[1] - sched0[1]
        share = d_wait / (d_run + d_wait) if d_run + d_wait > 0 else 0.0
        if look is not None:
            log.debug("engine threads %d, layer %d: stack look over %.1f ms, least thread %.2f, %.2f CPUs, "
                      "run-queue wait %.0f%% since the last", self.threads, layer, 1e3 * look.wall, look.least,
                      look.cpus, 100 * share)
        if share <= self.sharp:
            return self._watch(True)
        cpus = look.cpus if look is not None else (cpu - cpu0) / (now - t0)
        return self._drop(now, sched, f"over the last {1e3 * (now - t0):.0f} ms our threads waited "
                          f"{100 * share:.0f}% of the time for a CPU", cpus)

    def _drop(self, now: float, sched: Optional[tuple[int, int]], why: str, cpus: float) -> StackWatch:
        """One thread, in the middle of a step; the short windows after it look for the way back."""
        self.mid_step_drops += 1
        log.info("engine threads %d -> 1 in a step (the cores are shared: %s, the process got %.1f CPUs)",
                 self.threads, why, cpus)
        self.threads, self._streak = 1, 0
        self.set_threads(1)
        # the way back is measured in windows of `recheck` s, inside steps too, until one finds
        # `free` of a CPU idle: contention that ended within the step (at 64 local streams, the
        # server's and the client's work on the last step's output; measured: it spans 1-3 looks
        # at the start of a step) gets the threads back at once, not after two 0.5 s windows
        self._last, self._times, self._idle = now, sched, self._idle_fn(self.cpus)
        self._dropped_at, self._quick = now, True
        return StackWatch(self.recheck)

    def _watch(self, short: bool) -> StackWatch:
        """The stack's next watch: after a short look, return at the next look whatever it finds
        (two in a row); else only at a look where a thread got less than `least` of the wall."""
        return StackWatch(self.probe, None if short else self.least, self.stretch,
                          self.stretch_rows if self.stretch > 0 else 0)

    def decide(self, wait_share: float, idle_cpus: float) -> None:
        """One window's figures: the share of time our threads waited for a CPU, and how many of
        our CPUs stood idle on average."""
        move = wait_share > self.contended if self.threads > 1 else idle_cpus >= self.free
        self._streak = self._streak + 1 if move else 0
        if self._streak < 2:
            return
        self._streak = 0
        new = 1 if self.threads > 1 else self.max_threads
        log.info("engine threads %d -> %d (%s: run-queue wait %.0f%% of our threads' time, %.1f CPUs idle)",
                 self.threads, new, "the cores are shared" if new == 1 else "the cores are free again",
                 100 * wait_share, idle_cpus)
        self.threads = new
        self.set_threads(new)
