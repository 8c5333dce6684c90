"""The shape of a step, one strategy object: whether running decodes ride along in a prefill
step, and when prefills may join while decodes wait.

    Mixed(max_consecutive)        vLLM: decodes ride along in every step that admits or
                                  continues a prefill, within max_num_tokens (the default)
    PrefillFirst(max_consecutive) SGLang: a step is prefill-only or decode-only; prefill first,
                                  at most max_consecutive prefill steps in a row while decodes
                                  wait (0 = no limit)
    DecodeFirst(every)            LightLLM: prefills join only every `every` decode steps
    MultiStep(n)                  vLLM v0.6 --num-scheduler-steps: decodes run in windows of n
                                  steps that nothing joins; a window pays the fixed step
                                  overhead once (window_cost) and hands its tokens out at its end

The knobs users set (`--no-mixed-steps`, `--max-consecutive-prefill`,
`--decode-first-prefill-every`, `--multi-step`) select and configure one of
these (make_step_shape); DecodeFirst and MultiStep mix too unless mixed steps
are off. A step that cannot mix (an admission mode that never mixes, a
priority preemption due) is gated like a prefill-first one. Each strategy
counts its own steps (no clock).
"""
from __future__ import annotations

from shepherd.config import SchedulerConfig


class StepShape:
    name = ""
    windowed = False        # decode windows: the simulator's fast path steps them one by one

    def __init__(self, mixes: bool):
        self.mixes = mixes              # decodes may ride along in a prefill step
        self.consec_prefill = 0         # prefill steps in a row
        self.since_prefill = 0          # steps since the last prefill step
        self.continues_window = False   # the step being shaped continues a decode window

    def prefill_allowed(self, mixed: bool) -> bool:
        """May this step run prefills while decodes wait? (mixed: its decodes ride along)"""
        raise NotImplementedError

    def in_window(self, has_running: bool) -> bool:
        """The next step continues a decode window (nothing can join it)."""
        return False

    def begin(self, has_running: bool) -> None:
        self.continues_window = self.in_window(has_running)

    def done(self, prefilled: bool) -> None:
        """A step was shaped: with prefill chunks in it, or decodes only."""
        if prefilled:
            self.consec_prefill += 1
            self.since_prefill = 0
        else:
            self.consec_prefill = 0
            self.since_prefill += 1

    def skip(self, k: int) -> None:
        """k decode-only steps taken at once (the simulator's fast path)."""
        self.since_prefill += k
        self.consec_prefill = 0

    def window_cost(self, step_time: float, fixed_overhead: float) -> float:
        """What the step just shaped costs, given its modelled time and the fixed per-step
        overhead in it: the hook the simulator's clock calls."""
        return step_time


class PrefillFirst(StepShape):
    name = "prefill-first"

    def __init__(self, max_consecutive: int, mixes: bool = False):
        super().__init__(mixes)
        self.max_consecutive = max_consecutive

    def prefill_allowed(self, mixed: bool) -> bool:
        m = self.max_consecutive
        return m == 0 or self.consec_prefill < m or mixed


class Mixed(PrefillFirst):
    name = "mixed"

    def __init__(self, max_consecutive: int):
        super().__init__(max_consecutive, mixes=True)


class DecodeFirst(StepShape):
    name = "decode-first"

    def __init__(self, every: int, mixes: bool):
        super().__init__(mixes)
        self.every = every

    def prefill_allowed(self, mixed: bool) -> bool:
        return self.since_prefill >= self.every


class MultiStep(StepShape):
    name = "multi-step"
    windowed = True

    def __init__(self, n: int, mixes: bool):
        super().__init__(mixes)
        self.n = n

    def prefill_allowed(self, mixed: bool) -> bool:
        # windows are counted from the last prefill step, so a request that arrives mid-window
        # waits for the window's end even if nothing waited at its start. The prefill step
        # itself is one step of prefills alone, outside any window (since_prefill 0 admits
        # again): vLLM v0.6.0, chunked prefill off, schedules no decodes beside a prefill and
        # gives prefills no lookahead slots, so the engine does not cache that batch as a
        # window; the next schedule() opens the window
        return self.since_prefill % self.n == 0

    def in_window(self, has_running: bool) -> bool:
        return self.since_prefill % self.n != 0 and has_running

    def window_cost(self, step_time: float, fixed_overhead: float) -> float:
        # the scheduler runs and the inputs are prepared once per window (the fixed overhead,
        # paid at its first step); every token of every request still goes through output
        # processing, so the per-request term stays
        return max(0.0, step_time - fixed_overhead) if self.continues_window else step_time


def make_step_shape(cfg: SchedulerConfig) -> StepShape:
    if cfg.decode_first_prefill_every > 0:
        return DecodeFirst(cfg.decode_first_prefill_every, mixes=cfg.mixed_steps)
    if cfg.multi_step > 1:
        return MultiStep(cfg.multi_step, mixes=cfg.mixed_steps)
    if cfg.mixed_steps:
        return Mixed(cfg.max_consecutive_prefill)
    return PrefillFirst(cfg.max_consecutive_prefill)
