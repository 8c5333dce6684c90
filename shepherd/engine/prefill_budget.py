"""How many prompt tokens a step that carries running decodes may take, from a time budget and
the steps this engine has measured (`--max-prefill-ms-with-decodes MS`).

    budget = PrefillBudget(ms=30.0, max_tokens=2048)
    budget.observe(decode_tokens, prompt_tokens, seconds)   # EngineCore.step, after each step that ran
    budget.tokens          # PROBE_TOKENS until a prefill has been measured; then in [floor, max_tokens]

Why a time and not a token count. The running streams wait for every step; what a burst of
admissions costs them is the time its prompt tokens add to the step they ride in. A token cap
(`--max-prefill-tokens-with-decodes N`) fitted to one machine is wrong on the next: 32 prompt
tokens add ~40 ms to a step on the 2-core CPU this was measured on, and next to nothing on a GPU,
where a 32-token step costs about what a 512-token one does. A time (MS) means the same thing on
both; the token count is derived from the machine's own steps.

What is measured. EngineCore.step is the one step every driver calls (serve's core process on
the wall clock; offline, calibrate and the simulator's replicas on a virtual clock), so the same
estimate runs in serve and in the simulator. Each step that ran reports its decode tokens d (a
decode row and its drafts), its computed prompt tokens p (prefix-cache hits excluded) and its
time. Two small fits, O(1) a step:

  - decode-only steps (p = 0) fit t = a + b*d by least squares over exponentially weighted sums
    (DECODE_KEEP a step: the last ~20 decode steps count). With one row count only (one stream)
    b is not identified and the weighted mean is the prediction for that count.
  - a step with prompt tokens adds e = t - (a + b*d) over the decode-only step it would have been;
    the prompt-token cost is c = sum(e) / sum(p) over such steps, weighted by PREFILL_KEEP a step
    (the last ~10 count). A ratio of sums rather than a mean of per-step ratios: a 3-token step's
    e is mostly noise, a 300-token step's is mostly signal, and the sums weight them so.
  - budget = floor(MS / c), clamped to [FLOOR_TOKENS, max_tokens]: a cap always lets a prompt
    make progress, and never exceeds the step's own token budget.

The GPU case. Where steps are nearly flat in prompt tokens, e is small (and of both signs) and
c comes out small or negative: MS / c is then past max_tokens, and the cap is max_tokens, which
is no cap. Above a roofline knee the average slope c is below the marginal one, so the estimate
errs toward a larger budget, never toward throttling a flat machine.

Noise. One step many times slower than predicted (another process took the core, a page fault,
the first call of a new shape) must not collapse the budget: a decode-only sample is clipped to
OUTLIER x its prediction, and a prefill excess to OUTLIER x what c predicts for it (or one
predicted decode step, whichever is more, so a c near zero can still grow). A lasting change (the
thread governor down to one thread) still moves the estimate: every sample pulls it up to OUTLIER
x the old value, and the old samples fade within ~10 prefill steps.

Until a prefill is measured (MIN_PROMPT_TOKENS prompt tokens over steps whose decode-only time
is known) the count is PROBE_TOKENS: the first step that admits prompts beside decodes is a probe
whose time measures c, and the next step already has a budget. Why not "no cap until measured":
a server's first burst is exactly the case this is for (issue 31's enum row: the innocent
stream's second prompt is a prefix-cache hit of 1 token, so ten requests arrived before any
prompt token had been timed, and the uncapped 340-token step was the whole gap); on a flat
machine the probe costs one small extra step once, after which c is near zero.
The count grows at most GROWTH (2x) from one step with prompt tokens to the next, and falls at
once. One step is a noisy measure of c: 16 probe tokens add ~19 ms to a step on the 2-core CPU,
and a decode-only prediction raised by a busy spell (the stall table's earlier attacks slowed
the steps they rode in) left that step looking cheap, so the next count was 94 tokens, a 0.12 s
gap (3.7x), where 16-26 was right; a flat machine reaches max_num_tokens from 16 in 7 such
steps. The scheduler never sees any of this: it reads the number (Scheduler.prefill_budget),
as it reads its config.
"""
from __future__ import annotations

import math
from typing import Optional

FLOOR_TOKENS = 8          # the smallest budget: a prompt always makes progress beside decodes
PROBE_TOKENS = 16         # the count before any prompt token was timed: a step that measures c
DECODE_KEEP = 0.95        # weight kept per decode-only step (~20 steps remembered)
PREFILL_KEEP = 0.9        # weight kept per step with prompt tokens (~10 steps remembered)
MIN_DECODE_STEPS = 3      # decode-only steps before their time is predicted
MIN_PROMPT_TOKENS = 8     # prompt tokens seen beside a known decode time before a budget is given
OUTLIER = 2.0             # a sample counts at most this many times its prediction
GROWTH = 2.0              # the count at most doubles from one prompt step to the next; it falls at once


class PrefillBudget:
    """The prompt tokens a step that carries decodes may take so that they add about `ms`
    milliseconds to it, from the step times observed. `tokens` is PROBE_TOKENS until known."""

    __slots__ = ("limit_s", "max_tokens", "floor", "tokens", "per_token_s",
                 "_w", "_sd", "_sdd", "_st", "_sdt", "_n_dec", "_se", "_sp")

    def __init__(self, ms: float, max_tokens: int, floor: int = FLOOR_TOKENS):
        if not (ms > 0 and math.isfinite(ms)):
            raise ValueError(f"ms must be a finite number > 0, got {ms!r}")
        self.limit_s = ms / 1000.0
        self.max_tokens = int(max_tokens)
        self.floor = max(1, min(int(floor), self.max_tokens))
        self.tokens = min(PROBE_TOKENS, self.max_tokens)    # the count handed to the scheduler
        self.per_token_s: Optional[float] = None # c: seconds a prompt token adds to a step
        # decode-only steps: weighted sums of 1, d, d^2, t, d*t
        self._w = self._sd = self._sdd = self._st = self._sdt = 0.0
        self._n_dec = 0
        # steps with prompt tokens: weighted sums of the excess time and the prompt tokens
        self._se = self._sp = 0.0

    def decode_time(self, d: int) -> Optional[float]:
        """Predicted seconds of a decode-only step of d decode tokens; None until known."""
        if self._n_dec < MIN_DECODE_STEPS:
            return None
        w = self._w
        mean_d = self._sd / w
        var_d = self._sdd / w - mean_d * mean_d
        mean_t = self._st / w
        if var_d < 0.25:
            return mean_t          # (nearly) one row count seen: its mean time, no slope
        b = (self._sdt / w - mean_d * mean_t) / var_d
        if b < 0.0:
            b = 0.0                # more rows never make a step faster; noise can say so
        # a line through steps of many rows can cross zero before d = 0 (a prefill-only step):
        # no step takes negative time, and a negative prediction would turn the excess's clip around
        return max(0.0, mean_t + b * (d - mean_d))

    def observe_decodes(self, decode_tokens: int, times) -> None:
        """Several decode-only steps of one batch, in order (the simulator's fast path, which
        takes them without EngineCore.step): the same as observing each."""
        for t in (times.tolist() if hasattr(times, "tolist") else times):
            self.observe(decode_tokens, 0, t)

    def observe(self, decode_tokens: int, prompt_tokens: int, seconds: float) -> int:
        """One step that ran; returns the budget after it (also `tokens`)."""
        d, p = decode_tokens, prompt_tokens
        if not (seconds >= 0.0 and math.isfinite(seconds)):
            return self.tokens
        pred = self.decode_time(d)
        if p <= 0:
            if d <= 0:
                return self.tokens       # swaps only: nothing to learn
            if pred is not None and seconds > OUTLIER * pred:
                seconds = OUTLIER * pred
            k = DECODE_KEEP
            self._w = self._w * k + 1.0
            self._sd = self._sd * k + d
            self._sdd = self._sdd * k + d * d
            self._st = self._st * k + seconds
            self._sdt = self._sdt * k + d * seconds
            self._n_dec += 1
            return self.tokens
        if pred is None:
            return self.tokens           # the decode-only time it adds to is not known yet
        e = seconds - pred
        if e < -pred:
            e = -pred
        c = self.per_token_s
        if c is not None:
            top = max(OUTLIER * c * p, pred)
            if e > top:
                e = top
        k = PREFILL_KEEP
        self._se = self._se * k + e
        self._sp = self._sp * k + p
        if self._sp < MIN_PROMPT_TOKENS:
            return self.tokens
        c = self.per_token_s = self._se / self._sp
        if c <= 0.0 or self.limit_s >= c * self.max_tokens:
            tokens = self.max_tokens    # flat in prompt tokens: no throttle
        else:
            # floor(MS / c), a hair of slack so that an exact quotient is not one short in binary
            tokens = max(self.floor, int(self.limit_s / c * (1 + 1e-9)))
        self.tokens = min(tokens, int(GROWTH * self.tokens))
        return self.tokens
