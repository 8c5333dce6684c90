"""Where every request is: the waiting queue, the running set, the swapped queue.

The one owner of that state and of each request's RequestState. Every move
between the queues is a named method, and the policy hears of the waiting
queue's changes here (VTC keeps its per-client backlog from them). Who moves,
and when, is the scheduler's (and preemption.py's) decision; the KV that goes
with a move is KVManager's.

    add      -> waiting (tail)             requeue   running -> waiting (head): preempted, recompute
    admit    waiting -> running            swap_out  running -> swapped (tail)
    resume   swapped -> running            unresume  running -> swapped (head): a swap-in taken back
    end      any -> gone (FINISHED)

Admissions leave the waiting deque in one pass (close_admissions), not one
O(queue) removal each: a long queue admits many requests per step. The LoRA
adapters' counts (adapters.py: residency, the active set) hear of every move
here too.
"""
from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Iterator, Optional

from shepherd.request import Request, RequestState
from shepherd.scheduler.adapters import Adapters
from shepherd.scheduler.policy import Policy
from shepherd.scheduler.state import Entry


class Queues:
    def __init__(self, policy: Policy, adapters: Adapters):
        self.policy = policy
        self.adapters = adapters
        self.entries: dict[str, Entry] = {}
        self.waiting: deque[Entry] = deque()
        self.running: list[Entry] = []
        self.swapped: deque[Entry] = deque()
        self.arrivals = 0          # requests ever added (their arrival order: Entry.seq)
        self.admissions = 0        # admissions and swap-ins ever made (Entry.admit_seq: victim order)
        self._admitted: list[Entry] = []    # admitted, still in the waiting deque until close_admissions

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, req_id: str) -> Optional[Entry]:
        return self.entries.get(req_id)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.entries

    def all(self) -> Iterator[Entry]:
        yield from self.running
        yield from self.waiting
        yield from self.swapped

    # ------------------------------------------------------------------ moves
    def add(self, req: Request, step: int, limit: int, rand_key: float) -> Entry:
        req.state = RequestState.WAITING
        req.num_computed = 0
        req.slots = []
        self.arrivals += 1
        e = Entry(req, self.arrivals, step, limit, rand_key)
        self.entries[req.req_id] = e
        self.waiting.append(e)
        self.policy.on_add(e, self.waiting)
        self.adapters.on_add(req.adapter)
        self.adapters.on_wait(req.adapter)
        return e

    def admit(self, e: Entry, now: float) -> None:
        """waiting -> running (it leaves the waiting deque at close_admissions)."""
        self.policy.on_leave_queue(e, self.waiting)
        self.policy.on_admit(e, not e.admitted_once)
        self.adapters.on_unwait(e.req.adapter)
        self._admitted.append(e)
        self._run(e, now)

    def close_admissions(self) -> None:
        if self._admitted:
            gone = set(map(id, self._admitted))
            self.waiting = deque(x for x in self.waiting if id(x) not in gone)
            self._admitted = []

    def resume(self, e: Entry, now: float) -> None:
        """swapped -> running (a swap-in)."""
        self.swapped.remove(e)
        self._run(e, now)

    def unresume(self, e: Entry) -> None:
        """A swap-in of this step taken back: running -> the head of the swapped queue."""
        self.running.remove(e)
        self.adapters.on_stop(e.req.adapter)
        e.req.state = RequestState.SWAPPED
        self.swapped.appendleft(e)

    def requeue(self, e: Entry) -> None:
        """Preempted by recompute: running -> the head of the waiting queue."""
        self.running.remove(e)
        self.adapters.on_stop(e.req.adapter)
        e.req.state = RequestState.WAITING
        self.waiting.appendleft(e)
        self.policy.on_add(e, self.waiting)
        self.adapters.on_wait(e.req.adapter)

    def swap_out(self, e: Entry) -> None:
        """Preempted by swap: running -> the tail of the swapped queue."""
        self.running.remove(e)
        self.adapters.on_stop(e.req.adapter)
        e.req.state = RequestState.SWAPPED
        self.swapped.append(e)

    def end(self, e: Entry) -> RequestState:
        """Out of whichever queue holds it; returns the state it was in."""
        req = e.req
        was = req.state
        ad = self.adapters
        if was is RequestState.RUNNING:
            self.running.remove(e)
            ad.on_stop(req.adapter)
        elif was is RequestState.WAITING:
            self.waiting.remove(e)
            self.policy.on_leave_queue(e, self.waiting)
            ad.on_unwait(req.adapter)
        elif was is RequestState.SWAPPED:
            self.swapped.remove(e)
        ad.on_end(req.adapter)
        req.state = RequestState.FINISHED
        del self.entries[req.req_id]
        return was

    def _run(self, e: Entry, now: float) -> None:
        req = e.req
        req.state = RequestState.RUNNING
        if req.admitted_at is None:
            req.admitted_at = now
        e.synced = 0                      # a new slot table: sent whole with its next seq
        e.admitted_once = True
        e.out_at_admit = len(req.output_ids)
        self.admissions += 1
        e.admit_seq = self.admissions
        self.running.append(e)
        self.adapters.on_run(req.adapter)

    # ------------------------------------------------------------------ views
    def admission_order(self, step: int, room: int, lookahead: int) -> list[Entry]:
        """The waiting requests one admission attempt examines, in policy order: as many as
        the batch has room for (at least one), plus the look-ahead past heads that do not fit."""
        order = self.policy.order(self.waiting, step)
        ad = self.adapters
        if ad.filters():     # requests of adapters that cannot run now are passed over (adapters.py)
            order = (e for e in order if ad.examined(e.req.adapter, step - e.enq_step))
        return list(islice(order, max(room, 1) + lookahead + 1))

    def check(self) -> None:
        assert len(self.entries) == len(self.running) + len(self.waiting) + len(self.swapped)
