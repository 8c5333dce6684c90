"""Whether a step may admit prefills: the step-shape rules the scheduler can follow.

SGLang: prefill first, at most `max_consecutive_prefill` prefill steps in a row
(0 = no limit); LightLLM: prefills join only every `decode_first_prefill_every`
decode steps; vLLM v0.6 (`multi_step` = N): decodes run in windows of N steps
and nothing joins inside one. Pure functions of the config and two counters
the scheduler keeps; no clock.
"""
from __future__ import annotations

from shepherd.config import SchedulerConfig


def prefill_allowed(cfg: SchedulerConfig, has_decode: bool, since_prefill: int, consec_prefill: int,
                    mixed: bool) -> bool:
    if not has_decode:
        return True
    if cfg.decode_first_prefill_every > 0:
        return since_prefill >= cfg.decode_first_prefill_every
    if cfg.multi_step > 1:
        # windows are counted from the last prefill step, so a request that arrives
        # mid-window waits for the window's end even if nothing waited at its start.
        # The prefill step itself is one step of prefills alone, outside any window
        # (since_prefill 0 admits again): vLLM v0.6.0, chunked prefill off, schedules no
        # decodes beside a prefill and gives prefills no lookahead slots, so the engine
        # does not cache that batch as a window; the next schedule() opens the window
        return since_prefill % cfg.multi_step == 0
    m = cfg.max_consecutive_prefill
    return m == 0 or consec_prefill < m or mixed


def in_window(cfg: SchedulerConfig, since_prefill: int, has_running: bool) -> bool:
    """multi_step > 1: the next step continues a decode window (nothing can join it); the
    simulator charges the fixed step overhead once per window and hands the window's tokens
    out at its end, as vLLM v0.6 does."""
    n = cfg.multi_step
    return n > 1 and since_prefill % n != 0 and has_running
