"""The simulator's fast path, the proof half: how many decode-only steps can only be decodes.

    h = DecodeHorizon(cfg, queues, kv, policy, admission, shape)(step, finishing)

h >= 0 such that, if nothing arrives or is aborted and no request stops early
(EOS / stop id / stop string), the next h schedule() calls would each return
the same decode-only batch (only positions advance): no admission or swap-in
possible, no allocation that needs eviction or preemption, no forced (debug)
preemption, no aging/policy change that could alter the batch. No
max_tokens/max_model_len finish within the h steps; with finishing=True one is
allowed at the h-th (the last) step, so the step that ends a request needs no
schedule() of its own. 0 when the next step is anything else. Conservative: it
may return less than the true value, never more.

Scheduler.decode_horizon and Scheduler.fast_forward (which applies k such
steps at once, with the same KV growth, token bookkeeping and endings as k
steps one by one) are the public API. Nothing here mirrors schedule(): the
admission check after t decode steps is Admission.state(running, ahead=t), the
examined candidates Queues.admission_order, the page growth KVManager's. This
module only proves that nothing but decodes can happen for h steps; it reads
what it is handed and changes nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from shepherd.config import SchedulerConfig
from shepherd.scheduler.admission import Admission, Optimistic
from shepherd.scheduler.kv_manager import KVManager
from shepherd.scheduler.policy import Policy
from shepherd.scheduler.queues import Queues
from shepherd.scheduler.step_shape import StepShape

HORIZON_SCAN = 32     # steps checked one by one when no closed form applies
SORT_SCAN = 64        # up to this many waiting requests, every order examines a subset of them


@dataclass(eq=False)
class DecodeHorizon:
    cfg: SchedulerConfig
    queues: Queues
    kv: KVManager
    policy: Policy
    admission: Admission
    shape: StepShape

    def __call__(self, step: int, finishing: bool) -> int:
        """See the module docstring; `step` is the scheduler's step counter. O(running +
        examined candidates) in the common cases."""
        running = self.queues.running
        if not running:
            return 0
        cfg = self.cfg
        n = len(running)
        if n > cfg.max_num_tokens:
            return 0
        k = 1 << 30
        d_any = False
        last = 0 if finishing else 1     # the step that reaches a request's limit may be the k-th
        kv = self.kv
        shared: set = set()
        if kv.tree is not None:
            seen: set = set()
            for e in running:
                nid = id(e.node)
                (shared if nid in seen else seen).add(nid)
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
            if kv.tree is not None and kv.cache_may_share(e, shared):
                # its next decode insert may free duplicate pages: at the window's last step at most
                at = kv.next_cache_at(e.cached_len) - nc
                if at < k:
                    k = at
        if k <= 0:
            return 0
        K = cfg.debug_preempt_every
        if K:
            k = min(k, (step // K + 1) * K - step - 1)
            if k <= 0:
                return 0
        # decode allocations must come from the free list (no eviction, no preemption)
        free = self.kv.pool.free_pages
        if self.kv.page_size == 1 and not d_any:
            k = min(k, free // n)
        else:
            lo, hi = 0, k            # largest t <= k with pages(t) <= free
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self._pages_after(mid) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        if k <= 0:
            return 0
        # nothing may be admitted or swapped in during the k schedule() calls
        cands = self._candidates(step)
        if cands is None:
            return 0
        if cands:
            k = self._no_admission(step, k, cands, d_any)
            if self.shape.mixes and self.admission.mode.mixes_steps:
                # a mixed step tries admission after its own decode allocation, i.e. one
                # decode step later than the prefill-first timing modelled above
                k -= 1
        return max(0, k)

    def _pages_after(self, t: int) -> int:
        """Pages the running set allocates in t decode steps."""
        return sum(self.kv.decode_pages(e, t) for e in self.queues.running)

    def _candidates(self, step: int) -> Optional[list[tuple[int, int, int]]]:
        """(own, b, locked) of every request an admission attempt would examine,
        [] when none would be attempted, None when the horizon must be 0."""
        pol = self.policy
        q = self.queues
        full = len(q.running) >= self.cfg.max_batch_size
        if q.swapped:
            if full:
                return []
            if pol.ranked:
                return None
            return [self.kv.swap_need(q.swapped[0])]
        if not q.waiting:
            return []
        if pol.preempts:
            return None          # may preempt for a slot
        if full:
            return []
        if pol.needs_sort and len(q.waiting) <= SORT_SCAN:
            examined = list(q.waiting)
        elif pol.needs_sort and pol.dynamic:
            return None
        else:
            examined = q.admission_order(step + 1, self.cfg.max_batch_size - len(q.running), self.cfg.lookahead)
        return [self.kv.candidate_need(e) for e in examined]

    def _aging_bound(self, step: int) -> int:
        waiting = self.queues.waiting
        if not self.policy.needs_sort or len(waiting) <= SORT_SCAN:
            return 1 << 30
        nxt = step + 1
        best = 1 << 30
        for e in waiting:
            at = e.enq_step + self.cfg.aging_steps
            if nxt < at < nxt + best:
                best = at - nxt
        return best

    def _no_admission(self, step: int, k: int, cands, d_any: bool) -> int:
        """Largest k' <= k such that no candidate fits in any of the next k' schedule() calls
        (admission is attempted with t = 0 .. k'-1 decode steps elapsed)."""
        k = min(k, self._aging_bound(step))
        if k <= 0:
            return 0
        running = self.queues.running

        def any_fits(t: int) -> bool:
            adm = self.admission.state(running, ahead=t)
            return any(adm.fits(*c) for c in cands)

        if any_fits(0):
            return 0
        p1 = self.kv.page_size == 1
        if p1 and self.admission.mode.stable_under_decode:
            return k
        cap = self.cfg.reserve_cap_tokens
        if (p1 and isinstance(self.admission.mode, Optimistic) and not d_any
                and all(e.final - len(e.req.slots) <= cap for e in running)
                and all(c[1] <= cap for c in cands)):
            return self._optimistic_root(k, cands, any_fits)
        k = min(k, HORIZON_SCAN)
        for t in range(1, k):
            if any_fits(t):
                return t
        return k

    def _optimistic_root(self, k: int, cands, any_fits) -> int:
        """p == 1, no cap crossing: f_c(t) = F - n t - own - locked - r(t) (S - n t + b_c) with
        r(t) = max(rmin, r0 - d t) is concave in t, so the first t where a candidate fits is
        found from the roots, then confirmed with the exact check."""
        running = self.queues.running
        n = len(running)
        F = self.kv.available_pages()
        S = sum(e.final - len(e.req.slots) for e in running)
        ratio = self.admission.ratio
        rmin, r0, d = ratio.floor, ratio.value, ratio.delta
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
