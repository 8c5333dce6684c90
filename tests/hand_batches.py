"""Step batches built by hand, for tests that drive an executor without a scheduler: the test
keeps its own Request (token ids and slots) and these turn it into the step contract's messages
(shepherd/step.py), announcing a request to the executor the first time it runs."""
from __future__ import annotations

from shepherd.request import Request
from shepherd.step import NewRequest, ScheduledBatch, ScheduledSeq


def seq(req: Request, token_ids, start_pos: int, sample: bool, fresh: bool = False) -> tuple[Request, ScheduledSeq]:
    """Feed token_ids at start_pos; fresh: send req.slots whole (its first step, or slots rebuilt),
    else the executor's slot table stands as last sent."""
    slots_from, new_slots = (0, list(req.slots)) if fresh else (len(req.slots), [])
    return req, ScheduledSeq(req.req_id, list(token_ids), start_pos, sample, slots_from, new_slots)


def announced(ex, seqs) -> list[ScheduledSeq]:
    """The seqs, after telling the executor (ex.add) about requests it has not seen."""
    for r, _ in seqs:
        if r.req_id not in ex.reqs:
            ex.add(NewRequest(r.req_id, r.prompt_ids, r.params, r.eos_token_ids))
    return [s for _, s in seqs]


def batch(ex, step: int, seqs=(), **kw) -> ScheduledBatch:
    return ScheduledBatch(step=step, seqs=announced(ex, seqs), **kw)
