"""Discrete-event simulation of a serving cluster: the real Scheduler and the
real routing policies on a virtual clock, a cost model standing in for the GPU.

    sim = Simulator(SimConfig(model="llama-3-8b", gpu="h100", replicas=8), cost_model=None)
    result = sim.run(trace_requests)            # -> SimResult
    result.records                              # list[RequestRecord], in arrival order
    result.summary(slo_ttft=..., slo_tpot=...)  # bench/report.summarize(...) with KV and prefix figures
    result.timeseries                           # {"t", "kv_used", "kv_capacity", "running", "waiting"} summed over replicas

The loop
--------
Each replica owns a Scheduler, a SimExecutor (cost model -> step time,
tokens from the trace) and its own virtual clock (the end of its last step).
Arrivals are taken in order; before a request is routed, the replicas the
routing policy looks at are advanced to the arrival time: a replica runs
steps while its clock is before that time (a step that started before an
arrival finishes after it, as on a GPU), then the request is added with
now = its arrival. Policies that read no replica state (round-robin, random,
session-affinity) only advance the chosen replica, so the cost per arrival
is one replica's work.

The fast path
-------------
Between two events a decode-only batch does not change. When the scheduler
says the next h steps are decode-only and identical in membership
(`Scheduler.decode_horizon(now)`), the simulator takes k = min(h, steps
until the first request in the batch stops, steps that start before the
next arrival to this replica) steps at once: the step times come from the
cost model in one vectorised call (`decode_step_times`: the time of a
decode-only step depends only on the batch size and the total context,
which grows by the batch size per step), the end times are accumulated in
the same order as one-by-one stepping, and `Scheduler.fast_forward(k,
tokens, now)` appends the k tokens of every request. `fast=False` steps one
by one; tests/test_simulator.py checks that both give the same records.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from shepherd.bench.records import RequestRecord, TraceRequest
from shepherd.config import SchedulerConfig
from shepherd.engine.executor import StepResult
from shepherd.request import FinishReason, Request, RequestState, SamplingParams
from shepherd.sim.cost_model import CostModel, RooflineCostModel, make_cost_model
from shepherd.bench.traces import prompt_token_ids

# Policies whose choice reads no replica state, so routing can happen ahead of the
# replicas catching up to the arrival time. session-affinity is not among them:
# its fallback for requests without a session reads load.
LAZY_POLICIES = {"round-robin", "roundrobin", "rr", "random"}


# --------------------------------------------------------------------------
# configuration and results
# --------------------------------------------------------------------------

@dataclass
class SimConfig:
    model: str = "llama-3-8b"
    gpu: str = "h100"
    tp: int = 1
    replicas: int = 1
    router: str = "round-robin"
    router_knobs: dict = field(default_factory=dict)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_capacity: Optional[int] = None     # per replica, tokens; None = from GPU memory minus weights
    mem_fraction: float = 0.9             # of GPU memory for weights + KV (vLLM gpu_memory_utilization)
    host_kv_tokens: int = 0               # swap pool per replica; 0 = as large as the device pool (swap mode)
    max_model_len: Optional[int] = None   # None = the KV capacity
    max_tokens: Optional[int] = None      # None: max_tokens = the trace's output length (oracle);
                                          # N: max_tokens = max(N, output) and EOS at the trace's length
    vocab_size: Optional[int] = None      # None = the model preset's
    block_size: int = 512                 # Mooncake hash-id block
    fast: bool = True
    seed: int = 0
    progress: bool = False
    timeseries: bool = True
    record_batches: bool = False          # keep (replica, start, [(req_id, start_pos, n)]) per step (tests)


@dataclass
class SimResult:
    records: list[RequestRecord]
    timeseries: dict
    kv_capacity_tokens: int
    kv_peak_used_tokens: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    steps: int
    fast_steps: int
    wall_s: float
    config: SimConfig
    cost_model: str
    batches: list = field(default_factory=list)
    replica_stats: list = field(default_factory=list)

    @property
    def prefix_hit_rate(self) -> Optional[float]:
        if not self.prefix_query_tokens:
            return None
        return self.prefix_hit_tokens / self.prefix_query_tokens

    def summary(self, *, slo_ttft=None, slo_tpot=None, extra: Optional[dict] = None) -> dict:
        from shepherd.bench.report import summarize
        ex = {"sim": {"model": self.config.model, "gpu": self.config.gpu, "tp": self.config.tp,
                      "replicas": self.config.replicas, "router": self.config.router,
                      "cost_model": self.cost_model, "steps": self.steps, "fast_steps": self.fast_steps,
                      "admission": self.config.scheduler.admission,
                      "preemption": self.config.scheduler.preemption,
                      "policy": self.config.scheduler.policy,
                      "prefix_cache": self.config.scheduler.prefix_cache,
                      "kv_capacity_per_replica": self.kv_capacity_tokens // max(1, self.config.replicas),
                      "prefix_hit_tokens": self.prefix_hit_tokens,
                      "prefix_query_tokens": self.prefix_query_tokens}}
        if extra:
            ex.update(extra)
        return summarize(self.records, kv_capacity_tokens=self.kv_capacity_tokens,
                         kv_peak_used_tokens=self.kv_peak_used_tokens, prefix_hit_rate=self.prefix_hit_rate,
                         slo_ttft=slo_ttft, slo_tpot=slo_tpot, wall_s=self.wall_s, extra=ex)


# --------------------------------------------------------------------------
# per-request tracking
# --------------------------------------------------------------------------

class _Track:
    __slots__ = ("rec", "req", "state", "since", "pieces", "ntok", "seen_preempt", "route", "target")

    def __init__(self, rec: RequestRecord, req: Request, target: int):
        self.rec = rec
        self.req = req
        self.state = "queued"
        self.since = rec.arrival
        self.pieces: list = []        # floats (one token) and numpy views (a fast-forward chunk)
        self.ntok = 0
        self.seen_preempt = 0
        self.route = None
        self.target = target          # the trace's output length (EOS position)

    def move(self, state: str, t: float) -> None:
        if state == self.state:
            return
        if t > self.since or self.state != "queued":
            self.rec.intervals.append((self.state, self.since, t))
        self.state = state
        self.since = t

    def token_times(self) -> list[float]:
        out: list[float] = []
        for p in self.pieces:
            if isinstance(p, float):
                out.append(p)
            elif isinstance(p, list):
                out.extend(p)
            else:
                out.extend(p.tolist())
        return out


# --------------------------------------------------------------------------
# executor: the shared SimExecutor when present, else a minimal stand-in
# --------------------------------------------------------------------------

class _TokenMixin:
    """Sampled tokens for the simulator, vectorisable: output token at position
    `pos` of a request is 3 + (a * 1000003 + pos * 7919 + 12345) mod (V - 3), a =
    the prompt's last token (the SimExecutor's recurrence with the prompt's last
    token in place of the previous output token, so k tokens cost one expression;
    two requests with the same prompt still generate the same text). EOS only
    at the request's target length, as in SimExecutor."""

    def next_token(self, req) -> int:
        idx = len(req.output_ids)
        t = self.target_len(req)
        if t is not None and idx + 1 >= t:
            return self.eos_token_id
        return self._tok(req, len(req.prompt_ids) + idx)

    def _tok(self, req, pos: int) -> int:
        m = self.vocab_size - 3
        tok = 3 + (req.prompt_ids[-1] * 1000003 + pos * 7919 + 12345) % m
        bad = req.params.stop_token_ids
        while tok == self.eos_token_id or (bad and tok in bad):
            tok = 3 + (tok - 3 + 1) % m
        return tok

    def token_block(self, req, k: int) -> list[int]:
        """The next k tokens (the caller guarantees none is the EOS position)."""
        pos = len(req.prompt_ids) + len(req.output_ids)
        if req.params.stop_token_ids or self.eos_token_id >= 3:
            return [self._tok(req, p) for p in range(pos, pos + k)]
        m = self.vocab_size - 3
        a = req.prompt_ids[-1] * 1000003 + 12345
        if k < 48:
            return [3 + (a + p * 7919) % m for p in range(pos, pos + k)]
        return (3 + (a + np.arange(pos, pos + k, dtype=np.int64) * 7919) % m).tolist()


def _make_executor(sim: "Simulator"):
    from shepherd.sim.sim_executor import SimExecutor

    class _SimExec(_TokenMixin, SimExecutor):
        pass

    # swap time is in the cost model's step time (PCIe transfer), not the executor's flat rate
    return _SimExec(kv_capacity=sim.kv_capacity, host_kv_capacity=sim.host_kv, max_model_len=sim.max_model_len,
                    eos_token_id=2, step_time=sim.cost.step_time, swap_time_per_token=0.0,
                    vocab_size=sim.vocab, check=False)


# --------------------------------------------------------------------------
# replica
# --------------------------------------------------------------------------

class _Replica:
    def __init__(self, idx: int, sim: "Simulator"):
        from shepherd.scheduler.scheduler import Scheduler
        self.idx = idx
        self.sim = sim
        cfg = sim.cfg
        self.cost = sim.cost
        self.kv_capacity = sim.kv_capacity
        self.exec = _make_executor(sim)
        sc = SchedulerConfig(**{**cfg.scheduler.__dict__, "max_total_tokens": sim.kv_capacity})
        self.sched = Scheduler(sc, host_kv_capacity=sim.host_kv, max_model_len=sim.max_model_len)
        self.clock = 0.0
        self.tracks: dict[str, _Track] = {}
        self.fast = cfg.fast
        self.ts_on = cfg.timeseries
        self.ts_t: list[float] = []
        self.ts_kv: list[int] = []
        self.ts_run: list[int] = []
        self.ts_wait: list[int] = []
        self.kv_peak = 0
        self.steps = 0
        self.fast_steps = 0
        self.last_preempt = 0
        self.batches = [] if cfg.record_batches else None

    # -- intake ------------------------------------------------------------
    def add(self, tr: _Track, now: float) -> bool:
        if self.clock < now:
            # advance_to(now) ran every step that starts before now: the replica is idle
            # (or stalled on memory) until this arrival
            self.clock = now
        if not tr.req.params.ignore_eos:
            self.exec.set_output_len(tr.req.req_id, tr.target)
        self.sched.add(tr.req, now)
        self.tracks[tr.req.req_id] = tr
        return True

    # -- the loop ------------------------------------------------------------
    def advance_to(self, t_limit: float) -> None:
        sched = self.sched
        while self.clock < t_limit and sched.has_work:
            if self.fast and self._fast_forward(t_limit):
                continue
            if not self._step():
                break

    def _probe(self):
        """(kv_used, running, waiting+swapped, preemptions), from the O(1) snapshot."""
        sn = self.sched.snapshot()
        return sn.kv_used, sn.num_running, sn.num_waiting + sn.num_swapped, sn.preemptions

    def _sample_ts(self) -> None:
        used, nrun, nwait, npre = self._probe()
        if used > self.kv_peak:
            self.kv_peak = used
        if self.ts_on:
            self.ts_t.append(self.clock)
            self.ts_kv.append(used)
            self.ts_run.append(nrun)
            self.ts_wait.append(nwait)

    def _check_preempted(self, t: float) -> None:
        npre = self.sched.snapshot().preemptions
        if npre == self.last_preempt:
            return
        self.last_preempt = npre
        for tr in self.tracks.values():
            req = tr.req
            if req.preemptions != tr.seen_preempt:
                tr.seen_preempt = req.preemptions
                if req.state is not RequestState.RUNNING:
                    tr.move("preempted", t)

    def _step(self) -> bool:
        sched = self.sched
        t0 = self.clock
        batch = sched.schedule(t0)
        self._check_preempted(t0)
        if batch.empty:
            # schedule() can end a request without running anything (an error such as a
            # request that alone outgrows the pool); on_step hands out that terminal output.
            self._handle_outputs(sched.on_step(batch, StepResult(), t0), t0)
            self._sample_ts()
            return False
        tracks = self.tracks
        for s in batch.seqs:
            tr = tracks.get(s.req.req_id)
            if tr is not None and tr.state in ("queued", "preempted"):
                tr.move("prefill", t0)
        res = self.exec.execute(batch)
        t1 = t0 + res.step_time
        self.clock = t1
        if self.batches is not None:
            self.batches.append((self.idx, t0, [(s.req.req_id, s.start_pos, len(s.token_ids)) for s in batch.seqs]))
        outs = sched.on_step(batch, res, t1)
        self.steps += 1
        self._handle_outputs(outs, t1)
        self._sample_ts()
        return True

    def _handle_outputs(self, outs, t1: float) -> None:
        tracks = self.tracks
        for o in outs:
            tr = tracks.get(o.req_id)
            if tr is None:
                continue
            n = len(o.new_token_ids)
            if n:
                if n == 1:
                    tr.pieces.append(t1)
                else:
                    tr.pieces.extend([t1] * n)
                tr.ntok += n
                if tr.rec.first_token is None:
                    tr.rec.first_token = t1
                if tr.state != "decode":
                    tr.move("decode", t1)
            if o.finished:
                self._finish(tr, o, t1)

    def _finish(self, tr: _Track, o, t: float) -> None:
        rec = tr.rec
        tr.move("done", t)
        rec.intervals = [iv for iv in rec.intervals if iv[0] != "done"]
        rec.finish = t
        req = tr.req
        rec.preemptions = req.preemptions
        rec.cached_tokens = req.num_cached
        rec.output_tokens = tr.ntok
        if o.finish_reason is FinishReason.ERROR or o.error:
            rec.ok = False
            rec.error_kind = "error"
        del self.tracks[req.req_id]
        self.sim._on_finish(self, tr)

    # -- fast path ---------------------------------------------------------------
    def _fast_forward(self, t_limit: float) -> bool:
        sched = self.sched
        now = self.clock
        h = sched.decode_horizon(now)
        if h < 2:
            return False
        running = sched.running
        if not running:
            return False
        n = len(running)
        ctx0 = 0
        stop = h
        exe = self.exec
        tracks = self.tracks
        for req in running:
            ctx0 += len(req.prompt_ids) + len(req.output_ids)
            # the step that samples a request's last token (EOS or max_tokens) goes the normal way
            left = tracks[req.req_id].target - len(req.output_ids) - 1
            if left < stop:
                stop = left
        k = stop
        if t_limit != math.inf:
            # steps never get shorter as contexts grow: at most this many start before t_limit
            d0 = self.cost.decode_step_lb(n, ctx0)
            if d0 > 0:
                kmax = int((t_limit - now) / d0) + 2
                if kmax < k:
                    k = kmax
        if k < 2:
            return False
        if k <= 24:
            # short runs: a Python loop beats numpy's call overhead (same IEEE operations)
            f = self.cost.decode_step_time
            ends = []
            t = now
            c = ctx0
            for _ in range(k):
                if t >= t_limit:      # this step would start at or after the next arrival
                    break
                t += f(n, c)
                c += n
                ends.append(t)
            k = len(ends)
        else:
            d = self.cost.decode_step_times(n, ctx0, k)
            ends = np.add.accumulate(np.concatenate(([now], d)))[1:]
            if ends.size > 1 and ends[-2] >= t_limit:
                # steps must start before t_limit: step j starts at ends[j-1] (step 0 at now < t_limit)
                k = int(np.searchsorted(ends, t_limit, side="left")) + 1
                ends = ends[:k]
        if k < 2:
            return False
        block = exe.token_block
        tokens = {req.req_id: block(req, k) for req in running}
        if self.batches is not None:
            for j in range(k):
                t0 = now if j == 0 else float(ends[j - 1])
                self.batches.append((self.idx, t0, [(r.req_id, len(r.prompt_ids) + len(r.output_ids) - 1 + j, 1)
                                                    for r in running]))
        members = list(running)
        t_end = float(ends[-1])
        outs = sched.fast_forward(k, tokens, t_end)
        self.clock = t_end
        self.steps += k
        self.fast_steps += k
        view = ends
        for req in members:
            tr = tracks[req.req_id]
            tr.pieces.append(view)
            tr.ntok += k
        for o in outs:
            if o.finished:
                tr = tracks.get(o.req_id)
                if tr is not None:
                    self._finish(tr, o, t_end)
        self._sample_ts()
        return True


# --------------------------------------------------------------------------
# the simulator
# --------------------------------------------------------------------------

class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total = max(1, total)
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.last = 0.0

    def update(self, done: int, vt: float, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self.last < 0.25:
            return
        self.last = now
        frac = min(1.0, done / self.total)
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\rsimulate [{bar:<30}] {frac:4.0%} {done}/{self.total} req  "
                         f"t={vt:,.0f}s  wall {now - self.t0:.1f}s ")
        sys.stderr.flush()

    def close(self, done: int, vt: float) -> None:
        if self.enabled:
            self.update(done, vt, force=True)
            sys.stderr.write("\n")


class Simulator:
    def __init__(self, cfg: SimConfig, cost_model: Optional[CostModel] = None):
        self.cfg = cfg
        self.cost = cost_model or make_cost_model(cfg.model, cfg.gpu, tp=cfg.tp)
        page = cfg.scheduler.page_size
        if cfg.kv_capacity:
            cap = cfg.kv_capacity
        else:
            cap = self.cost.kv_capacity_tokens(mem_fraction=cfg.mem_fraction, page_size=page) \
                if isinstance(self.cost, RooflineCostModel) else self.cost.kv_capacity_tokens()
        self.kv_capacity = cap - cap % page
        self.host_kv = (cfg.host_kv_tokens or self.kv_capacity) if cfg.scheduler.preemption == "swap" \
            else cfg.host_kv_tokens
        self.max_model_len = cfg.max_model_len or self.kv_capacity
        if cfg.vocab_size:
            self.vocab = cfg.vocab_size
        else:
            from shepherd.sim.cost_model import get_model
            try:
                self.vocab = get_model(cfg.model).vocab_size
            except KeyError:
                self.vocab = 32000
        self._router = None
        self._routes: dict = {}

    # -- routing -----------------------------------------------------------------
    def _make_router(self):
        name = self.cfg.router
        try:
            from shepherd import routing as R
        except ModuleNotFoundError:
            return None
        knobs = dict(self.cfg.router_knobs)
        try:
            defaults = R.policy_knobs(R.ALIASES.get(name, name))
            if "seed" in defaults and "seed" not in knobs:
                knobs["seed"] = self.cfg.seed
        except Exception:
            pass
        policy = R.make_policy(name, **knobs)
        states = [R.ReplicaState(index=i, name=f"replica-{i}") for i in range(self.cfg.replicas)]
        return R, policy, states

    def _choose(self, tr: TraceRequest, req: Request, now: float) -> int:
        if self._router is None:   # built-in round robin (routing.py missing)
            self._rr = getattr(self, "_rr", -1) + 1
            return self._rr % self.cfg.replicas
        R, policy, states = self._router
        if not self._lazy:
            for rep, st in zip(self.replicas, states):
                s = rep.sched.stats()
                st.running = s.num_running
                st.waiting = s.num_waiting + s.num_swapped
                st.kv_usage = s.kv_used / max(1, s.kv_capacity or rep.kv_capacity)
                st.metrics_at = now
        rr = R.RouteRequest(token_ids=req.prompt_ids, user=tr.client, session=tr.session,
                            input_tokens=tr.prompt_tokens, now=now, hash_ids=tr.hash_ids,
                            max_tokens=req.params.max_tokens, req_id=req.req_id)
        st = policy.choose(rr, states)
        st.in_flight += 1
        policy.on_dispatch(rr, st)
        rr.token_ids = None   # keep no prompt alive for on_finish
        self._routes[req.req_id] = rr
        return st.index

    def _on_finish(self, rep: _Replica, tr: _Track) -> None:
        self.finished += 1
        if self._router is None:
            return
        R, policy, states = self._router
        rr = self._routes.pop(tr.req.req_id, None)
        st = states[rep.idx]
        st.in_flight -= 1
        if rr is not None:
            rr.now = tr.rec.finish
            policy.on_finish(rr, st, tr.ntok)

    # -- run -------------------------------------------------------------------------
    def make_request(self, tr: TraceRequest, i: int) -> tuple[Request, int]:
        target = max(1, tr.output_tokens)
        if self.cfg.max_tokens is None:
            params = SamplingParams(max_tokens=target, temperature=0.0, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=max(self.cfg.max_tokens, target), temperature=0.0)
        rid = f"r{tr.index if tr.index is not None else i}"
        req = Request(req_id=rid, prompt_ids=prompt_token_ids(tr, self.vocab, self.cfg.block_size), params=params,
                      arrival=tr.arrival, client=tr.client, priority=tr.priority, eos_token_ids=(2,))
        return req, target

    def run(self, trace: Sequence[TraceRequest]) -> SimResult:
        from shepherd.scheduler.scheduler import QueueFull, RequestRejected
        cfg = self.cfg
        wall0 = time.perf_counter()
        self.replicas = [_Replica(i, self) for i in range(cfg.replicas)]
        self._router = self._make_router()
        self._lazy = self._router is None or cfg.router in LAZY_POLICIES
        self.finished = 0
        order = sorted(range(len(trace)), key=lambda i: trace[i].arrival)
        records: list[Optional[RequestRecord]] = [None] * len(trace)
        tracks: list[Optional[_Track]] = [None] * len(trace)
        prog = _Progress(len(trace), cfg.progress)
        for n_done, i in enumerate(order):
            tr = trace[i]
            now = tr.arrival
            req, target = self.make_request(tr, i)
            rec = RequestRecord(req_id=req.req_id, client=tr.client, arrival=now, prompt_tokens=tr.prompt_tokens)
            records[i] = rec
            if not self._lazy:
                for rep in self.replicas:
                    rep.advance_to(now)
            ridx = self._choose(tr, req, now)
            rep = self.replicas[ridx]
            rec.replica = ridx
            if self._lazy:
                rep.advance_to(now)
            track = _Track(rec, req, target)
            tracks[i] = track
            try:
                rep.add(track, now)
            except QueueFull:
                rec.ok, rec.error_kind, rec.finish = False, "queue_full", now
                self._drop_route(req.req_id, ridx)
            except RequestRejected as e:
                rec.ok, rec.error_kind, rec.finish = False, "rejected", now
                self._drop_route(req.req_id, ridx)
            prog.update(n_done + 1, now)
        for rep in self.replicas:
            rep.advance_to(math.inf)
        prog.close(len(trace), max((r.clock for r in self.replicas), default=0.0))
        # finalise records
        for track in tracks:
            if track is None:
                continue
            rec = track.rec
            rec.token_times = track.token_times()
            if rec.finish is None and rec.ok:
                rec.ok = False
                rec.error_kind = "unfinished"
                rec.output_tokens = track.ntok
            if track.req is not None:
                rec.cached_tokens = track.req.num_cached
                rec.preemptions = track.req.preemptions
            track.req = None
        ts, peak = self._timeseries()
        stats = [rep.sched.stats() for rep in self.replicas]
        batches = []
        if cfg.record_batches:
            for rep in self.replicas:
                batches.extend(rep.batches)
        return SimResult(
            records=[r for r in records if r is not None], timeseries=ts,
            kv_capacity_tokens=self.kv_capacity * cfg.replicas, kv_peak_used_tokens=peak,
            prefix_query_tokens=sum(s.prefix_query_tokens for s in stats),
            prefix_hit_tokens=sum(s.prefix_hit_tokens for s in stats),
            preemptions=sum(s.preemptions for s in stats),
            steps=sum(r.steps for r in self.replicas), fast_steps=sum(r.fast_steps for r in self.replicas),
            wall_s=time.perf_counter() - wall0, config=cfg, cost_model=getattr(self.cost, "name", "?"),
            batches=batches, replica_stats=stats)

    def _drop_route(self, req_id: str, ridx: int) -> None:
        if self._router is None:
            return
        R, policy, states = self._router
        rr = self._routes.pop(req_id, None)
        states[ridx].in_flight -= 1
        if rr is not None:
            policy.on_finish(rr, states[ridx], 0)

    def _timeseries(self) -> tuple[dict, int]:
        reps = self.replicas
        if not self.cfg.timeseries or not any(r.ts_t for r in reps):
            return {}, int(max((r.kv_peak for r in reps), default=0) if len(reps) == 1 else
                           sum(r.kv_peak for r in reps))
        alls = np.unique(np.concatenate([np.asarray(r.ts_t) for r in reps if r.ts_t]))
        kv = np.zeros(alls.size)
        run = np.zeros(alls.size)
        wait = np.zeros(alls.size)
        for r in reps:
            if not r.ts_t:
                continue
            t = np.asarray(r.ts_t)
            idx = np.searchsorted(t, alls, side="right") - 1
            valid = idx >= 0
            idx = np.clip(idx, 0, None)
            kv += np.where(valid, np.asarray(r.ts_kv)[idx], 0)
            run += np.where(valid, np.asarray(r.ts_run)[idx], 0)
            wait += np.where(valid, np.asarray(r.ts_wait)[idx], 0)
        peak = int(kv.max()) if kv.size else 0
        # thin to at most ~4000 points for the plots (keep each bucket's max KV)
        if alls.size > 4000:
            sel = np.linspace(0, alls.size - 1, 4000).astype(int)
            alls, kv, run, wait = alls[sel], kv[sel], run[sel], wait[sel]
        cap = self.kv_capacity * len(reps)
        return ({"t": alls.tolist(), "kv_used": kv.tolist(), "kv_capacity": [cap] * alls.size,
                 "running": run.tolist(), "waiting": wait.tolist()}, peak)


def simulate(trace: Sequence[TraceRequest], cfg: Optional[SimConfig] = None,
             cost_model: Optional[CostModel] = None) -> SimResult:
    return Simulator(cfg or SimConfig(), cost_model).run(trace)


__all__ = ["SimConfig", "SimResult", "Simulator", "simulate"]
