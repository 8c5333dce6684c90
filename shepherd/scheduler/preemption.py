"""Preemption: who gives up its KV, and how (recompute or swap).

Three callers: a decode that cannot get KV (only admission modes that may
preempt do this by design), a policy whose waiting requests outrank running
ones (Policy.preempts: the priority policy under optimistic admission), and
the debug_preempt_every fault injection. Functions over the Scheduler, which
owns the queues; every KV write goes through its KVManager.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from shepherd.request import FinishReason, RequestState
from shepherd.scheduler.state import Entry
from shepherd.step import ScheduledBatch

if TYPE_CHECKING:
    from shepherd.scheduler.scheduler import Scheduler

logger = logging.getLogger("shepherd.scheduler")

RETRACT_DECODE_STEPS = 20   # SGLang's allowance when re-estimating new_token_ratio after a preemption

# who is preempted first (the smallest key): config.VICTIMS
VICTIM_KEYS = {
    "last": lambda e: -e.admit_seq,
    "fewest-output": lambda e: (len(e.req.output_ids), -len(e.req.prompt_ids), -e.admit_seq),
    "lowest-priority": lambda e: (e.req.priority, -e.admit_seq),
}


def pick_victim(s: "Scheduler", exclude: Optional[Entry] = None, below_rank: Optional[int] = None,
                busy: Optional[set] = None, among: Optional[list[Entry]] = None) -> Optional[Entry]:
    cands = s._running if among is None else among
    if busy:
        cands = [e for e in cands if e.req.req_id not in busy]
    if below_rank is not None:
        rank = s.policy.rank
        cands = [e for e in cands if rank(e) < below_rank]
    if exclude is not None:
        cands = [e for e in cands if e is not exclude]
    if not cands:
        return None
    key = VICTIM_KEYS["lowest-priority"] if below_rank is not None else VICTIM_KEYS[s.cfg.victim]
    return min(cands, key=key)


def preempt(s: "Scheduler", e: Entry, batch: ScheduledBatch, why: str) -> None:
    req = e.req
    tokens = req.num_computed
    s._running.remove(e)
    op = s.kv.swap_out(e) if s.cfg.preemption == "swap" else None
    if op is not None:
        batch.swap_out.append(op)
        req.state = RequestState.SWAPPED
        s._swapped.append(e)
    else:
        s.kv.release(e, cache=True)
        req.num_computed = 0
        req.state = RequestState.WAITING
        s._waiting.appendleft(e)
        s.policy.on_add(e, s._waiting)
    req.preemptions += 1
    st = s._stats
    st.preemptions += 1
    st.last_preemptions += 1
    st.preempted_tokens += tokens
    logger.info("preempt %s (%s, %s): %d KV tokens %s, %d output tokens so far, running=%d",
                req.req_id, why, "swap" if op else "recompute", tokens,
                "moved to host" if op else "thrown away", len(req.output_ids), len(s._running))
    if s.admission.may_preempt:
        # SGLang: re-estimate the growth ratio from what the survivors actually produced
        run = s._running
        tot = sum(x.limit for x in run)
        if tot:
            obs = (sum(len(x.req.output_ids) for x in run) + RETRACT_DECODE_STEPS * len(run)) / tot
            s._reset_ratio(min(1.0, max(s.new_token_ratio, obs)))


def preempt_for(s: "Scheduler", cand: Entry, blocked_by: str, batch: ScheduledBatch) -> bool:
    """Preempt lower-ranked running requests so that cand fits; only if it will."""
    rank = s.policy.rank
    top = rank(cand)
    # already given work (or swapped in) this step: not victims
    busy = {sq.req_id for sq in batch.seqs} | {op.req_id for op in s._pending_swap_in}
    lower = [e for e in s._running if rank(e) < top and e.req.req_id not in busy]
    if not lower:
        return False
    if blocked_by == "batch" and len(s._running) - len(lower) >= s.cfg.max_batch_size:
        return False
    # would cand fit with all of them gone?
    gone = set(map(id, lower))
    adm = s._admission_state(running=[e for e in s._running if id(e) not in gone])
    adm.free += sum(len(s.kv.own_pages(e)) for e in lower) * s.page_size
    if not adm.fits(*s.kv.candidate_need(cand)):
        return False
    while True:
        v = pick_victim(s, below_rank=top, busy=busy)
        if v is None:
            return True
        preempt(s, v, batch, f"priority {top} > {rank(v)}")
        if blocked_by == "batch" and len(s._running) >= s.cfg.max_batch_size:
            continue
        if s._admission_state().fits(*s.kv.candidate_need(cand)):
            return True


def debug_preempt(s: "Scheduler", batch: ScheduledBatch) -> None:
    k = s.cfg.debug_preempt_every
    if k and s._step % k == 0 and s._running:
        # only a request that produced a token since it was (re)admitted, so that
        # injected faults can never livelock a long chunked prefill
        v = pick_victim(s, among=[e for e in s._running if len(e.req.output_ids) > e.out_at_admit])
        if v is not None:
            preempt(s, v, batch, f"debug_preempt_every={k}")


def make_room_for_decode(s: "Scheduler", dec: list[Entry], batch: ScheduledBatch,
                         now: float) -> Optional[list[Entry]]:
    """Preempt (or take back this step's swap-ins) until the decoders' next pages fit;
    returns the decoders left, or None when a lone decoder can never fit (it ended)."""
    kv = s.kv
    pages = kv.step_pages(dec)
    total = sum(pages)
    if total <= kv.available_pages():
        return dec
    need = dict(zip(map(id, dec), pages))
    while total > kv.available_pages():
        # never preempt the last decoder for nothing: it is the one that must progress
        exclude = dec[0] if len(dec) == 1 else None
        busy = {op.req_id for op in s._pending_swap_in}
        v = pick_victim(s, exclude=exclude, busy=busy)
        undo = None
        if v is None and busy:
            undo = next((x for x in reversed(s._running) if x.req.req_id in busy and x is not exclude), None)
        if undo is not None:
            s._undo_swap_in(undo)
            v = undo
        elif v is None:
            e = dec[0]
            msg = (f"request needs {e.req.num_computed + 1} KV tokens, more than the capacity "
                   f"of {s.capacity} (prompt {len(e.req.prompt_ids)}, output {len(e.req.output_ids)})")
            logger.warning("request %s: %s", e.req.req_id, msg)
            s._deferred_outputs.append(s._end(e, FinishReason.ERROR, now, error=msg))
            return None
        else:
            if not s.admission.may_preempt:
                logger.warning("admission=%s ran out of KV: preempting (this is a bug)", s.cfg.admission)
            preempt(s, v, batch, "out of KV for decode")
        if id(v) in need:
            total -= need.pop(id(v))
            dec = [x for x in dec if x is not v]
    return dec
