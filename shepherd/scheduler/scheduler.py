"""The scheduler: waiting queue, running set, one decision per step.

Pure logic: no tensors, no clock of its own (`now` is passed in), no I/O.
The engine, the simulator and the tests use exactly this:

    sched = Scheduler(SchedulerConfig(...), host_kv_capacity=0, max_model_len=8192)
    sched.add(req, now)            # raises QueueFull (-> HTTP 429) or RequestRejected (-> HTTP 400)
    out = sched.abort(req_id, now) # terminal RequestOutput (ABORT), or None if unknown; KV freed at once,
                                   # the executor is told via the next batch.finished
    out = sched.finish(req_id, reason, now)  # the engine found a stop string: terminal output, KV freed
    batch = sched.schedule(now)    # -> ScheduledBatch (may be empty)
    outs = sched.on_step(batch, result, now)  # one RequestOutput per request that got a token or ended
    sched.stats() / sched.snapshot()          # every counter (a copy) / an O(1) SchedulerSnapshot
    sched.has_work, sched.running, sched.waiting, sched.swapped, sched.get(req_id), check_integrity()
    sched.decode_horizon(now[, finishing]), sched.fast_forward(k, tokens, now)   # the simulator's, fast_path.py

Owners: KVManager (kv_manager.py) makes every write to KV memory; the
admission mode (admission.py) says whether a candidate fits, whether steps
mix and whether a decode may preempt; the policy (policy.py) orders the queue
and ranks requests for priority preemption; preemption.py picks victims.

Step shape: with mixed_steps (the default, vLLM) every running decode gets its
token first, then prefill chunks and admissions fill the rest of max_num_tokens;
a step that had to preempt for decode KV admits nothing. Without it (or under
a mode that never mixes) a step is a prefill step (decodes wait) or a decode
step; when prefills may join is step_gate.py's (SGLang, LightLLM, vLLM v0.6
multi-step). A request is admitted only when its whole known sequence gets KV
slots at once, so a chunked prefill never runs out of memory half-way.
"""
from __future__ import annotations

import random as _random
from collections import deque
from itertools import islice
from typing import Optional

from shepherd.config import SchedulerConfig
from shepherd.request import FinishReason, Request, RequestOutput, RequestState, context_error
from shepherd.scheduler import fast_path, preemption, step_gate
from shepherd.scheduler.admission import AdmissionState, make_admission
from shepherd.scheduler.kv_manager import KVManager
from shepherd.scheduler.kv_pool import pages_for
from shepherd.scheduler.policy import make_policy
from shepherd.scheduler.state import Entry, QueueFull, RequestRejected, SchedulerSnapshot, SchedulerStats
from shepherd.step import NewRequest, ScheduledBatch, ScheduledSeq, StepResult, SwapOp

__all__ = ["QueueFull", "RequestRejected", "Scheduler", "SchedulerSnapshot", "SchedulerStats"]


class Scheduler:
    def __init__(self, config: SchedulerConfig, host_kv_capacity: int = 0, max_model_len: int = 8192):
        self.cfg = config      # validated by whoever sized it (engine/build.py, the simulator)
        self.capacity = config.max_total_tokens
        self.page_size = config.page_size
        self.max_model_len = max_model_len
        self._stats = SchedulerStats(kv_capacity=self.capacity, kv_free=self.capacity,
                                     kv_host_capacity=max(0, int(host_kv_capacity)))
        self.kv = KVManager(self.capacity, self.page_size, config.prefix_cache, host_kv_capacity, self._stats)
        self.host_kv_capacity = self.kv.host_capacity
        self.admission = make_admission(config.admission)
        self.policy = make_policy(config, self.kv.tree, self.admission)
        self._rng = _random.Random(config.seed)

        self._entries: dict[str, Entry] = {}
        self._waiting: deque[Entry] = deque()
        self._running: list[Entry] = []
        self._swapped: deque[Entry] = deque()
        self._finished: list[str] = []      # ended since the last batch that ran: batch.finished
        self._seq = 0
        self._admit_seq = 0
        self._step = 0
        self._consec_prefill = 0
        self._since_prefill = 0
        # new_token_ratio = max(min, base - delta * decode steps since base was set)
        self._ratio_base = config.new_token_ratio_init
        self._ratio_steps = 0
        self._ratio_delta = ((config.new_token_ratio_init - config.new_token_ratio_min)
                             / max(1, config.new_token_ratio_decay_steps))
        self._deferred_outputs: list[RequestOutput] = []   # terminal outputs made inside schedule()
        self._continues_window = False     # the last schedule() continued a multi-step window
        self._pending_swap_in: list[SwapOp] = []

    # ------------------------------------------------------------------ views
    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._swapped)

    @property
    def running(self) -> list[Request]:
        return [e.req for e in self._running]

    @property
    def waiting(self) -> list[Request]:
        return [e.req for e in self._waiting]

    @property
    def swapped(self) -> list[Request]:
        return [e.req for e in self._swapped]

    def get(self, req_id: str) -> Optional[Request]:
        e = self._entries.get(req_id)
        return e.req if e else None

    def ratio_after(self, steps: int) -> float:
        """new_token_ratio after `steps` more decode steps."""
        return max(self.cfg.new_token_ratio_min,
                   self._ratio_base - self._ratio_delta * (self._ratio_steps + steps))

    @property
    def new_token_ratio(self) -> float:
        return self.ratio_after(0)

    # ------------------------------------------------------------------ intake
    def add(self, req: Request, now: float) -> None:
        cfg = self.cfg
        if req.req_id in self._entries:
            raise RequestRejected(f"duplicate request id {req.req_id!r}")
        n = len(req.prompt_ids)
        if n == 0:
            raise RequestRejected("empty prompt")
        if req.params.max_tokens < 1:
            raise RequestRejected(f"max_tokens must be >= 1, got {req.params.max_tokens}")
        err = context_error(n, self.max_model_len)
        if err:
            raise RequestRejected(err)
        if n + 1 > self.capacity:
            raise RequestRejected(
                f"prompt has {n} tokens; with one output token it exceeds the KV capacity of {self.capacity} tokens")
        limit = min(req.params.max_tokens, self.max_model_len - n)
        if self.admission.reserves_output:
            need = n + limit - 1
            if pages_for(need, self.page_size) > self.kv.pool.num_pages:
                raise RequestRejected(
                    f"prompt ({n}) + max_tokens ({limit}) needs {need} KV tokens, more than the capacity "
                    f"of {self.capacity}; admission={cfg.admission} reserves the whole output "
                    f"(lower max_tokens or use admission=optimistic)")
        if len(self._waiting) >= cfg.max_queue:
            raise QueueFull(f"waiting queue is full ({cfg.max_queue} requests)")
        if len(self._entries) >= cfg.max_concurrency:
            raise QueueFull(f"too many requests in flight ({cfg.max_concurrency})")
        req.state = RequestState.WAITING
        req.num_computed = 0
        req.slots = []
        self._seq += 1
        e = Entry(req, self._seq, self._step, limit, self._rng.random())
        self._entries[req.req_id] = e
        self._waiting.append(e)
        self.policy.on_add(e, self._waiting)

    # ------------------------------------------------------------------ endings
    def abort(self, req_id: str, now: float) -> Optional[RequestOutput]:
        return self.finish(req_id, FinishReason.ABORT, now)

    def finish(self, req_id: str, reason: FinishReason, now: float) -> Optional[RequestOutput]:
        e = self._entries.get(req_id)
        if e is None:
            return None
        return self._end(e, reason, now)

    def _end(self, e: Entry, reason: FinishReason, now: float, error: Optional[str] = None,
             new_tokens: Optional[list[int]] = None, logprobs=None) -> RequestOutput:
        req = e.req
        st = req.state
        if st is RequestState.RUNNING:
            self._running.remove(e)
            self.kv.release(e)
        elif st is RequestState.WAITING:
            self._waiting.remove(e)
            self.policy.on_leave_queue(e, self._waiting)
        elif st is RequestState.SWAPPED:
            self._swapped.remove(e)
            self.kv.drop_host(e)
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        req.finished_at = now
        req.error = error
        del self._entries[req.req_id]
        self._finished.append(req.req_id)
        s = self._stats
        if reason is FinishReason.ABORT:
            s.aborted += 1
        elif reason is FinishReason.ERROR:
            s.errors += 1
        else:
            s.finished += 1
        if not self._entries:
            self._reset_ratio(self.cfg.new_token_ratio_init)
        return RequestOutput(req.req_id, new_token_ids=new_tokens or [], logprobs=logprobs or [],
                             finished=True, finish_reason=reason, error=error)

    def _reset_ratio(self, base: float) -> None:
        self._ratio_base = base
        self._ratio_steps = 0

    # ------------------------------------------------------------------ admission
    def _admission_state(self, ahead: int = 0, running: Optional[list[Entry]] = None) -> AdmissionState:
        """What admission sees now, or after `ahead` more decode-only steps (fast path)."""
        kv, lock = self.kv, self.admission.lockstep
        spent, pairs, pinned = 0, [], []
        for e in self._running if running is None else running:
            spent += kv.decode_pages(e, ahead) if ahead else 0
            lag = lock and e.in_prefill()     # a prefill spanning steps lags the decoders: pinned
            p = kv.lockstep_pair(e, ahead) if lock and not lag else \
                kv.pair(e, max(len(e.req.slots), e.req.num_computed + ahead))
            (pinned if lag else pairs).append(p)
        free = (kv.available_pages() - spent) * self.page_size
        return self.admission.state(pairs, free, self.ratio_after(ahead), self.cfg.reserve_cap_tokens, pinned)

    def _admission_order(self, step: int) -> list[Entry]:
        """The waiting requests one admission attempt examines, in policy order."""
        cfg = self.cfg
        room = cfg.max_batch_size - len(self._running)
        return list(islice(self.policy.order(self._waiting, step), max(room, 1) + cfg.lookahead + 1))

    def _admit(self, e: Entry, adm: AdmissionState, now: float, resume_swap: bool = False, room: int = 0) -> bool:
        if resume_swap:
            own, b, locked = self.kv.swap_need(e)
            if not adm.fits(own, b, locked):
                return False
            self._pending_swap_in.append(self.kv.swap_in(e, own))
        else:
            own, b, locked = self.kv.candidate_need(e)
            pin = self.admission.lockstep and own > room    # its prefill will span steps: pinned
            if not (adm.fits_pinned if pin else adm.fits)(own, b, locked):
                return False
            self.kv.admit(e, own)
            self.policy.on_leave_queue(e, self._waiting)
            self.policy.on_admit(e, not e.admitted_once)
        (adm.add_pinned if not resume_swap and pin else adm.add)(own, b, locked)
        req = e.req
        e.synced = 0
        req.state = RequestState.RUNNING
        if req.admitted_at is None:
            req.admitted_at = now
        e.admitted_once = True
        e.out_at_admit = len(req.output_ids)
        self._admit_seq += 1
        e.admit_seq = self._admit_seq
        self._running.append(e)
        return True

    def _try_swap_in(self, now: float, batch: ScheduledBatch) -> None:
        if not self._swapped:
            return
        just_out = {op.req_id for op in batch.swap_out}
        adm = self._admission_state()
        pol = self.policy
        top = max(map(pol.rank, self._waiting), default=None) if pol.ranked else None
        while self._swapped and len(self._running) < self.cfg.max_batch_size:
            e = pol.pick_swap_in(self._swapped, top)
            if e is None or e.req.req_id in just_out:
                break        # swapped out in this very step: back no earlier than the next one
            if not self._admit(e, adm, now, resume_swap=True):
                break
            self._swapped.remove(e)

    def _undo_swap_in(self, e: Entry) -> None:
        op = next(o for o in self._pending_swap_in if o.req_id == e.req.req_id)
        self._pending_swap_in.remove(op)
        self._running.remove(e)
        self.kv.undo_swap_in(e, op)
        e.req.state = RequestState.SWAPPED
        self._swapped.appendleft(e)

    def _admit_waiting(self, budget: int, now: float, batch: ScheduledBatch) -> int:
        """Admit waiting requests in policy order; returns tokens scheduled."""
        cfg = self.cfg
        pol = self.policy
        floor = None
        if self._swapped:
            floor = pol.swap_floor(self._swapped)
            if floor is None:
                return 0     # swapped requests come back first
        adm = self._admission_state()
        used = skipped = 0
        admitted: list[Entry] = []
        for e in self._admission_order(self._step):   # a snapshot: preemption may requeue victims
            if budget - used <= 0:
                break
            if floor is not None and pol.rank(e) <= floor:
                continue     # not above every swapped request: those come back first
            blocked_by = None
            if len(self._running) >= cfg.max_batch_size:
                blocked_by = "batch"
            elif not self._admit(e, adm, now, room=budget - used):
                blocked_by = "kv"
            if blocked_by is not None and pol.preempts and preemption.preempt_for(self, e, blocked_by, batch):
                adm = self._admission_state()
                if len(self._running) < cfg.max_batch_size and self._admit(e, adm, now, room=budget - used):
                    blocked_by = None
            if blocked_by == "batch":
                break
            if blocked_by == "kv":
                if self._step - e.enq_step >= cfg.aging_steps:
                    break            # an aged head is not overtaken
                skipped += 1
                if skipped > cfg.lookahead:
                    break
                continue
            admitted.append(e)
            used += self._emit_prefill(e, budget - used, batch)
        if admitted:
            ids = set(map(id, admitted))
            self._waiting = deque(x for x in self._waiting if id(x) not in ids)
        return used

    # ------------------------------------------------------------------ batch building
    def _emit_prefill(self, e: Entry, budget: int, batch: ScheduledBatch) -> int:
        req = e.req
        nc = req.num_computed
        total = req.num_tokens
        chunk = min(budget, total - nc)
        if chunk <= 0:
            return 0
        ids = req.prompt_ids[nc:nc + chunk] if nc + chunk <= len(req.prompt_ids) else req.all_ids[nc:nc + chunk]
        if not e.announced:
            batch.new.append(NewRequest(req.req_id, req.prompt_ids, req.params, req.eos_token_ids))
            e.announced = True
        slots = req.slots
        batch.seqs.append(ScheduledSeq(req.req_id, ids, nc, nc + chunk == total, e.synced, slots[e.synced:]))
        e.synced = len(slots)
        s = self._stats
        s.last_prefill_seqs += 1
        s.last_prefill_tokens += chunk
        s.prefill_tokens += chunk
        return chunk

    def schedule(self, now: float) -> ScheduledBatch:
        cfg = self.cfg
        self._continues_window = self.in_window
        self._step += 1
        self._stats.begin_step()
        batch = ScheduledBatch(step=self._step)
        self._pending_swap_in = []
        preemption.debug_preempt(self, batch)
        self._try_swap_in(now, batch)   # swapped requests come back before anything new is admitted

        has_decode = any(not e.in_prefill() for e in self._running)
        mixed = cfg.mixed_steps and self.admission.mixes_steps and has_decode
        if mixed and self.policy.may_preempt_now(self._waiting, self._running):
            mixed = False   # admit (and preempt) first, decodes follow next step
        prefill_ok = step_gate.prefill_allowed(cfg, has_decode, self._since_prefill, self._consec_prefill, mixed)

        used = 0
        if mixed:
            # decodes first (vLLM order): their KV is allocated (preempting if it must) before
            # anything is admitted, so an admission can never be undone in the same step
            preempted = self._stats.preemptions
            self._build_decode(batch, now)
            used = len(batch.seqs)
            if self._stats.preemptions != preempted:
                prefill_ok = False    # memory is short: re-admitting a victim now would only thrash
        if prefill_ok:
            used = self._build_prefill(batch, used, now)
            if len(batch.seqs) > self._stats.last_decode_seqs:
                self._consec_prefill += 1
                self._since_prefill = 0
                return self._finish_batch(batch)
        if not mixed:
            self._build_decode(batch, now)
        self._consec_prefill = 0
        self._since_prefill += 1
        return self._finish_batch(batch)

    def _build_prefill(self, batch: ScheduledBatch, used: int, now: float) -> int:
        cfg = self.cfg
        pol = self.policy
        budget = cfg.max_num_tokens
        started = [e for e in self._running if e.in_prefill()]
        later: list[Entry] = []
        if pol.ranked and self._waiting and started:
            # the step's token budget is a resource too: a higher-ranked request waiting
            # goes before lower-ranked chunks already started
            top = max(map(pol.rank, self._waiting))
            later = [e for e in started if pol.rank(e) < top]
            started = [e for e in started if pol.rank(e) >= top]
        for e in started:
            if used >= budget:
                break
            used += self._emit_prefill(e, budget - used, batch)
        if used < budget and self._waiting and (len(self._running) < cfg.max_batch_size or pol.preempts):
            used += self._admit_waiting(budget - used, now, batch)
        for e in later:
            if used >= budget:
                break
            if e.req.state is RequestState.RUNNING:
                used += self._emit_prefill(e, budget - used, batch)
        return used

    def _build_decode(self, batch: ScheduledBatch, now: float) -> None:
        kv = self.kv
        dec = [e for e in self._running   # not in prefill (inlined: this runs every step)
               if e.req.num_computed >= len(e.req.prompt_ids) + len(e.req.output_ids) - 1]
        dec = dec[: self.cfg.max_num_tokens]
        dec = preemption.make_room_for_decode(self, dec, batch, now)
        if dec is None:
            return
        kv.grow(dec, 1)   # one allocation: the same pages, in the same order, as one per request
        seqs = batch.seqs
        for e in dec:
            r = e.req
            nc = r.num_computed
            np_ = len(r.prompt_ids)
            tok = r.prompt_ids[nc] if nc < np_ else r.output_ids[nc - np_]
            slots = r.slots
            seqs.append(ScheduledSeq(r.req_id, [tok], nc, True, e.synced, slots[e.synced:]))
            e.synced = len(slots)
        self._stats.last_decode_seqs = len(dec)
        if dec:
            self._ratio_steps += 1

    def _finish_batch(self, batch: ScheduledBatch) -> ScheduledBatch:
        batch.swap_in = self._pending_swap_in
        self._pending_swap_in = []
        if not batch.empty:     # an empty batch is not run: the ids wait for one that is
            batch.finished = self._finished
            self._finished = []
        self._note_peak()
        return batch

    def _note_peak(self) -> None:
        used = self.kv.used_tokens()
        if used > self._stats.kv_peak_used:
            self._stats.kv_peak_used = used

    # ------------------------------------------------------------------ results
    def _take_tokens(self, e: Entry, toks: list[int], now: float) -> None:
        """Append sampled tokens (one step's, or k fast-forwarded ones) and charge them."""
        req = e.req
        req.output_ids.extend(toks)
        self._stats.generated_tokens += len(toks)
        if self.policy.charges_tokens:
            self.policy.on_tokens(e, len(toks))
        if req.first_token_at is None:
            req.first_token_at = now

    def on_step(self, batch: ScheduledBatch, result: StepResult, now: float) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        if self._deferred_outputs:
            outs.extend(self._deferred_outputs)
            self._deferred_outputs = []
        tokens = result.tokens
        entries = self._entries
        RUNNING = RequestState.RUNNING
        for seq in batch.seqs:
            e = entries.get(seq.req_id)
            if e is None or e.req.state is not RUNNING:
                continue   # aborted, finished or preempted meanwhile
            req = e.req
            req.num_computed = seq.start_pos + len(seq.token_ids)
            if not seq.sample:
                continue
            toks = tokens.get(seq.req_id)
            if not toks:
                outs.append(self._end(e, FinishReason.ERROR, now,
                                      error=result.errors.get(seq.req_id, "executor returned no token")))
                continue
            if self.kv.tree is not None and len(req.output_ids) == e.out_at_admit:
                self.kv.cache_prefilled(e)
            lps = result.logprobs.get(seq.req_id, []) if result.logprobs else []
            outs.append(self._accept(e, toks, lps, now))
        return outs

    def _accept(self, e: Entry, toks: list[int], lps: list, now: float) -> RequestOutput:
        """A step's sampled tokens for e, in order: they end it at the first stop id or at its
        length limit (tokens past that point are dropped)."""
        req = e.req
        stop = e.stop_ids
        reason = None
        if len(toks) == 1:     # one token per step (no speculation): the common case, kept short
            if toks[0] in stop:
                reason = FinishReason.STOP
            elif len(req.output_ids) + 1 >= e.limit:
                reason = FinishReason.LENGTH
        else:
            toks = toks[: max(0, e.limit - len(req.output_ids))]
            cut = next((i for i, t in enumerate(toks) if t in stop), None)
            if cut is not None:
                toks, reason = toks[: cut + 1], FinishReason.STOP
            elif len(req.output_ids) + len(toks) >= e.limit:
                reason = FinishReason.LENGTH
            lps = lps[: len(toks)]
        self._take_tokens(e, toks, now)
        if reason is not None:
            return self._end(e, reason, now, new_tokens=toks, logprobs=lps)
        return RequestOutput(req.req_id, new_token_ids=toks, logprobs=lps)

    @property
    def in_window(self) -> bool:   # see step_gate.in_window
        return step_gate.in_window(self.cfg, self._since_prefill, bool(self._running))

    def window_cost(self, step_time: float, fixed_overhead: float) -> float:
        """What the last scheduled step costs: vLLM v0.6 multi-step runs the scheduler and
        prepares the inputs once per window (the fixed overhead, paid at its first step);
        every token still goes through output processing, so the per-request term stays."""
        return max(0.0, step_time - fixed_overhead) if self._continues_window else step_time

    # ------------------------------------------------------------------ fast path (simulator)
    def decode_horizon(self, now: float, finishing: bool = False) -> int:
        return fast_path.decode_horizon(self, now, finishing)

    def fast_forward(self, k: int, tokens: dict[str, list[int]], now: float) -> list[RequestOutput]:
        return fast_path.fast_forward(self, k, tokens, now)

    # ------------------------------------------------------------------ stats
    def snapshot(self) -> SchedulerSnapshot:
        return SchedulerSnapshot(self._step, self.kv.used_tokens(), len(self._running), len(self._waiting),
                                 len(self._swapped), self._stats.preemptions)

    def stats(self) -> SchedulerStats:
        s = self._stats
        s.step = self._step
        s.num_running = len(self._running)
        s.num_waiting = len(self._waiting)
        s.num_swapped = len(self._swapped)
        s.kv_free = self.kv.pool.free_tokens
        s.kv_evictable = self.kv.evictable_tokens
        s.kv_used = self.capacity - s.kv_free - s.kv_evictable
        s.kv_host_used = self.kv.host_used
        s.new_token_ratio = self.new_token_ratio
        s.num_prefilling = sum(1 for e in self._running if e.in_prefill())
        return SchedulerStats(**s.__dict__)

    def check_integrity(self) -> None:
        """Raise AssertionError if the KV bookkeeping is off (see KVManager.check)."""
        self.kv.check(self._running, self._waiting, self._swapped)
        assert len(self._entries) == len(self._running) + len(self._waiting) + len(self._swapped)
