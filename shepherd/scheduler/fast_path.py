"""The simulator's fast path: k decode-only steps at once, same state as stepping.

    decode_horizon(sched, now, finishing=False) -> int
        k >= 0 such that, if nothing arrives or is aborted and no request stops
        early (EOS / stop id / stop string), the next k schedule() calls would
        each return the same decode-only batch (only positions advance): no
        admission or swap-in possible, no allocation that needs eviction or
        preemption, no forced (debug) preemption, no aging/policy change that
        could alter the batch. No max_tokens/max_model_len finish within the k
        steps; with finishing=True one is allowed at the k-th (the last) step,
        so the step that ends a request needs no schedule() of its own. 0 when
        the next step is anything else. Conservative: it may return less than
        the true value, never more.
    fast_forward(sched, k, tokens, now) -> list[RequestOutput]
        Apply k such steps at once (k <= decode_horizon(finishing=True)):
        tokens maps every running req_id to the k tokens it sampled. Same
        effect on state as k schedule()/on_step() pairs (KV slots, step
        counter, counters, new_token_ratio decay, VTC charges, stats, and the
        requests that end at the k-th step: max_tokens reached, or a stop id as
        their last token), and one RequestOutput per request carrying its k
        tokens. Raises ValueError if k exceeds the horizon or a token before
        the last would stop a request (then step normally). Requests that ended
        before reach the executor (batch.finished) with the next batch that
        runs, as they would have with the first of the k steps: the fast path
        executes nothing in between; so do the k steps' new slots.

Nothing here mirrors schedule(): the admission check after t decode steps is
the scheduler's own _admission_state(ahead=t), the examined candidates its own
_admission_order(), the page growth KVManager.grow() and the token bookkeeping
Scheduler._take_tokens(), all shared with the step-by-step path. This module
only proves that nothing but decodes can happen for k steps.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from shepherd.request import FinishReason, RequestOutput
from shepherd.scheduler.admission import Optimistic

if TYPE_CHECKING:
    from shepherd.scheduler.scheduler import Scheduler

HORIZON_SCAN = 32     # steps checked one by one when no closed form applies
SORT_SCAN = 64        # up to this many waiting requests, every order examines a subset of them


def _pages_after(s: "Scheduler", t: int) -> int:
    """Pages the running set allocates in t decode steps."""
    return sum(s.kv.decode_pages(e, t) for e in s._running)


def _state_key(s: "Scheduler") -> tuple:
    """Changes with every call that can change a horizon: schedule() (the step counter),
    add() (the arrival counter), an ending (the entries), on_step() (tokens sampled)."""
    return s._step, s._seq, len(s._entries), s._stats.generated_tokens


def decode_horizon(s: "Scheduler", now: float, finishing: bool = False) -> int:
    """See the module docstring. O(running + examined candidates) in the common cases."""
    h = _horizon(s, finishing)
    if finishing:
        s._ff_horizon = (_state_key(s), h)   # fast_forward checks against it without a second pass
    return h


def _horizon(s: "Scheduler", finishing: bool) -> int:
    if s._deferred_outputs or not s._running:
        return 0
    cfg = s.cfg
    running = s._running
    n = len(running)
    if n > cfg.max_num_tokens:
        return 0
    k = 1 << 30
    d_any = False
    last = 0 if finishing else 1     # the step that reaches a request's limit may be the k-th
    for e in running:
        r = e.req
        nc = r.num_computed
        nout = len(r.output_ids)
        if nc != len(r.prompt_ids) + nout - 1 or not e.synced or nout == e.out_at_admit:
            return 0      # prefill pending, new slots, or the first token (caches the prompt) not out yet
        if len(r.slots) != nc:
            d_any = True
        left = e.limit - nout - last
        if left < k:
            k = left
    if k <= 0:
        return 0
    K = cfg.debug_preempt_every
    if K:
        k = min(k, (s._step // K + 1) * K - s._step - 1)
        if k <= 0:
            return 0
    # decode allocations must come from the free list (no eviction, no preemption)
    free = s.kv.pool.free_pages
    if s.page_size == 1 and not d_any:
        k = min(k, free // n)
    else:
        lo, hi = 0, k            # largest t <= k with pages(t) <= free
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _pages_after(s, mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        k = lo
    if k <= 0:
        return 0
    # nothing may be admitted or swapped in during the k schedule() calls
    cands = _candidates(s)
    if cands is None:
        return 0
    if cands:
        k = _no_admission(s, k, cands, d_any)
        if cfg.mixed_steps and s.admission.mixes_steps:
            # a mixed step tries admission after its own decode allocation, i.e. one
            # decode step later than the prefill-first timing modelled above
            k -= 1
    return max(0, k)


def _candidates(s: "Scheduler") -> Optional[list[tuple[int, int, int]]]:
    """(own, b, locked) of every request an admission attempt would examine,
    [] when none would be attempted, None when the horizon must be 0."""
    pol = s.policy
    full = len(s._running) >= s.cfg.max_batch_size
    if s._swapped:
        if full:
            return []
        if pol.ranked:
            return None
        return [s.kv.swap_need(s._swapped[0])]
    if not s._waiting:
        return []
    if pol.preempts:
        return None          # may preempt for a slot
    if full:
        return []
    if pol.needs_sort and len(s._waiting) <= SORT_SCAN:
        examined = list(s._waiting)
    elif pol.needs_sort and pol.dynamic:
        return None
    else:
        examined = s._admission_order(s._step + 1)
    return [s.kv.candidate_need(e) for e in examined]


def _aging_bound(s: "Scheduler") -> int:
    if not s.policy.needs_sort or len(s._waiting) <= SORT_SCAN:
        return 1 << 30
    nxt = s._step + 1
    best = 1 << 30
    for e in s._waiting:
        at = e.enq_step + s.cfg.aging_steps
        if nxt < at < nxt + best:
            best = at - nxt
    return best


def _no_admission(s: "Scheduler", k: int, cands, d_any: bool) -> int:
    """Largest k' <= k such that no candidate fits in any of the next k' schedule() calls
    (admission is attempted with t = 0 .. k'-1 decode steps elapsed)."""
    k = min(k, _aging_bound(s))
    if k <= 0:
        return 0

    def any_fits(t: int) -> bool:
        adm = s._admission_state(ahead=t)
        return any(adm.fits(*c) for c in cands)

    if any_fits(0):
        return 0
    if s.page_size == 1 and s.admission.stable_under_decode:
        return k
    cap = s.cfg.reserve_cap_tokens
    if (s.page_size == 1 and isinstance(s.admission, Optimistic) and not d_any
            and all(e.final - len(e.req.slots) <= cap for e in s._running)
            and all(c[1] <= cap for c in cands)):
        return _optimistic_root(s, k, cands, any_fits)
    k = min(k, HORIZON_SCAN)
    for t in range(1, k):
        if any_fits(t):
            return t
    return k


def _optimistic_root(s: "Scheduler", k: int, cands, any_fits) -> int:
    """p == 1, no cap crossing: f_c(t) = F - n t - own - locked - r(t) (S - n t + b_c) with
    r(t) = max(rmin, r0 - d t) is concave in t, so the first t where a candidate fits is
    found from the roots, then confirmed with the exact check."""
    n = len(s._running)
    F = s.kv.available_pages()
    S = sum(e.final - len(e.req.slots) for e in s._running)
    rmin = s.cfg.new_token_ratio_min
    r0 = s.new_token_ratio
    d = s._ratio_delta
    t_floor = max(0.0, (r0 - rmin) / d) if d > 0 else float("inf")
    first = float(k)
    for own, b, locked in cands:
        A = F - own - locked
        D = S + b
        # decaying part: -d n t^2 + (r0 n + d D - n) t + (A - r0 D) >= 0
        qa, qb, qc = -d * n, r0 * n + d * D - n, A - r0 * D
        roots = []
        if qa != 0:
            disc = qb * qb - 4 * qa * qc
            if disc >= 0:
                sq = math.sqrt(disc)
                roots = sorted(((-qb - sq) / (2 * qa), (-qb + sq) / (2 * qa)))
        elif qb > 0:
            roots = [-qc / qb, float("inf")]
        if roots:
            lo = max(0.0, roots[0])
            if lo <= min(roots[1], t_floor):
                first = min(first, lo)
        # floor part: A - rmin D - n (1 - rmin) t >= 0 for t >= t_floor (decreasing)
        if t_floor < first and A - rmin * D - n * (1 - rmin) * t_floor >= 0:
            first = min(first, t_floor)
    t = k if first >= k else max(1, int(first) - 1)
    # confirm with the exact check: step back while it already fits earlier, and forward
    # (a step or two of rounding margin) while it does not fit yet, so the result is the
    # same whatever k was asked (a longer request for the horizon never shortens it)
    while t > 1 and any_fits(t - 1):
        t -= 1
    stop = min(k, t + HORIZON_SCAN)
    while t < stop and not any_fits(t):
        t += 1
    return t


def fast_forward(s: "Scheduler", k: int, tokens: dict[str, list[int]], now: float) -> list[RequestOutput]:
    """See the module docstring: k decode steps at once, same state as stepping."""
    if k <= 0:
        return []
    memo = getattr(s, "_ff_horizon", None)
    h = memo[1] if memo is not None and memo[0] == _state_key(s) else _horizon(s, True)
    if k > h:
        raise ValueError(f"fast_forward({k}) beyond decode_horizon()={h}")
    running = s._running
    for e in running:
        toks = tokens.get(e.req.req_id)
        if toks is None or len(toks) != k:
            raise ValueError(f"fast_forward: need {k} tokens for {e.req.req_id}")
        stop = e.stop_ids
        if not stop.isdisjoint(toks) and (toks[-1] not in stop or not stop.isdisjoint(toks[:-1])):
            raise ValueError(f"fast_forward: a token before the last would stop {e.req.req_id}; step normally")
    s.kv.grow(running, k)
    # what schedule() does before the step's on_step: counters, then the KV peak
    st = s._stats
    s._step += k
    s._ratio_steps += k
    s._since_prefill += k
    s._consec_prefill = 0
    st.begin_step()
    st.last_decode_seqs = len(running)
    s._note_peak()
    outs = []
    for e in list(running):    # on_step's order: tokens, then the end of a request that stops
        r = e.req
        toks = tokens[r.req_id]
        s._take_tokens(e, toks, now)
        r.num_computed += k
        if toks[-1] in e.stop_ids:
            outs.append(s._end(e, FinishReason.STOP, now, new_tokens=toks))
        elif len(r.output_ids) >= e.limit:
            outs.append(s._end(e, FinishReason.LENGTH, now, new_tokens=toks))
        else:
            outs.append(RequestOutput(r.req_id, new_token_ids=toks))   # the caller's list, not copied
    return outs
