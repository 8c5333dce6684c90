"""The scheduler: waiting queue, running set, one decision per step.

PUBLIC API (the engine, the simulator and the tests rely on exactly this; the
scheduler helper fills in the bodies). Pure logic: no tensors, no clock of its
own (`now` is passed in), no I/O except logging.

    sched = Scheduler(SchedulerConfig(...), host_kv_capacity=0, max_model_len=8192)
    sched.add(req, now)            # raises QueueFull (-> HTTP 429) or RequestRejected (-> HTTP 400)
    out = sched.abort(req_id, now) # -> RequestOutput (terminal, ABORT) or None if unknown/finished;
                                   #    frees its KV at once; the executor is told via the next batch.released
    out = sched.finish(req_id, reason, now)  # engine found a stop string: terminal output, KV freed
    batch = sched.schedule(now)    # -> ScheduledBatch (may be empty)
    outs = sched.on_step(batch, result, now)  # append sampled tokens, detect EOS/stop ids/max_tokens,
                                              # return one RequestOutput per request that produced a token
                                              # or finished (errors too)
    sched.has_work                 # anything waiting, running or swapped
    sched.stats()                  # -> SchedulerStats

ADDED (beyond the stub):

    sched.check_integrity()        # raises AssertionError if KV bookkeeping is off; when idle also
                                   # checks free + evictable == capacity and no locked cache node
    sched.decode_horizon(now) -> int
        k >= 0 such that, if nothing arrives or is aborted and no request stops
        early (EOS / stop id / stop string), the next k schedule() calls would
        each return the same decode-only batch (only positions advance): no
        admission or swap-in possible, no max_tokens/max_model_len finish, no
        allocation that needs eviction or preemption, no forced (debug)
        preemption, no aging/policy change that could alter the batch. 0 when
        the next step is anything else. Conservative: it may return less than
        the true value, never more.
    sched.fast_forward(k, tokens, now) -> list[RequestOutput]
        Apply k such steps at once (k <= decode_horizon(now)): tokens maps
        every running req_id to the k tokens it sampled. Same effect on state
        as k schedule()/on_step() pairs (KV slots, step counter, counters,
        new_token_ratio decay, VTC charges, stats), and one RequestOutput per
        request carrying its k tokens. Raises ValueError if k exceeds the
        horizon or a token would stop a request (then step normally).
    sched.running / sched.waiting / sched.swapped  # read-only views (lists of Request)
    sched.get(req_id) -> Request | None

Step shape: with mixed_steps (the default, vLLM) every running decode gets its
token first, then prefill chunks and admissions fill the rest of max_num_tokens,
in one step; a step that had to preempt for decode KV admits nothing. Peak
admission never mixes (its estimate needs lockstep growth). Without
it a step is either a prefill step (chunks of admitted prompts; decodes wait) or
a decode step (SGLang): prefill-first, at most max_consecutive_prefill prefill
steps in a row while decodes wait. With decode_first_prefill_every=N, prefills
join only every N steps (LightLLM), in either shape. A request is admitted only when its whole known sequence
(prompt, plus generated tokens after a recompute) gets KV slots at once, so a
chunked prefill never runs out of memory half-way.
"""
from __future__ import annotations

import logging
import random as _random
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Optional

from shepherd.config import SchedulerConfig
from shepherd.engine.executor import ScheduledBatch, ScheduledSeq, StepResult, SwapOp
from shepherd.request import FinishReason, Request, RequestOutput, RequestState
from shepherd.scheduler.admission import AdmissionState
from shepherd.scheduler.kv_pool import KVPool
from shepherd.scheduler.policy import make_policy
from shepherd.scheduler.radix_cache import RadixCache

logger = logging.getLogger("shepherd.scheduler")

RETRACT_DECODE_STEPS = 20   # SGLang's allowance when re-estimating new_token_ratio after a preemption


class QueueFull(Exception):
    """max_queue / max_concurrency reached: answer 429 with Retry-After."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class RequestRejected(ValueError):
    """The request can never be served under this configuration (e.g. prompt + 1 > capacity)."""


@dataclass
class SchedulerStats:
    step: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_capacity: int = 0
    kv_used: int = 0          # slots held by requests (running, or locked cache nodes they use)
    kv_evictable: int = 0     # slots held only by the prefix cache, reclaimable
    kv_free: int = 0          # never-used or released slots; free + evictable + used == capacity
    preemptions: int = 0
    preempted_tokens: int = 0         # KV tokens thrown away (recompute) or moved (swap) by preemption
    prefix_query_tokens: int = 0      # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0        # of those, served from the cache
    # last step's prefill, for SGLang-style log lines
    last_prefill_seqs: int = 0
    last_prefill_tokens: int = 0
    last_cached_tokens: int = 0
    last_decode_seqs: int = 0
    # --- added by the scheduler helper ---
    num_prefilling: int = 0           # running requests whose prompt is not fully computed
    kv_peak_used: int = 0             # max kv_used seen at the end of any schedule()
    kv_host_capacity: int = 0
    kv_host_used: int = 0             # swap pool tokens in use
    new_token_ratio: float = 0.0      # optimistic admission's current growth estimate
    generated_tokens: int = 0         # total tokens sampled
    prefill_tokens: int = 0           # total prompt tokens computed (cache hits excluded)
    finished: int = 0                 # requests ended with stop/length
    aborted: int = 0
    errors: int = 0
    swap_out_tokens: int = 0          # totals of the swap ops emitted
    swap_in_tokens: int = 0
    last_swap_out: int = 0
    last_swap_in: int = 0
    last_preemptions: int = 0         # preemptions made by the last schedule()


class _Entry:
    """Scheduler-private bookkeeping for one request."""
    __slots__ = ("req", "seq", "enq_step", "admit_seq", "node", "cached_len", "limit", "final",
                 "rand_key", "fresh", "host_tokens", "admitted_once", "stop_ids", "out_at_admit")

    def __init__(self, req: Request, seq: int, step: int, limit: int, rand_key: float):
        self.req = req
        self.seq = seq
        self.enq_step = step
        self.admit_seq = 0
        self.node = None
        self.cached_len = 0
        self.limit = limit                           # effective max output tokens
        self.final = len(req.prompt_ids) + limit - 1  # positions that may ever need KV
        self.rand_key = rand_key
        self.fresh = False
        self.host_tokens = 0
        self.admitted_once = False
        self.out_at_admit = 0
        stop = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            stop.update(req.eos_token_ids)
        self.stop_ids = frozenset(stop)


class Scheduler:
    def __init__(self, config: SchedulerConfig, host_kv_capacity: int = 0, max_model_len: int = 8192):
        self.cfg = config.validate()
        self.capacity = config.max_total_tokens
        self.page_size = config.page_size
        self.max_model_len = max_model_len
        self.host_kv_capacity = max(0, int(host_kv_capacity))
        self.pool = KVPool(self.capacity, self.page_size)
        self.tree: Optional[RadixCache] = RadixCache(self.pool) if config.prefix_cache else None
        self.policy = make_policy(config, self.tree)
        self._rng = _random.Random(config.seed)

        self._entries: dict[str, _Entry] = {}
        self._waiting: deque[_Entry] = deque()
        self._running: list[_Entry] = []
        self._swapped: deque[_Entry] = deque()
        self._released: list[str] = []
        self._seq = 0
        self._admit_seq = 0
        self._step = 0
        self._consec_prefill = 0
        self._since_prefill = 0
        self._host_used = 0
        # new_token_ratio = max(min, base - delta * decode steps since base was set)
        self._ratio_base = config.new_token_ratio_init
        self._ratio_steps = 0
        self._ratio_delta = ((config.new_token_ratio_init - config.new_token_ratio_min)
                             / max(1, config.new_token_ratio_decay_steps))
        self._stats = SchedulerStats(kv_capacity=self.capacity, kv_free=self.capacity,
                                     kv_host_capacity=self.host_kv_capacity)
        self._deferred_outputs: list[RequestOutput] = []   # terminal outputs made inside schedule()
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

    @property
    def step_count(self) -> int:
        return self._step

    def get(self, req_id: str) -> Optional[Request]:
        e = self._entries.get(req_id)
        return e.req if e else None

    @property
    def new_token_ratio(self) -> float:
        return max(self.cfg.new_token_ratio_min, self._ratio_base - self._ratio_delta * self._ratio_steps)

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
        if n + 1 > self.max_model_len:
            raise RequestRejected(
                f"prompt has {n} tokens; with one output token it exceeds max_model_len={self.max_model_len}")
        if n + 1 > self.capacity:
            raise RequestRejected(
                f"prompt has {n} tokens; with one output token it exceeds the KV capacity of {self.capacity} tokens")
        limit = min(req.params.max_tokens, self.max_model_len - n)
        if cfg.admission != "optimistic":
            need = n + limit - 1
            need_pages = -(-need // self.page_size)
            if need_pages > self.pool.num_pages:
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
        e = _Entry(req, self._seq, self._step, limit, self._rng.random())
        self._entries[req.req_id] = e
        self._waiting.append(e)
        self.policy.on_add(e, self._waiting)

    # ------------------------------------------------------------------ endings
    def abort(self, req_id: str, now: float) -> Optional[RequestOutput]:
        e = self._entries.get(req_id)
        if e is None:
            return None
        return self._end(e, FinishReason.ABORT, now)

    def finish(self, req_id: str, reason: FinishReason, now: float) -> Optional[RequestOutput]:
        e = self._entries.get(req_id)
        if e is None:
            return None
        return self._end(e, reason, now)

    def _end(self, e: _Entry, reason: FinishReason, now: float, error: Optional[str] = None,
             new_tokens: Optional[list[int]] = None, logprobs=None) -> RequestOutput:
        req = e.req
        st = req.state
        if st is RequestState.RUNNING:
            self._running.remove(e)
            self._release_kv(e)
        elif st is RequestState.WAITING:
            self._waiting.remove(e)
            self.policy.on_leave_queue(e, self._waiting)
        elif st is RequestState.SWAPPED:
            self._swapped.remove(e)
            self._host_used -= e.host_tokens
            e.host_tokens = 0
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        req.finished_at = now
        req.error = error
        del self._entries[req.req_id]
        self._released.append(req.req_id)
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

    # ------------------------------------------------------------------ KV helpers
    def _own_pages(self, e: _Entry) -> list[int]:
        return self.pool.pages_of(e.req.slots, e.cached_len)

    def _alloc(self, npages: int) -> Optional[list[int]]:
        pool = self.pool
        if npages > pool.free_pages and self.tree is not None:
            self.tree.evict((npages - pool.free_pages) * self.page_size)
        return pool.alloc(npages)

    def _available_pages(self) -> int:
        ev = self.tree.evictable_size // self.page_size if self.tree is not None else 0
        return self.pool.free_pages + ev

    def _release_kv(self, e: _Entry, cache: bool = True) -> None:
        """Give back a request's device KV: computed full pages go into the prefix
        cache (when on), duplicates and the rest to the free list."""
        req = e.req
        pool = self.pool
        slots = req.slots
        if self.tree is not None and cache:
            p = self.page_size
            n = min(req.num_computed, len(slots))
            n -= n % p
            if n > e.cached_len:
                existing = self.tree.insert(req.all_ids[:n], slots[:n])
                if existing > e.cached_len:
                    pool.free(pool.pages_of(slots, e.cached_len, existing))
                pool.free(pool.pages_of(slots, n))
            else:
                pool.free(pool.pages_of(slots, e.cached_len))
        else:
            pool.free(pool.pages_of(slots, e.cached_len))
        if e.node is not None:
            self.tree.dec_lock_ref(e.node)
            e.node = None
        e.cached_len = 0
        req.slots = []

    def _cache_prefilled(self, e: _Entry) -> None:
        """SGLang's cache_unfinished_req: once a prompt is computed, put it in the
        prefix cache right away (not only when the request ends), so that requests
        arriving meanwhile with the same prefix hit it. Where the tree already held
        some of these tokens, the request switches to the tree's slots and frees its
        duplicates (the executor is told with fresh=True)."""
        req = e.req
        p = self.page_size
        n = req.num_computed
        n -= n % p
        if n <= e.cached_len:
            return
        tree = self.tree
        ids = req.all_ids[:n]
        existing = tree.insert(ids, req.slots[:n])
        slots, node = tree.match_prefix(ids, touch=False)
        assert len(slots) == n
        if existing > e.cached_len:
            self.pool.free(self.pool.pages_of(req.slots, e.cached_len, existing))
            req.slots[e.cached_len:existing] = slots[e.cached_len:existing]
            e.fresh = True
        tree.inc_lock_ref(node)
        if e.node is not None:
            tree.dec_lock_ref(e.node)
        e.node = node
        e.cached_len = n

    def _reset_ratio(self, base: float) -> None:
        self._ratio_base = base
        self._ratio_steps = 0

    # ------------------------------------------------------------------ preemption
    def _pick_victim(self, exclude: Optional[_Entry] = None, below_priority: Optional[int] = None,
                     busy: Optional[set] = None):
        cands = self._running
        if busy:
            cands = [e for e in cands if e.req.req_id not in busy]
        if below_priority is not None:
            cands = [e for e in cands if e.req.priority < below_priority]
        if exclude is not None:
            cands = [e for e in cands if e is not exclude]
        if not cands:
            return None
        v = self.cfg.victim
        if below_priority is not None or v == "lowest-priority":
            return min(cands, key=lambda e: (e.req.priority, -e.admit_seq))
        if v == "fewest-output":
            return min(cands, key=lambda e: (len(e.req.output_ids), -len(e.req.prompt_ids), -e.admit_seq))
        return max(cands, key=lambda e: e.admit_seq)

    def _preempt(self, e: _Entry, batch: ScheduledBatch, why: str) -> None:
        req = e.req
        tokens = req.num_computed
        self._running.remove(e)
        s = self._stats
        mode = "recompute"
        if (self.cfg.preemption == "swap" and tokens > 0
                and self._host_used + tokens <= self.host_kv_capacity):
            mode = "swap"
            batch.swap_out.append(SwapOp(req.req_id, req.slots[:tokens]))
            self._host_used += tokens
            e.host_tokens = tokens
            s.swap_out_tokens += tokens
            s.last_swap_out += tokens
            self._release_kv(e, cache=False)
            req.state = RequestState.SWAPPED
            self._swapped.append(e)
        else:
            self._release_kv(e, cache=True)
            req.num_computed = 0
            req.state = RequestState.WAITING
            self._waiting.appendleft(e)
            self.policy.on_add(e, self._waiting)
            self._released.append(req.req_id)
        req.preemptions += 1
        s.preemptions += 1
        s.last_preemptions += 1
        s.preempted_tokens += tokens
        logger.info("preempt %s (%s, %s): %d KV tokens %s, %d output tokens so far, running=%d",
                    req.req_id, why, mode, tokens, "moved to host" if mode == "swap" else "thrown away",
                    len(req.output_ids), len(self._running))
        # SGLang: re-estimate the growth ratio from what the survivors actually produced
        if self.cfg.admission == "optimistic":
            run = self._running
            tot = sum(x.limit for x in run)
            if tot:
                obs = (sum(len(x.req.output_ids) for x in run) + RETRACT_DECODE_STEPS * len(run)) / tot
                self._reset_ratio(min(1.0, max(self.new_token_ratio, obs)))

    # ------------------------------------------------------------------ admission
    def _pairs(self) -> list[tuple[int, int]]:
        p = self.page_size
        s = p - 1
        out = []
        for e in self._running:
            req = e.req
            own = (-(-(len(req.slots) - e.cached_len) // p)) * p
            b = e.final - len(req.slots)
            out.append((own, b + s if b > 0 else 0))
        return out

    def _admission_state(self) -> AdmissionState:
        free = self._available_pages() * self.page_size
        return AdmissionState(self.cfg.admission, self._pairs(), free,
                              self.new_token_ratio, self.cfg.reserve_cap_tokens)

    def _candidate_need(self, e: _Entry):
        """(own tokens, growth b, locked-from-free) for admitting waiting e now.
        No side effects: a failed attempt leaves the cache exactly as it was."""
        req = e.req
        ids = req.all_ids
        hit = locked = 0
        if self.tree is not None:
            hit, locked = self.tree.match_info(ids[:-1])
        p = self.page_size
        own = self.pool.pages_needed(hit, len(ids) - hit) * p
        b = e.final - len(ids)
        b = b + p - 1 if b > 0 else 0
        return own, b, locked

    def _swap_need(self, e: _Entry):
        p = self.page_size
        n = e.req.num_tokens
        own = self.pool.pages_needed(0, n) * p
        b = e.final - n
        return own, (b + p - 1 if b > 0 else 0), 0

    def _admit(self, e: _Entry, adm: AdmissionState, now: float, resume_swap: bool = False) -> bool:
        req = e.req
        p = self.page_size
        if resume_swap:
            own, b, _ = self._swap_need(e)
            if not adm.fits(own, b, 0):
                return False
            pages = self._alloc(own // p)
            assert pages is not None, "admission promised pages"
            req.slots = []
            self.pool.extend(req.slots, req.num_tokens, pages)
            n = req.num_computed
            self._pending_swap_in.append(SwapOp(req.req_id, req.slots[:n]))
            self._host_used -= e.host_tokens
            self._stats.swap_in_tokens += e.host_tokens
            self._stats.last_swap_in += e.host_tokens
            e.host_tokens = 0
            adm.add(own, b, 0)
        else:
            own, b, locked = self._candidate_need(e)
            if not adm.fits(own, b, locked):
                return False
            ids = req.all_ids
            hit = 0
            req.slots = []
            if self.tree is not None:
                hit_slots, node = self.tree.match_prefix(ids[:-1], touch=True)
                hit = len(hit_slots)
                if hit:
                    self.tree.inc_lock_ref(node)
                    e.node = node
                req.slots = hit_slots
                if own != self.pool.pages_needed(hit, len(ids) - hit) * p:
                    raise AssertionError("match_prefix disagrees with match_info")
                self._stats.prefix_query_tokens += len(ids)
            e.cached_len = hit
            pages = self._alloc(own // p)
            assert pages is not None, "admission promised pages"
            self.pool.extend(req.slots, len(ids) - hit, pages)
            req.num_computed = hit
            if not e.admitted_once:
                req.num_cached = hit
            self._stats.prefix_hit_tokens += hit
            self._stats.last_cached_tokens += hit
            adm.add(own, b, locked)
            self.policy.on_leave_queue(e, self._waiting)
            self.policy.on_admit(e, not e.admitted_once)
        e.fresh = True
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
        prio = self.cfg.policy == "priority"
        top = max((e.req.priority for e in self._waiting), default=None) if prio else None
        while self._swapped and len(self._running) < self.cfg.max_batch_size:
            if prio:
                e = max(self._swapped, key=lambda x: (x.req.priority, -x.seq))
                if top is not None and e.req.priority < top:
                    break    # a higher-priority request waits: it goes first
            else:
                e = self._swapped[0]
            if e.req.req_id in just_out:
                break        # swapped out in this very step: back no earlier than the next one
            if not self._admit(e, adm, now, resume_swap=True):
                break
            self._swapped.remove(e)

    def _undo_swap_in(self, e: _Entry) -> None:
        """Take back a swap-in decided earlier in this step (the executor never saw it)."""
        req = e.req
        op = next(o for o in self._pending_swap_in if o.req_id == req.req_id)
        self._pending_swap_in.remove(op)
        self._running.remove(e)
        self.pool.free(self.pool.pages_of(req.slots, 0))
        req.slots = []
        e.host_tokens = len(op.slots)
        self._host_used += e.host_tokens
        self._stats.swap_in_tokens -= e.host_tokens
        self._stats.last_swap_in -= e.host_tokens
        req.state = RequestState.SWAPPED
        self._swapped.appendleft(e)

    def _admit_waiting(self, adm: AdmissionState, budget: int, now: float, batch: ScheduledBatch) -> int:
        """Admit waiting requests in policy order; returns tokens scheduled."""
        cfg = self.cfg
        used = 0
        if not self._waiting:
            return 0
        floor = None
        if self._swapped:
            if cfg.policy != "priority":
                return 0     # swapped requests come back first
            floor = max(e.req.priority for e in self._swapped)
        room = cfg.max_batch_size - len(self._running)
        # snapshot: preemption may requeue victims while we iterate
        order = list(islice(self.policy.order(self._waiting, self._step), max(room, 1) + cfg.lookahead + 1))
        admitted: list[_Entry] = []
        skipped = 0
        aging = cfg.aging_steps
        for e in order:
            if budget - used <= 0:
                break
            if floor is not None and e.req.priority <= floor:
                continue     # not above every swapped request: those come back first
            blocked_by = None
            if len(self._running) >= cfg.max_batch_size:
                blocked_by = "batch"
            elif not self._admit(e, adm, now):
                blocked_by = "kv"
            if blocked_by is not None and cfg.policy == "priority" and cfg.admission == "optimistic":
                if self._priority_preempt(e, blocked_by, batch):
                    adm = self._admission_state()
                    if len(self._running) < cfg.max_batch_size and self._admit(e, adm, now):
                        blocked_by = None
            if blocked_by == "batch":
                break
            if blocked_by == "kv":
                if self._step - e.enq_step >= aging:
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

    def _priority_preempt(self, cand: _Entry, blocked_by: str, batch: ScheduledBatch) -> bool:
        """Preempt lower-priority running requests so that cand fits; only if it will."""
        prio = cand.req.priority
        # already given work (or swapped in) this step: not victims
        busy = {sq.req_id for sq in batch.seqs} | {op.req_id for op in self._pending_swap_in}
        lower = [e for e in self._running if e.req.priority < prio and e.req.req_id not in busy]
        if not lower:
            return False
        if blocked_by == "batch" and len(self._running) - len(lower) >= self.cfg.max_batch_size:
            return False
        # would cand fit with all of them gone?
        keep = [e for e in self._running if not (e.req.priority < prio and e.req.req_id not in busy)]
        p = self.page_size
        freed = sum(len(self._own_pages(e)) for e in lower) * p
        saved = self._running
        self._running = keep
        try:
            adm = self._admission_state()
        finally:
            self._running = saved
        adm.free += freed
        own, b, locked = self._candidate_need(cand)
        if not adm.fits(own, b, locked):
            return False
        while True:
            v = self._pick_victim(below_priority=prio, busy=busy)
            if v is None:
                return True
            self._preempt(v, batch, f"priority {prio} > {v.req.priority}")
            if blocked_by == "batch" and len(self._running) >= self.cfg.max_batch_size:
                continue
            if self._admission_state().fits(*self._candidate_need(cand)):
                return True

    # ------------------------------------------------------------------ batch building
    def _emit_prefill(self, e: _Entry, budget: int, batch: ScheduledBatch) -> int:
        req = e.req
        nc = req.num_computed
        total = req.num_tokens
        chunk = min(budget, total - nc)
        if chunk <= 0:
            return 0
        ids = req.prompt_ids[nc:nc + chunk] if nc + chunk <= len(req.prompt_ids) else req.all_ids[nc:nc + chunk]
        batch.seqs.append(ScheduledSeq(req, ids, nc, sample=(nc + chunk == total), fresh=e.fresh))
        e.fresh = False
        s = self._stats
        s.last_prefill_seqs += 1
        s.last_prefill_tokens += chunk
        s.prefill_tokens += chunk
        return chunk

    def _in_prefill(self, e: _Entry) -> bool:
        r = e.req
        return r.num_computed < r.num_tokens - 1

    def schedule(self, now: float) -> ScheduledBatch:
        cfg = self.cfg
        self._step += 1
        step = self._step
        s = self._stats
        s.last_prefill_seqs = s.last_prefill_tokens = s.last_cached_tokens = s.last_decode_seqs = 0
        s.last_swap_in = s.last_swap_out = s.last_preemptions = 0
        batch = ScheduledBatch(step=step)
        self._pending_swap_in: list[SwapOp] = []

        # fault injection
        k = cfg.debug_preempt_every
        if k and step % k == 0 and self._running:
            # only a request that produced a token since it was (re)admitted, so that
            # injected faults can never livelock a long chunked prefill
            saved = self._running
            self._running = [e for e in saved if len(e.req.output_ids) > e.out_at_admit]
            v = self._pick_victim()
            self._running = saved
            if v is not None:
                self._preempt(v, batch, f"debug_preempt_every={k}")

        # swapped requests come back before anything new is admitted
        self._try_swap_in(now, batch)

        has_decode = any(not self._in_prefill(e) for e in self._running)
        # peak admission's exact estimate assumes every running request grows one token per
        # step in lockstep; a request prefilling while others decode falls behind them and
        # can then hold its peak after theirs, past the estimate. So peak never mixes.
        mixed = cfg.mixed_steps and cfg.admission != "peak" and has_decode
        if (mixed and cfg.policy == "priority" and cfg.admission == "optimistic" and self._waiting
                and max(e.req.priority for e in self._waiting) > min(e.req.priority for e in self._running)):
            mixed = False   # a higher priority may preempt: admit first, decodes follow next step
        N = cfg.decode_first_prefill_every
        if N > 0:
            prefill_ok = (not has_decode) or self._since_prefill >= N
        else:
            m = cfg.max_consecutive_prefill
            prefill_ok = (not has_decode) or m == 0 or self._consec_prefill < m or mixed

        used = 0
        if mixed:
            # decodes first (vLLM order): their KV is allocated (preempting if it must) before
            # anything is admitted, so an admission can never be undone in the same step
            preempted = self._stats.preemptions
            self._build_decode(batch, now)
            used = len(batch.seqs)
            if batch.seqs:
                self._ratio_steps += 1
            if self._stats.preemptions != preempted:
                prefill_ok = False    # memory is short: re-admitting a victim now would only thrash
        if prefill_ok:
            budget = cfg.max_num_tokens
            started = [e for e in self._running if self._in_prefill(e)]
            later: list[_Entry] = []
            if cfg.policy == "priority" and self._waiting and started:
                # the step's token budget is a resource too: a higher-priority request waiting
                # goes before lower-priority chunks already started
                top = max(e.req.priority for e in self._waiting)
                later = [e for e in started if e.req.priority < top]
                started = [e for e in started if e.req.priority >= top]
            for e in started:
                if used >= budget:
                    break
                used += self._emit_prefill(e, budget - used, batch)
            may_preempt_for_slot = cfg.policy == "priority" and cfg.admission == "optimistic"
            if used < budget and self._waiting and (len(self._running) < cfg.max_batch_size
                                                     or may_preempt_for_slot):
                used += self._admit_waiting(self._admission_state(), budget - used, now, batch)
            for e in later:
                if used >= budget:
                    break
                if e.req.state is RequestState.RUNNING:
                    used += self._emit_prefill(e, budget - used, batch)
            if len(batch.seqs) > self._stats.last_decode_seqs:
                self._consec_prefill += 1
                self._since_prefill = 0
                return self._finish_batch(batch)
        if mixed:
            self._consec_prefill = 0
            self._since_prefill += 1
            return self._finish_batch(batch)

        # decode step
        self._consec_prefill = 0
        self._since_prefill += 1
        self._build_decode(batch, now)
        if batch.seqs:
            self._ratio_steps += 1
        return self._finish_batch(batch)

    def _build_decode(self, batch: ScheduledBatch, now: float) -> None:
        pool = self.pool
        p = self.page_size
        dec = []
        need = {}
        total = 0
        for e in self._running:
            r = e.req
            nc = r.num_computed
            if nc < len(r.prompt_ids) + len(r.output_ids) - 1:
                continue                      # still in prefill
            dec.append(e)
            L = len(r.slots)
            if L <= nc:
                n = 1 if p == 1 else (1 if L % p == 0 else 0)
            else:
                n = 0
            need[id(e)] = n
            total += n
        if len(dec) > self.cfg.max_num_tokens:
            for e in dec[self.cfg.max_num_tokens:]:
                total -= need.pop(id(e))
            dec = dec[: self.cfg.max_num_tokens]
        while total > self._available_pages():
            # never preempt the last decoder for nothing: it is the one that must progress
            exclude = dec[0] if len(dec) == 1 else None
            busy = {op.req_id for op in self._pending_swap_in}
            v = self._pick_victim(exclude=exclude, busy=busy) if busy else self._pick_victim(exclude=exclude)
            if v is None and busy:
                u = next((x for x in reversed(self._running) if x.req.req_id in busy and x is not exclude), None)
                if u is not None:
                    self._undo_swap_in(u)
                    if id(u) in need:
                        total -= need.pop(id(u))
                        dec = [x for x in dec if x is not u]
                    continue
            if v is None:
                # alone and still no room: this request can never fit
                e = dec[0]
                msg = (f"request needs {e.req.num_computed + 1} KV tokens, more than the capacity "
                       f"of {self.capacity} (prompt {len(e.req.prompt_ids)}, output {len(e.req.output_ids)})")
                logger.warning("request %s: %s", e.req.req_id, msg)
                self._deferred_outputs.append(self._end(e, FinishReason.ERROR, now, error=msg))
                return
            if self.cfg.admission != "optimistic":
                logger.warning("admission=%s ran out of KV: preempting (this is a bug)", self.cfg.admission)
            self._preempt(v, batch, "out of KV for decode")
            if id(v) in need:
                total -= need.pop(id(v))
                dec = [x for x in dec if x is not v]
        # one allocation for the whole step: the same pages, in the same order, as one per request
        pages = self._alloc(total)
        assert pages is not None
        j = 0
        seqs = batch.seqs
        for e in dec:
            r = e.req
            nc = r.num_computed
            slots = r.slots
            if len(slots) <= nc:
                if p == 1:
                    slots.append(pages[j])
                    j += 1
                elif need[id(e)]:
                    slots.append(pages[j] * p)
                    j += 1
                else:
                    slots.append(slots[-1] + 1)
            np_ = len(r.prompt_ids)
            tok = r.prompt_ids[nc] if nc < np_ else r.output_ids[nc - np_]
            seqs.append(ScheduledSeq(r, [tok], nc, sample=True, fresh=e.fresh))
            e.fresh = False
        self._stats.last_decode_seqs = len(dec)

    def _finish_batch(self, batch: ScheduledBatch) -> ScheduledBatch:
        batch.swap_in = self._pending_swap_in
        self._pending_swap_in = []
        batch.released = self._released
        self._released = []
        used = self.capacity - self.pool.free_tokens - (self.tree.evictable_size if self.tree else 0)
        if used > self._stats.kv_peak_used:
            self._stats.kv_peak_used = used
        return batch

    # ------------------------------------------------------------------ results
    def on_step(self, batch: ScheduledBatch, result: StepResult, now: float) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        if self._deferred_outputs:
            outs.extend(self._deferred_outputs)
            self._deferred_outputs = []
        tokens = result.tokens
        s = self._stats
        charge = self.policy.on_tokens if self.policy.charges_tokens else None
        entries = self._entries
        RUNNING = RequestState.RUNNING
        for seq in batch.seqs:
            req = seq.req
            e = entries.get(req.req_id)
            if e is None or e.req is not req or req.state is not RUNNING:
                continue   # aborted or finished meanwhile
            req.num_computed = seq.start_pos + len(seq.token_ids)
            if not seq.sample:
                continue
            tok = tokens.get(req.req_id)
            if tok is None:
                outs.append(self._end(e, FinishReason.ERROR, now, error="executor returned no token"))
                continue
            if self.tree is not None and len(req.output_ids) == e.out_at_admit:
                self._cache_prefilled(e)
            req.output_ids.append(tok)
            s.generated_tokens += 1
            if charge:
                charge(e, 1)
            if req.first_token_at is None:
                req.first_token_at = now
            lp = result.logprobs.get(req.req_id) if result.logprobs else None
            lps = [lp] if lp is not None else []
            reason = None
            if tok in e.stop_ids:
                reason = FinishReason.STOP
            elif len(req.output_ids) >= e.limit:
                reason = FinishReason.LENGTH
            if reason is not None:
                outs.append(self._end(e, reason, now, new_tokens=[tok], logprobs=lps))
            else:
                outs.append(RequestOutput(req.req_id, new_token_ids=[tok], logprobs=lps))
        return outs

    # ------------------------------------------------------------------ stats
    def stats(self) -> SchedulerStats:
        s = self._stats
        s.step = self._step
        s.num_running = len(self._running)
        s.num_waiting = len(self._waiting)
        s.num_swapped = len(self._swapped)
        s.kv_free = self.pool.free_tokens
        s.kv_evictable = self.tree.evictable_size if self.tree is not None else 0
        s.kv_used = self.capacity - s.kv_free - s.kv_evictable
        s.kv_host_used = self._host_used
        s.new_token_ratio = self.new_token_ratio
        s.num_prefilling = sum(1 for e in self._running if self._in_prefill(e))
        return SchedulerStats(**s.__dict__)

    def check_integrity(self) -> None:
        pool = self.pool
        free = pool.free_list()
        seen: dict[int, str] = {}
        for pg in free:
            assert pg not in seen, f"page {pg} twice in the free list"
            seen[pg] = "free"
        if self.tree is not None:
            self.tree.check()
            for pg in self.tree.all_pages():
                assert pg not in seen, f"cache page {pg} also {seen[pg]}"
                seen[pg] = "cache"
        for e in self._running:
            r = e.req
            assert r.state is RequestState.RUNNING
            assert len(r.slots) >= r.num_computed, (r.req_id, len(r.slots), r.num_computed)
            assert e.cached_len % self.page_size == 0
            assert len(r.slots) <= r.num_tokens, (r.req_id, len(r.slots), r.num_tokens)
            for pg in self._own_pages(e):
                assert pg not in seen, f"page {pg} of {r.req_id} also {seen[pg]}"
                seen[pg] = r.req_id
        assert len(seen) == pool.num_pages, f"{pool.num_pages - len(seen)} pages leaked"
        for e in self._waiting:
            assert e.req.state is RequestState.WAITING and not e.req.slots and e.node is None
        for e in self._swapped:
            assert e.req.state is RequestState.SWAPPED and not e.req.slots and e.host_tokens > 0
        assert self._host_used == sum(e.host_tokens for e in self._swapped)
        assert self._host_used <= self.host_kv_capacity
        assert len(self._entries) == len(self._running) + len(self._waiting) + len(self._swapped)
        if not self._running:
            ev = self.tree.evictable_size if self.tree is not None else 0
            prot = self.tree.protected_size if self.tree is not None else 0
            assert prot == 0, f"{prot} cache tokens still locked while idle"
            assert pool.free_tokens + ev == self.capacity, (pool.free_tokens, ev, self.capacity)

    # ------------------------------------------------------------------ fast path (simulator)
    HORIZON_SCAN = 32     # steps checked one by one when no closed form applies

    def _horizon_positions(self, t: int) -> tuple[int, list[int]]:
        """After t decode steps: (pages allocated in total, slot-list lengths)."""
        pool = self.pool
        total = 0
        lens = []
        for e in self._running:
            r = e.req
            L = len(r.slots)
            newlen = max(L, r.num_computed + t)
            total += pool.pages_needed(L, newlen - L)
            lens.append(newlen)
        return total, lens

    def _adm_at(self, t: int) -> AdmissionState:
        """The AdmissionState schedule() would build after t more decode steps."""
        p = self.page_size
        s = p - 1
        allocated, lens = self._horizon_positions(t)
        pairs = []
        for e, L in zip(self._running, lens):
            own = (-(-(L - e.cached_len) // p)) * p
            b = e.final - L
            pairs.append((own, b + s if b > 0 else 0))
        free = (self._available_pages() - allocated) * p
        ratio = max(self.cfg.new_token_ratio_min,
                    self._ratio_base - self._ratio_delta * (self._ratio_steps + t))
        return AdmissionState(self.cfg.admission, pairs, free, ratio, self.cfg.reserve_cap_tokens)

    def decode_horizon(self, now: float) -> int:
        """See the module docstring. O(running + examined candidates) in the common cases."""
        if self._released or self._deferred_outputs or not self._running:
            return 0
        cfg = self.cfg
        running = self._running
        n = len(running)
        if n > cfg.max_num_tokens:
            return 0
        k = 1 << 30
        d_any = False
        for e in running:
            r = e.req
            if r.num_computed != r.num_tokens - 1 or e.fresh or len(r.output_ids) == e.out_at_admit:
                return 0      # prefill pending, new slots, or the first token (caches the prompt) not out yet
            if len(r.slots) != r.num_computed:
                d_any = True
            left = e.limit - len(r.output_ids) - 1
            if left < k:
                k = left
        if k <= 0:
            return 0
        K = cfg.debug_preempt_every
        if K:
            k = min(k, (self._step // K + 1) * K - self._step - 1)
            if k <= 0:
                return 0
        # decode allocations must come from the free list (no eviction, no preemption)
        p = self.page_size
        free = self.pool.free_pages
        if p == 1 and not d_any:
            k = min(k, free // n)
        else:
            lo, hi = 0, k            # largest t <= k with pages(t) <= free
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self._horizon_positions(mid)[0] <= free:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        if k <= 0:
            return 0
        # nothing may be admitted or swapped in during the k schedule() calls
        cands = self._horizon_candidates()
        if cands is None:
            return 0
        if cands:
            k = self._horizon_no_admission(k, cands, d_any)
            if cfg.mixed_steps and cfg.admission != "peak":
                # a mixed step tries admission after its own decode allocation, i.e. one
                # decode step later than the prefill-first timing modelled above
                k -= 1
        return max(0, k)

    def _horizon_candidates(self):
        """(own, b, locked) of every request an admission attempt would examine,
        [] when none would be attempted, None when the horizon must be 0."""
        cfg = self.cfg
        if self._swapped:
            if len(self._running) >= cfg.max_batch_size:
                return []
            if cfg.policy == "priority":
                return None
            return [self._swap_need(self._swapped[0])]
        if not self._waiting:
            return []
        if cfg.policy == "priority" and cfg.admission == "optimistic":
            return None          # may preempt for a slot
        if len(self._running) >= cfg.max_batch_size:
            return []
        pol = self.policy
        W = len(self._waiting)
        if pol.needs_sort:
            if W <= 64:
                examined = list(self._waiting)     # every order examines a subset of these
            elif pol.dynamic:
                return None
            else:
                examined = None
        else:
            examined = None
        if examined is None:
            room = cfg.max_batch_size - len(self._running)
            examined = list(islice(pol.order(self._waiting, self._step + 1), max(room, 1) + cfg.lookahead + 1))
        return [self._candidate_need(e) for e in examined]

    def _aging_bound(self) -> int:
        pol = self.policy
        if not pol.needs_sort or len(self._waiting) <= 64:
            return 1 << 30
        lim = self.cfg.aging_steps
        nxt = self._step + 1
        best = 1 << 30
        for e in self._waiting:
            at = e.enq_step + lim
            if at > nxt and at - nxt < best:
                best = at - nxt
        return best

    def _horizon_no_admission(self, k: int, cands, d_any: bool) -> int:
        """Largest k' <= k such that no candidate fits in any of the next k' schedule() calls
        (admission is attempted with t = 0 .. k'-1 decode steps elapsed)."""
        k = min(k, self._aging_bound())
        if k <= 0:
            return 0
        mode = self.cfg.admission

        def any_fits(t: int) -> bool:
            adm = self._adm_at(t)
            return any(adm.fits(*c) for c in cands)

        if any_fits(0):
            return 0
        p = self.page_size
        if p == 1 and mode == "guaranteed":
            # sum of future growth and free both fall by one per running request per step
            return k
        cap = self.cfg.reserve_cap_tokens
        if (p == 1 and mode == "optimistic" and not d_any
                and all(e.final - len(e.req.slots) <= cap for e in self._running)
                and all(c[1] <= cap for c in cands)):
            return self._optimistic_root(k, cands, any_fits)
        k = min(k, self.HORIZON_SCAN)
        for t in range(1, k):
            if any_fits(t):
                return t
        return k

    def _optimistic_root(self, k: int, cands, any_fits) -> int:
        """p == 1, no cap crossing: f_c(t) = F - n t - own - locked - r(t) (S - n t + b_c) with
        r(t) = max(rmin, r0 - d t) is concave in t, so the first t where a candidate fits is
        found from the roots, then confirmed with the exact check."""
        import math
        n = len(self._running)
        F = self._available_pages()
        S = sum(e.final - len(e.req.slots) for e in self._running)
        rmin = self.cfg.new_token_ratio_min
        r0 = max(rmin, self._ratio_base - self._ratio_delta * self._ratio_steps)
        d = self._ratio_delta
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
            if t_floor < first:
                if A - rmin * D - n * (1 - rmin) * t_floor >= 0:
                    first = min(first, t_floor)
        t = k if first >= k else max(1, int(first) - 1)
        # confirm with the exact check: step back while it already fits earlier
        while t > 1 and any_fits(t - 1):
            t -= 1
        return t

    def fast_forward(self, k: int, tokens: dict[str, list[int]], now: float) -> list[RequestOutput]:
        """See the module docstring: k decode steps at once, same state as stepping."""
        if k <= 0:
            return []
        h = self.decode_horizon(now)
        if k > h:
            raise ValueError(f"fast_forward({k}) beyond decode_horizon()={h}")
        running = self._running
        for e in running:
            toks = tokens.get(e.req.req_id)
            if toks is None or len(toks) != k:
                raise ValueError(f"fast_forward: need {k} tokens for {e.req.req_id}")
            if not e.stop_ids.isdisjoint(toks):
                raise ValueError(f"fast_forward: a token would stop {e.req.req_id}; step normally")
        pool = self.pool
        p = self.page_size
        n = len(running)
        # page pops in the order k single steps would make them: step by step, batch order
        events = []
        simple = p == 1 and all(len(e.req.slots) == e.req.num_computed for e in running)
        if simple:
            pages = pool.alloc(n * k)
            assert pages is not None
            for i, e in enumerate(running):
                e.req.slots.extend(pages[i::n])
        else:
            for i, e in enumerate(running):
                r = e.req
                nc, L = r.num_computed, len(r.slots)
                q = max(nc, L)
                q += (-q) % p if p > 1 else 0
                while q < nc + k:
                    events.append((q - nc + 1, i))
                    q += p
            events.sort()
            pages = pool.alloc(len(events))
            assert pages is not None
            per: list[list[int]] = [[] for _ in running]
            for (t, i), pg in zip(events, pages):
                per[i].append(pg)
            for i, e in enumerate(running):
                r = e.req
                target = r.num_computed + k
                if len(r.slots) < target:
                    pool.extend(r.slots, target - len(r.slots), per[i])
        outs = []
        pol = self.policy
        for e in running:
            r = e.req
            toks = tokens[r.req_id]
            r.output_ids.extend(toks)
            r.num_computed += k
            if r.first_token_at is None:
                r.first_token_at = now
            pol.on_tokens(e, k)
            outs.append(RequestOutput(r.req_id, new_token_ids=list(toks)))
        st = self._stats
        self._step += k
        self._ratio_steps += k
        self._since_prefill += k
        self._consec_prefill = 0
        st.generated_tokens += n * k
        st.last_prefill_seqs = st.last_prefill_tokens = st.last_cached_tokens = 0
        st.last_swap_in = st.last_swap_out = st.last_preemptions = 0
        st.last_decode_seqs = n
        used = self.capacity - pool.free_tokens - (self.tree.evictable_size if self.tree else 0)
        if used > st.kv_peak_used:
            st.kv_peak_used = used
        return outs
