"""Preemption: who gives up its KV, and how (recompute or swap).

Three callers: a decode that cannot get KV (only admission modes that may
preempt do this by design), a policy whose waiting requests outrank running
ones (Policy.preempts: the priority policy under optimistic admission), and
the debug_preempt_every fault injection. Preemption is handed what it works
on: the queues (the moves), the KV manager (every KV write), the policy (its
ranks), admission (does a candidate fit) and the growth ratio it re-estimates.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from shepherd.config import SchedulerConfig
from shepherd.scheduler.admission import Admission, GrowthRatio
from shepherd.scheduler.kv_manager import KVManager
from shepherd.scheduler.policy import Policy
from shepherd.scheduler.queues import Queues
from shepherd.scheduler.state import Entry, SchedulerStats
from shepherd.step import ScheduledBatch

logger = logging.getLogger("shepherd.scheduler")

RETRACT_DECODE_STEPS = 20   # SGLang's allowance when re-estimating new_token_ratio after a preemption

# who is preempted first (the smallest key): config.VICTIMS
VICTIM_KEYS = {
    "last": lambda e: -e.admit_seq,
    "fewest-output": lambda e: (len(e.req.output_ids), -len(e.req.prompt_ids), -e.admit_seq),
    "lowest-priority": lambda e: (e.req.priority, -e.admit_seq),
}


@dataclass(eq=False)
class Preemption:
    cfg: SchedulerConfig
    queues: Queues
    kv: KVManager
    policy: Policy
    admission: Admission
    ratio: GrowthRatio          # re-estimated after a preemption (optimistic admission)
    stats: SchedulerStats

    def pick_victim(self, exclude: Optional[Entry] = None, below_rank: Optional[int] = None,
                    busy: Optional[set] = None, among: Optional[list[Entry]] = None) -> Optional[Entry]:
        cands = self.queues.running if among is None else among
        if busy:
            cands = [e for e in cands if e.req.req_id not in busy]
        if below_rank is not None:
            rank = self.policy.rank
            cands = [e for e in cands if rank(e) < below_rank]
        if exclude is not None:
            cands = [e for e in cands if e is not exclude]
        if not cands:
            return None
        key = VICTIM_KEYS["lowest-priority"] if below_rank is not None else VICTIM_KEYS[self.cfg.victim]
        return min(cands, key=key)

    def preempt(self, e: Entry, batch: ScheduledBatch, why: str) -> None:
        req = e.req
        tokens = req.num_computed
        q = self.queues
        op = self.kv.swap_out(e) if self.cfg.preemption == "swap" else None
        if op is not None:
            batch.swap_out.append(op)
            q.swap_out(e)
        else:
            self.kv.release(e, cache=True)
            req.num_computed = 0
            q.requeue(e)
        req.preemptions += 1
        st = self.stats
        st.preemptions += 1
        st.last_preemptions += 1
        st.preempted_tokens += tokens
        logger.info("preempt %s (%s, %s): %d KV tokens %s, %d output tokens so far, running=%d",
                    req.req_id, why, "swap" if op else "recompute", tokens,
                    "moved to host" if op else "thrown away", len(req.output_ids), len(q.running))
        if self.admission.mode.may_preempt:
            # SGLang: re-estimate the growth ratio from what the survivors actually produced
            run = q.running
            tot = sum(x.limit for x in run)
            if tot:
                obs = (sum(len(x.req.output_ids) for x in run) + RETRACT_DECODE_STEPS * len(run)) / tot
                self.ratio.reset(min(1.0, max(self.ratio.value, obs)))

    def preempt_for(self, cand: Entry, blocked_by: str, batch: ScheduledBatch) -> bool:
        """Preempt lower-ranked running requests so that cand fits; only if it will."""
        rank = self.policy.rank
        top = rank(cand)
        running = self.queues.running
        # already given work (or swapped in) this step: not victims
        busy = {sq.req_id for sq in batch.seqs} | {op.req_id for op in batch.swap_in}
        lower = [e for e in running if rank(e) < top and e.req.req_id not in busy]
        if not lower:
            return False
        if blocked_by == "batch" and len(running) - len(lower) >= self.cfg.max_batch_size:
            return False
        # would cand fit with all of them gone?
        gone = set(map(id, lower))
        adm = self.admission.state([e for e in running if id(e) not in gone])
        adm.free += sum(len(self.kv.own_pages(e)) for e in lower) * self.kv.page_size
        if not adm.fits(*self.kv.candidate_need(cand)):
            return False
        while True:
            v = self.pick_victim(below_rank=top, busy=busy)
            if v is None:
                return True
            self.preempt(v, batch, f"priority {top} > {rank(v)}")
            if blocked_by == "batch" and len(running) >= self.cfg.max_batch_size:
                continue
            if self.admission.state(running).fits(*self.kv.candidate_need(cand)):
                return True

    def debug_preempt(self, step: int, batch: ScheduledBatch) -> None:
        k = self.cfg.debug_preempt_every
        running = self.queues.running
        if k and step % k == 0 and running:
            # only a request that produced a token since it was (re)admitted, so that
            # injected faults can never livelock a long chunked prefill
            v = self.pick_victim(among=[e for e in running if len(e.req.output_ids) > e.out_at_admit])
            if v is not None:
                self.preempt(v, batch, f"debug_preempt_every={k}")

    def make_room_for_decode(self, dec: list[Entry], batch: ScheduledBatch
                             ) -> tuple[list[Entry], Optional[tuple[Entry, str]]]:
        """Preempt (or take back this step's swap-ins) until the decoders' next pages fit.
        Returns the decoders left and, when a lone decoder can never fit, it and why (the
        scheduler ends it; no decoder is left then)."""
        kv = self.kv
        pages = kv.step_pages(dec)
        total = sum(pages)
        if total <= kv.available_pages():
            return dec, None
        need = dict(zip(map(id, dec), pages))
        running = self.queues.running
        while total > kv.available_pages():
            # never preempt the last decoder for nothing: it is the one that must progress
            exclude = dec[0] if len(dec) == 1 else None
            busy = {op.req_id for op in batch.swap_in}
            v = self.pick_victim(exclude=exclude, busy=busy)
            undo = None
            if v is None and busy:
                undo = next((x for x in reversed(running) if x.req.req_id in busy and x is not exclude), None)
            if undo is not None:
                self._undo_swap_in(undo, batch)
                v = undo
            elif v is None:
                e = dec[0]
                msg = (f"request needs {e.req.num_computed + 1} KV tokens, more than the capacity "
                       f"of {kv.capacity} (prompt {len(e.req.prompt_ids)}, output {len(e.req.output_ids)})")
                logger.warning("request %s: %s", e.req.req_id, msg)
                return [], (e, msg)
            else:
                if not self.admission.mode.may_preempt:
                    logger.warning("admission=%s ran out of KV: preempting (this is a bug)", self.cfg.admission)
                self.preempt(v, batch, "out of KV for decode")
            if id(v) in need:
                total -= need.pop(id(v))
                dec = [x for x in dec if x is not v]
        return dec, None

    def _undo_swap_in(self, e: Entry, batch: ScheduledBatch) -> None:
        """Take back a swap-in decided earlier in this step (the executor never saw it)."""
        op = next(o for o in batch.swap_in if o.req_id == e.req.req_id)
        batch.swap_in.remove(op)
        self.queues.unresume(e)
        self.kv.undo_swap_in(e, op)
