"""The scheduler: one decision per step over the waiting queue and the running set.

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
    sched.decode_horizon(now[, finishing]), sched.fast_forward(k, tokens, now)   # the simulator's
    sched.in_window, sched.shape.window_cost(...)                               # multi-step windows

Owners, each handed what it works on: Queues (queues.py) holds where every
request is and makes every move between queues; KVManager (kv_manager.py)
makes every write to KV memory; the admission mode (admission.py) says
whether a candidate fits, whether steps mix and whether a decode may preempt;
the policy (policy.py) orders the queue and ranks requests; Preemption
(preemption.py) picks and makes victims; the step shape (step_shape.py) says
when prefills may join; fast_path.py proves how many steps can only be
decodes; Speculation (speculation.py) says which drafts a decode feeds and
frees the rejected ones' KV. This class decides who runs each step and keeps
the step counter.

Step shape: with mixed steps (the default, vLLM) every running decode gets
its token first, then prefill chunks and admissions fill the rest of
max_num_tokens, at most max_prefill_tokens_with_decodes of them when set
(Sarathi-Serve's budget: a step the running streams wait for carries a
bounded prefill), or at most prefill_budget, the engine's count from a time
budget (--max-prefill-ms-with-decodes), whichever is smaller; a step that had to preempt for decode KV admits nothing.
Otherwise (or under a mode that never mixes) a step is a prefill step
(decodes wait) or a decode step. A request is admitted only when its whole
known sequence gets KV slots at once, so a chunked prefill never runs out of
memory half-way.
"""
from __future__ import annotations

import random as _random
from typing import Optional

from shepherd.config import SchedulerConfig
from shepherd.request import FinishReason, Request, RequestOutput, RequestState, context_error
from shepherd.scheduler.adapters import Adapters
from shepherd.scheduler.admission import Admission, AdmissionState, GrowthRatio, make_admission
from shepherd.scheduler.fast_path import DecodeHorizon
from shepherd.scheduler.kv_manager import KVManager
from shepherd.scheduler.kv_pool import pages_for
from shepherd.scheduler.policy import make_policy
from shepherd.scheduler.preemption import Preemption
from shepherd.scheduler.queues import Queues
from shepherd.scheduler.speculation import Speculation
from shepherd.scheduler.state import Entry, QueueFull, RequestRejected, SchedulerSnapshot, SchedulerStats
from shepherd.scheduler.step_shape import make_step_shape
from shepherd.step import NewRequest, ScheduledBatch, ScheduledSeq, StepResult

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
        self.mode = make_admission(config.admission)
        self.ratio = GrowthRatio(config.new_token_ratio_init, config.new_token_ratio_min,
                                 config.new_token_ratio_decay_steps)
        self.admission = Admission(self.mode, self.kv, self.ratio, config.reserve_cap_tokens)
        self.policy = make_policy(config, self.kv.tree, self.mode)
        self.adapters = Adapters(config)
        self.queues = Queues(self.policy, self.adapters)
        self.shape = make_step_shape(config)
        self.preemption = Preemption(config, self.queues, self.kv, self.policy, self.admission, self.ratio,
                                     self._stats)
        self._horizon = DecodeHorizon(config, self.queues, self.kv, self.policy, self.admission, self.shape)
        self.spec = (Speculation(config.speculative, self.kv, self._stats, self.mode.lockstep)
                     if config.speculative is not None else None)
        self._rng = _random.Random(config.seed)
        self._step = 0
        self._finished: list[str] = []      # ended since the last batch that ran: batch.finished
        self._deferred_outputs: list[RequestOutput] = []   # terminal outputs made inside schedule()
        self._horizon_memo: Optional[tuple] = None         # (state key, horizon with finishing)
        # prompt tokens a step that carries decodes may take, from --max-prefill-ms-with-decodes: the
        # engine derives it from measured step times (engine/prefill_budget.py) and sets it before
        # each schedule(); a number, so no clock is read here. 0 = none. With the token cap set too,
        # the smaller applies.
        self.prefill_budget = 0

    # ------------------------------------------------------------------ views
    @property
    def has_work(self) -> bool:
        q = self.queues
        return bool(q.waiting or q.running or q.swapped)

    @property
    def running(self) -> list[Request]:
        return [e.req for e in self.queues.running]

    @property
    def waiting(self) -> list[Request]:
        return [e.req for e in self.queues.waiting]

    @property
    def swapped(self) -> list[Request]:
        return [e.req for e in self.queues.swapped]

    def get(self, req_id: str) -> Optional[Request]:
        e = self.queues.get(req_id)
        return e.req if e else None

    @property
    def new_token_ratio(self) -> float:
        return self.ratio.value

    @property
    def last_work(self) -> tuple[int, int]:
        """The last schedule()'s (decode tokens, prompt tokens): its decode rows with their drafts,
        and the prompt tokens it computes (prefix-cache hits excluded)."""
        s = self._stats
        return s.last_decode_seqs + s.last_draft_tokens, s.last_prefill_tokens

    @property
    def in_window(self) -> bool:
        """The next step continues a multi-step window (its outputs wait for the window's end)."""
        return self.shape.in_window(bool(self.queues.running))

    # ------------------------------------------------------------------ intake
    def add(self, req: Request, now: float) -> None:
        cfg = self.cfg
        q = self.queues
        if req.req_id in q:
            raise RequestRejected(f"duplicate request id {req.req_id!r}")
        n = len(req.prompt_ids)
        if n == 0:
            raise RequestRejected("empty prompt")
        if req.params.max_tokens < 1:
            raise RequestRejected(f"max_tokens must be >= 1, got {req.params.max_tokens}")
        err = context_error(n, self.max_model_len)
        if err:
            raise RequestRejected(err, kind="context_length")
        if n + 1 > self.capacity:
            raise RequestRejected(
                f"prompt has {n} tokens; with one output token it exceeds the KV capacity of {self.capacity} tokens",
                kind="kv_capacity")
        limit = min(req.params.max_tokens, self.max_model_len - n)
        if self.mode.reserves_output:
            need = n + limit - 1
            if pages_for(need, self.page_size) > self.kv.pool.num_pages:
                raise RequestRejected(
                    f"prompt ({n}) + max_tokens ({limit}) needs {need} KV tokens, more than the capacity "
                    f"of {self.capacity}; admission={cfg.admission} reserves the whole output "
                    f"(lower max_tokens or use admission=optimistic)", kind="kv_capacity")
        if len(q.waiting) >= cfg.max_queue:
            raise QueueFull(f"waiting queue is full ({cfg.max_queue} requests)")
        if len(q) >= cfg.max_concurrency:
            raise QueueFull(f"too many requests in flight ({cfg.max_concurrency})", kind="concurrency_full")
        q.add(req, self._step, limit, self._rng.random())

    # ------------------------------------------------------------------ endings
    def abort(self, req_id: str, now: float) -> Optional[RequestOutput]:
        return self.finish(req_id, FinishReason.ABORT, now)

    def finish(self, req_id: str, reason: FinishReason, now: float) -> Optional[RequestOutput]:
        e = self.queues.get(req_id)
        if e is None:
            return None
        return self._end(e, reason, now)

    def _end(self, e: Entry, reason: FinishReason, now: float, error: Optional[str] = None,
             new_tokens: Optional[list[int]] = None, logprobs=None) -> RequestOutput:
        req = e.req
        was = self.queues.end(e)
        if was is RequestState.RUNNING:
            self.kv.release(e)
        elif was is RequestState.SWAPPED:
            self.kv.drop_host(e)
        req.finish_reason = reason
        req.finished_at = now
        req.error = error
        self._finished.append(req.req_id)
        s = self._stats
        if reason is FinishReason.ABORT:
            s.aborted += 1
        elif reason is FinishReason.ERROR:
            s.errors += 1
        else:
            s.finished += 1
        if not len(self.queues):
            self.ratio.reset()
        return RequestOutput(req.req_id, new_token_ids=new_tokens or [], logprobs=logprobs or [],
                             finished=True, finish_reason=reason, error=error)

    # ------------------------------------------------------------------ admission
    def _admit(self, e: Entry, adm: AdmissionState, now: float, room: int) -> bool:
        """Admit waiting e if it fits (the state `adm` then counts it)."""
        own, b, locked = self.kv.candidate_need(e)
        pin = self.mode.lockstep and own > room    # its prefill will span steps: pinned
        if not (adm.fits_pinned if pin else adm.fits)(own, b, locked):
            return False
        self.kv.admit(e, own)
        (adm.add_pinned if pin else adm.add)(own, b, locked)
        self.queues.admit(e, now)
        return True

    def _try_swap_in(self, now: float, batch: ScheduledBatch) -> None:
        q = self.queues
        if not q.swapped:
            return
        just_out = {op.req_id for op in batch.swap_out}
        adm = self.admission.state(q.running)
        pol = self.policy
        top = max(map(pol.rank, q.waiting), default=None) if pol.ranked else None
        while q.swapped and len(q.running) < self.cfg.max_batch_size:
            e = pol.pick_swap_in(q.swapped, top)
            if e is None or e.req.req_id in just_out:
                break        # swapped out in this very step: back no earlier than the next one
            if not self.adapters.can_run(e.req.adapter):
                break        # its adapter has no slot until a running adapter drains
            own, b, locked = self.kv.swap_need(e)
            if not adm.fits(own, b, locked):
                break
            batch.swap_in.append(self.kv.swap_in(e, own))
            adm.add(own, b, locked)
            q.resume(e, now)

    def _admit_waiting(self, budget: int, now: float, batch: ScheduledBatch) -> int:
        """Admit waiting requests in policy order; returns tokens scheduled."""
        cfg = self.cfg
        pol = self.policy
        q = self.queues
        floor = None
        if q.swapped:
            floor = pol.swap_floor(q.swapped)
            if floor is None:
                return 0     # swapped requests come back first
        adm = self.admission.state(q.running)
        used = skipped = 0
        order = q.admission_order(self._step, cfg.max_batch_size - len(q.running), cfg.lookahead)
        for e in order:      # a snapshot: preemption may requeue victims
            if budget - used <= 0:
                break
            if floor is not None and pol.rank(e) <= floor:
                continue     # not above every swapped request: those come back first
            blocked_by = None
            if len(q.running) >= cfg.max_batch_size:
                blocked_by = "batch"
            elif not self.adapters.admissible(e.req.adapter):
                blocked_by = "adapter"
            elif not self._admit(e, adm, now, room=budget - used):
                blocked_by = "kv"
            if blocked_by in ("batch", "kv") and pol.preempts and self.preemption.preempt_for(e, blocked_by, batch):
                adm = self.admission.state(q.running)
                if len(q.running) < cfg.max_batch_size and self._admit(e, adm, now, room=budget - used):
                    blocked_by = None
            if blocked_by == "batch":
                break
            if blocked_by == "adapter":      # the slots filled since the order was taken
                if self._step - e.enq_step >= cfg.aging_steps:
                    break            # an aged head is not overtaken: the slots drain until it fits
                continue
            if blocked_by == "kv":
                if self._step - e.enq_step >= cfg.aging_steps:
                    break            # an aged head is not overtaken
                skipped += 1
                if skipped > cfg.lookahead:
                    break
                continue
            used += self._emit_prefill(e, budget - used, batch)
        q.close_admissions()
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
            batch.new.append(NewRequest(req.req_id, req.prompt_ids, req.params, req.eos_token_ids, req.adapter))
            e.announced = True
        slots = req.slots
        last = nc + chunk == total
        ask = self.spec.ask(e, len(self.queues.running)) if last and self.spec is not None else 0
        batch.seqs.append(ScheduledSeq(req.req_id, ids, nc, last, e.synced, slots[e.synced:], 0, ask))
        e.synced = len(slots)
        s = self._stats
        s.last_prefill_seqs += 1
        s.last_prefill_tokens += chunk
        s.prefill_tokens += chunk
        return chunk

    def schedule(self, now: float) -> ScheduledBatch:
        q = self.queues
        shape = self.shape
        shape.begin(bool(q.running))
        self._step += 1
        self._stats.begin_step()
        batch = ScheduledBatch(step=self._step)
        self.adapters.begin(now)
        self.preemption.debug_preempt(self._step, batch)
        self._try_swap_in(now, batch)   # swapped requests come back before anything new is admitted

        has_decode = any(not e.in_prefill() for e in q.running)
        # decodes ride along if the shape mixes, the admission mode allows it, and no waiting
        # request is about to preempt a running one (it is admitted first; decodes follow)
        mixed = (has_decode and shape.mixes and self.mode.mixes_steps
                 and not self.policy.may_preempt_now(q.waiting, q.running))
        prefill_ok = not has_decode or shape.prefill_allowed(mixed)

        used = 0
        if mixed:
            # decodes first (vLLM order): their KV is allocated (preempting if it must) before
            # anything is admitted, so an admission can never be undone in the same step
            preempted = self._stats.preemptions
            self._build_decode(batch, now)
            used = len(batch.seqs) + self._stats.last_draft_tokens
            if self._stats.preemptions != preempted:
                prefill_ok = False    # memory is short: re-admitting a victim now would only thrash
        if prefill_ok:
            used = self._build_prefill(batch, used, now, with_decodes=self._stats.last_decode_seqs > 0)
            if len(batch.seqs) > self._stats.last_decode_seqs:
                shape.done(prefilled=True)
                return self._finish_batch(batch)
        if not mixed:
            self._build_decode(batch, now)
        shape.done(prefilled=False)
        return self._finish_batch(batch)

    def _build_prefill(self, batch: ScheduledBatch, used: int, now: float, with_decodes: bool = False) -> int:
        cfg = self.cfg
        pol = self.policy
        q = self.queues
        budget = cfg.max_num_tokens
        cap = cfg.max_prefill_tokens_with_decodes
        timed = self.prefill_budget
        if timed and (not cap or timed < cap):
            cap = timed
        if with_decodes and cap:
            # the running streams wait for this step: its prompt tokens are capped (Sarathi-Serve's
            # budget), the rest of a chunked prompt goes on in the next steps
            budget = min(budget, used + cap)
        started = [e for e in q.running if e.in_prefill()]
        later: list[Entry] = []
        if pol.ranked and q.waiting and started:
            # the step's token budget is a resource too: a higher-ranked request waiting
            # goes before lower-ranked chunks already started
            top = max(map(pol.rank, q.waiting))
            later = [e for e in started if pol.rank(e) < top]
            started = [e for e in started if pol.rank(e) >= top]
        for e in started:
            if used >= budget:
                break
            used += self._emit_prefill(e, budget - used, batch)
        if used < budget and q.waiting and (len(q.running) < cfg.max_batch_size or pol.preempts):
            used += self._admit_waiting(budget - used, now, batch)
        for e in later:
            if used >= budget:
                break
            if e.req.state is RequestState.RUNNING:
                used += self._emit_prefill(e, budget - used, batch)
        return used

    def _build_decode(self, batch: ScheduledBatch, now: float) -> None:
        dec = [e for e in self.queues.running   # not in prefill (inlined: this runs every step)
               if e.req.num_computed >= len(e.req.prompt_ids) + len(e.req.output_ids) - 1]
        dec = dec[: self.cfg.max_num_tokens]
        dec, doomed = self.preemption.make_room_for_decode(dec, batch)
        if doomed is not None:
            e, msg = doomed
            self._deferred_outputs.append(self._end(e, FinishReason.ERROR, now, error=msg))
            return
        self.kv.grow(dec, 1)   # one allocation: the same pages, in the same order, as one per request
        seqs = batch.seqs
        if self.spec is not None:
            self._build_verify(dec, seqs)
        else:
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
            self.ratio.decay()

    def _build_verify(self, dec: list[Entry], seqs: list[ScheduledSeq]) -> None:
        """The decode rows with speculation on: each decoder's last token and the drafts it
        feeds (speculation.py), and how many to draft after this step."""
        spec = self.spec
        drafts = spec.plan(dec, self.cfg.max_num_tokens)
        n = len(dec)
        fed = 0
        for e, d in zip(dec, drafts):
            r = e.req
            nc = r.num_computed
            np_ = len(r.prompt_ids)
            tok = r.prompt_ids[nc] if nc < np_ else r.output_ids[nc - np_]
            slots = r.slots
            seqs.append(ScheduledSeq(r.req_id, [tok, *d], nc, True, e.synced, slots[e.synced:], len(d),
                                     spec.ask(e, n)))
            e.synced = len(slots)
            fed += len(d)
        self._stats.last_draft_tokens = fed

    def _finish_batch(self, batch: ScheduledBatch) -> ScheduledBatch:
        if not batch.empty:     # an empty batch is not run: the ids (and slot changes) wait for one that is
            batch.finished = self._finished
            self._finished = []
            batch.lora_loads = self.adapters.flush()
        self._note_peak()
        return batch

    def _note_peak(self) -> None:
        used = self.kv.used_tokens()
        if used > self._stats.kv_peak_used:
            self._stats.kv_peak_used = used

    # ------------------------------------------------------------------ results
    def on_step(self, batch: ScheduledBatch, result: StepResult, now: float) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        if self._deferred_outputs:
            outs.extend(self._deferred_outputs)
            self._deferred_outputs = []
        tokens = result.tokens
        entries = self.queues.entries
        RUNNING = RequestState.RUNNING
        drafts = result.drafts
        cache_decoded = self.kv.cache_decoded if self.kv.tree is not None else None
        for seq in batch.seqs:
            e = entries.get(seq.req_id)
            if e is None or e.req.state is not RUNNING:
                continue   # aborted, finished or preempted meanwhile
            req = e.req
            # a verify's drafts are not known tokens until accepted (below)
            req.num_computed = seq.start_pos + len(seq.token_ids) - seq.num_draft
            if not seq.sample:
                continue
            if seq.propose:
                e.drafts = drafts.get(seq.req_id) or []
            toks = tokens.get(seq.req_id)
            if not toks:
                outs.append(self._end(e, FinishReason.ERROR, now,
                                      error=result.errors.get(seq.req_id, "executor returned no token")))
                continue
            if self.kv.tree is not None and len(req.output_ids) == e.out_at_admit:
                self.kv.cache_prefilled(e)
            if seq.num_draft:    # the drafts kept before the first token that differs: their KV stays
                kept = min(len(toks), seq.num_draft + 1) - 1
                req.num_computed += kept
                self.spec.settle(e, seq, kept)
            lps = result.logprobs.get(seq.req_id, []) if result.logprobs else []
            outs.append(self._accept(e, toks, lps, now))
            if cache_decoded is not None and req.state is RUNNING:
                cache_decoded(e)     # its full blocks so far, as vLLM caches them (kv_manager.py)
            if result.prompt_logprobs and seq.req_id in result.prompt_logprobs:
                outs[-1].prompt_logprobs = result.prompt_logprobs[seq.req_id]
        return outs

    def _accept(self, e: Entry, toks: list[int], lps: list, now: float, last_only: bool = False) -> RequestOutput:
        """Tokens sampled for e, in order: they end it at the first stop id or at its length
        limit (tokens past that point are dropped). last_only: the caller has made sure no
        token before the last stops it (the fast path)."""
        req = e.req
        stop = e.stop_ids
        reason = None
        if len(toks) == 1 or last_only:      # one token per step: the common case, kept short
            if toks[-1] in stop:
                reason = FinishReason.STOP
            elif len(req.output_ids) + len(toks) >= e.limit:
                reason = FinishReason.LENGTH
        else:
            toks = toks[: max(0, e.limit - len(req.output_ids))]
            cut = next((i for i, t in enumerate(toks) if t in stop), None)
            if cut is not None:
                toks, reason = toks[: cut + 1], FinishReason.STOP
            elif len(req.output_ids) + len(toks) >= e.limit:
                reason = FinishReason.LENGTH
            lps = lps[: len(toks)]
        req.output_ids.extend(toks)
        self._stats.generated_tokens += len(toks)
        if self.policy.charges_tokens:
            self.policy.on_tokens(e, len(toks))
        if req.first_token_at is None:
            req.first_token_at = now
        if reason is not None:
            return self._end(e, reason, now, new_tokens=toks, logprobs=lps)
        return RequestOutput(req.req_id, new_token_ids=toks, logprobs=lps)

    # ------------------------------------------------------------------ fast path (simulator)
    def _horizon_key(self) -> tuple:
        """Changes with every call that can change a horizon: schedule() (the step counter),
        add() (the arrival counter), an ending (the entries), on_step() (tokens sampled)."""
        return self._step, self.queues.arrivals, len(self.queues), self._stats.generated_tokens

    def decode_horizon(self, now: float, finishing: bool = False) -> int:
        """How many next steps can only be the same decode-only batch (fast_path.py)."""
        # with speculation a step's tokens per request depend on the drafts: no horizon
        h = 0 if self._deferred_outputs or self.spec is not None else self._horizon(self._step, finishing)
        if finishing:
            self._horizon_memo = (self._horizon_key(), h)   # fast_forward checks against it
        return h

    def fast_forward(self, k: int, tokens: dict[str, list[int]], now: float) -> list[RequestOutput]:
        """k decode steps at once (k <= decode_horizon(finishing=True)): tokens maps every running
        req_id to the k tokens it sampled; only the last may stop it. Same effect on state as k
        schedule()/on_step() pairs (KV slots, step counter, counters, growth ratio, VTC charges,
        the requests that end at the k-th step) and one RequestOutput per request with its k
        tokens. Raises ValueError beyond the horizon or when an earlier token would stop a
        request (then step normally). Requests that ended before reach the executor with the
        next batch that runs, and so do the k steps' new slots: nothing runs in between."""
        if k <= 0:
            return []
        memo = self._horizon_memo
        h = memo[1] if memo is not None and memo[0] == self._horizon_key() else \
            (0 if self._deferred_outputs or self.spec is not None else self._horizon(self._step, True))
        if k > h:
            raise ValueError(f"fast_forward({k}) beyond decode_horizon()={h}")
        running = self.queues.running
        for e in running:
            toks = tokens.get(e.req.req_id)
            if toks is None or len(toks) != k:
                raise ValueError(f"fast_forward: need {k} tokens for {e.req.req_id}")
            stop = e.stop_ids
            if not stop.isdisjoint(toks) and (toks[-1] not in stop or not stop.isdisjoint(toks[:-1])):
                raise ValueError(f"fast_forward: a token before the last would stop {e.req.req_id}; step normally")
        self.kv.grow(running, k)
        # what schedule() does before the step's on_step: counters, then the KV peak
        st = self._stats
        self._step += k
        self.ratio.decay(k)
        self.shape.skip(k)
        st.begin_step()
        st.last_decode_seqs = len(running)
        self._note_peak()
        kv = self.kv
        if kv.tree is not None:
            self._cache_window(running, k, tokens)
        outs = []
        RUNNING = RequestState.RUNNING
        for e in list(running):    # on_step's order: tokens, then the end of a request that stops
            e.req.num_computed += k
            outs.append(self._accept(e, tokens[e.req.req_id], [], now, last_only=True))
            if kv.tree is not None and e.req.state is RUNNING:
                kv.cache_decoded(e)      # the k-th step's insert, where on_step makes it
        return outs

    def _cache_window(self, running: list[Entry], k: int, tokens: dict[str, list[int]]) -> None:
        """The decode-block inserts (KVManager.cache_decoded) that steps 1..k-1 of a fast-forward
        window make, in the order stepping makes them (step by step, batch order): the tree's
        LRU ticks, nodes and locks come out the same. The horizon ends a window at the first
        insert that might share slots with the tree (KVManager.cache_may_share), so no page
        is freed before the window's last step."""
        kv = self.kv
        due = []
        for i, e in enumerate(running):
            nc0 = e.req.num_computed
            at = kv.next_cache_at(e.cached_len)
            if at <= nc0:
                continue     # a request the cache does not take (a LoRA one): on_step caches none either
            while at < nc0 + k:
                due.append((at - nc0, i, at))
                at = kv.next_cache_at(at)
        if not due:
            return
        due.sort()
        for t, i, at in due:
            e = running[i]
            kv.cache_prefilled(e, at, tokens[e.req.req_id][:t - 1])

    # ------------------------------------------------------------------ stats
    def snapshot(self) -> SchedulerSnapshot:
        q = self.queues
        return SchedulerSnapshot(self._step, self.kv.used_tokens(), len(q.running), len(q.waiting),
                                 len(q.swapped), self._stats.preemptions)

    def stats(self) -> SchedulerStats:
        s = self._stats
        q = self.queues
        s.step = self._step
        s.num_running = len(q.running)
        s.num_waiting = len(q.waiting)
        s.num_swapped = len(q.swapped)
        s.kv_free = self.kv.pool.free_tokens
        s.kv_evictable = self.kv.evictable_tokens
        s.kv_used = self.capacity - s.kv_free - s.kv_evictable
        s.kv_host_used = self.kv.host_used
        s.new_token_ratio = self.ratio.value
        s.prefill_budget = self.prefill_budget
        s.num_prefilling = sum(1 for e in q.running if e.in_prefill())
        ad = self.adapters
        s.max_lora = ad.max_loras
        s.running_lora_adapters = ",".join(ad.running_names())
        s.waiting_lora_adapters = ",".join(ad.waiting_names())
        s.lora_loads = ad.loads
        return SchedulerStats(**s.__dict__)

    def check_integrity(self) -> None:
        """Raise AssertionError if the KV bookkeeping is off (see KVManager.check)."""
        q = self.queues
        self.kv.check(q.running, q.waiting, q.swapped)
        q.check()
