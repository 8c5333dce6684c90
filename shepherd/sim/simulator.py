"""Discrete-event simulation of a serving cluster: the real Scheduler and the
real routing policies on a virtual clock, a cost model standing in for the GPU.

    sim = Simulator(SimConfig(model="llama-3-8b", gpu="h100", replicas=8), cost_model=None)
    result = sim.run(trace)                     # a list, or any iterable in arrival order (read lazily)
    result.stats                                # bench/stream.RecordStats: every record, streamed
    result.records                              # list[RequestRecord], arrival order (SimConfig.keep_records)
    result.summary(slo_ttft=..., slo_tpot=...)  # bench/report.summarize(...) plus KV, cache, routing figures
    result.timeseries                           # {"t", "kv_used", "kv_cached", "kv_capacity", "running",
                                                #  "waiting"} summed over replicas

Memory: a finished request leaves its record to `stats` (and to `on_record`)
and nothing else; with keep_records=False the record is dropped too, so a run
holds the requests in flight, the replicas' caches and fixed-size statistics.
One replica (scheduler, executor, clock, fast path) is sim/replica.py.

The loop
--------
Each replica owns a Scheduler, a SimExecutor (cost model -> step time,
tokens from the trace) and its own virtual clock (the end of its last step).
Arrivals are taken in order; before a request is routed, the replicas the
routing policy looks at are advanced to the arrival time: a replica runs
steps while its clock is before that time (a step that started before an
arrival finishes after it, as on a GPU), then the request is added with
now = its arrival. Policies that read no replica state (round-robin, random)
only advance the chosen replica, so the cost per arrival is one replica's
work; policies that read only counts (COUNT_POLICIES) advance a replica only
until its counts cannot change before the arrival (Replica.advance_to with
settle: the decode steps left run later, in one chunk).

The fast path
-------------
Between two events a decode-only batch does not change. When the scheduler
says the next h steps are decode-only and identical in membership, the last
of them possibly ending requests (`Scheduler.decode_horizon(now,
finishing=True)`), the simulator takes k = min(h, steps until the first
request in the batch stops, steps that start before the next arrival to this
replica) steps at once: the step times come from the
cost model in one vectorised call (`decode_step_times`: the time of a
decode-only step depends only on the batch size and the total context,
which grows by the batch size per step), the end times are accumulated in
the same order as one-by-one stepping, and `Scheduler.fast_forward(k,
tokens, now)` appends the k tokens of every request and ends those that
finish at the k-th step. `fast=False` steps one
by one; tests/test_simulator.py checks that both give the same records.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import numpy as np

from shepherd.bench.records import RequestRecord, TraceRequest
from shepherd.bench.stream import RecordStats
from shepherd.bench.traces import prompt_token_ids, session_stream
from shepherd.config import SchedulerConfig, host_pool_tokens, whole_pages
from shepherd.request import Request, SamplingParams
from shepherd.sim.cache_bounds import HitRateBounds
from shepherd.sim.cost_model import CostModel, RooflineCostModel
from shepherd.sim.fitted_cost import make_cost_model
from shepherd.sim.hardware import get_model
from shepherd.sim.kv_feed import SimKVFeed
from shepherd.sim.replica import Replica, ReplicaSpec, Track

GC_YOUNG_THRESHOLD = 20_000     # see Simulator.run

# Policies whose choice reads no replica state, so routing can happen ahead of the
# replicas catching up to the arrival time. session-affinity is not among them:
# its fallback for requests without a session reads load.
LAZY_POLICIES = {"round-robin", "roundrobin", "rr", "random"}
# Policies that read replica counts (running, waiting, in flight) but not KV use: a
# replica is advanced only until its counts cannot change before an arrival
# (Replica.quiet_until); it catches up later with the same steps (the fast path's
# chunking does not change a token time).
COUNT_POLICIES = {"least-request", "least-loaded", "shortest-queue", "power-of-two", "p2c", "prefix-aware",
                  "prefix-cache", "prefix", "cache-aware", "cache_aware", "vtc-basic", "vtc", "session-affinity",
                  "session"}


# --------------------------------------------------------------------------
# configuration and results
# --------------------------------------------------------------------------

@dataclass
class SimConfig:
    model: str = "llama-3-8b"
    gpu: str = "h100"
    tp: int = 1
    replicas: int = 1
    router: str = "least-request"         # the gateway's default too
    router_knobs: dict = field(default_factory=dict)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_capacity: Optional[int] = None     # per replica, tokens; None = from GPU memory minus weights
    mem_fraction: float = 0.9             # of GPU memory for weights + KV (vLLM gpu_memory_utilization)
    host_kv_tokens: int = 0               # swap pool per replica; 0 = as large as the device pool (swap mode)
    max_model_len: Optional[int] = None   # None = the model's context (ModelSpec.max_context): longer
                                          # prompts are rejected as the engine rejects them
    max_tokens: Optional[int] = None      # None: max_tokens = the trace's output length (oracle);
                                          # N: max_tokens = max(N, output) and EOS at the trace's length
    vocab_size: Optional[int] = None      # None = the model preset's
    block_size: int = 512                 # Mooncake hash-id block
    fast: bool = True
    seed: int = 0
    progress: bool = False
    timeseries: bool = True
    record_batches: bool = False          # keep (replica, start, [(req_id, start_pos, n)]) per step (tests)
    keep_records: bool = True             # SimResult.records holds every record; False: only the
                                          # streamed statistics (and on_record) see them: flat memory
    cache_bounds: bool = True             # the infinite / cluster-LRU hit-rate references
    skip_quiet: bool = True               # see COUNT_POLICIES (False: advance every replica; tests)


@dataclass
class SimResult:
    records: list[RequestRecord]           # arrival order; empty unless SimConfig.keep_records
    stats: RecordStats                     # every record, streamed
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
    replicas: list = field(default_factory=list)     # per replica: requests, tokens, cache, evictions
    routing: dict = field(default_factory=dict)      # routing decisions by reason
    hit_rate_bounds: dict = field(default_factory=dict)
    rejections: dict = field(default_factory=dict)   # kind -> {"count", "reason"}: refused at add()
    max_model_len: Optional[int] = None
    cost_range: dict = field(default_factory=dict)   # a fitted model's steps past its profiled range

    @property
    def prefix_hit_rate(self) -> Optional[float]:
        if not self.prefix_query_tokens:
            return None
        return self.prefix_hit_tokens / self.prefix_query_tokens

    def balance(self) -> dict:
        """max / mean over replicas of requests, prompt tokens and output tokens (1 = even)."""
        out = {}
        for k in ("requests", "prompt_tokens", "output_tokens"):
            v = np.array([r[k] for r in self.replicas], dtype=float)
            out[k] = float(v.max() / v.mean()) if v.size and v.mean() > 0 else None
        return out

    def summary(self, *, slo_ttft=None, slo_tpot=None, extra: Optional[dict] = None) -> dict:
        from shepherd.bench.report import summarize
        c = self.config
        ex = {"sim": {"model": c.model, "gpu": c.gpu, "tp": c.tp, "replicas": c.replicas, "router": c.router,
                      "cost_model": self.cost_model, "steps": self.steps, "fast_steps": self.fast_steps,
                      "admission": c.scheduler.admission, "preemption": c.scheduler.preemption,
                      "policy": c.scheduler.policy, "prefix_cache": c.scheduler.prefix_cache,
                      "kv_capacity_per_replica": self.kv_capacity_tokens // max(1, c.replicas),
                      "prefix_hit_tokens": self.prefix_hit_tokens,
                      "prefix_query_tokens": self.prefix_query_tokens, "max_model_len": self.max_model_len,
                      **({"cost_model_range": self.cost_range} if self.cost_range else {})},
              "rejections": self.rejections,
              "hit_rate_bounds": self.hit_rate_bounds,
              "cache": {"cached_peak_tokens": sum(r["cached_peak_tokens"] for r in self.replicas),
                        "evicted_tokens": sum(r["evicted_tokens"] for r in self.replicas)},
              "replicas": self.replicas, "balance": self.balance(), "routing": self.routing}
        if extra:
            ex.update(extra)
        return summarize(self.stats, kv_capacity_tokens=self.kv_capacity_tokens,
                         kv_peak_used_tokens=self.kv_peak_used_tokens, prefix_hit_rate=self.prefix_hit_rate,
                         slo_ttft=slo_ttft, slo_tpot=slo_tpot, wall_s=self.wall_s, extra=ex)


class _Progress:
    def __init__(self, total: Optional[int], enabled: bool):
        self.total = total
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
        if self.total:
            frac = min(1.0, done / self.total)
            bar = "#" * int(frac * 30)
            head = f"[{bar:<30}] {frac:4.0%} {done}/{self.total}"
        else:
            head = f"{done:,}"
        sys.stderr.write(f"\rsimulate {head} req  t={vt:,.0f}s  wall {now - self.t0:.1f}s ")
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
        self.kv_capacity = whole_pages(cap, page)
        self.host_kv = host_pool_tokens(cfg.host_kv_tokens, self.kv_capacity, cfg.scheduler.preemption)
        self.max_model_len = cfg.max_model_len or model_context(cfg.model) or self.kv_capacity
        # every replica's scheduler: validated here, once
        self.sched_cfg = dataclasses.replace(cfg.scheduler, max_total_tokens=self.kv_capacity).validate()
        if cfg.vocab_size:
            self.vocab = cfg.vocab_size
        else:
            try:
                self.vocab = get_model(cfg.model).vocab_size
            except KeyError:
                self.vocab = 32000
        self._router = None
        self._rr = -1                # the built-in round robin's last choice (routing/ missing)
        self._routes: dict = {}

    # -- routing -----------------------------------------------------------------
    @property
    def policy(self):
        """The routing policy of the last run (None before one, or without routing)."""
        return self._router[1] if self._router is not None else None

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
            self._rr += 1
            return self._rr % self.cfg.replicas
        R, policy, states = self._router
        if not self._lazy:
            for rep, st in zip(self.replicas, states):
                used, _cached, nrun, nwait, _ = rep.counts()
                st.running = nrun
                st.waiting = nwait
                st.kv_usage = used / max(1, rep.kv_capacity)
                st.metrics_at = now
        if self._kv_feed is not None:
            self._kv_feed.sync()        # the replicas' caches as of now, exactly
        rr = R.RouteRequest(token_ids=req.prompt_ids, user=tr.client, session=tr.session,
                            input_tokens=tr.prompt_tokens, now=now, hash_ids=tr.hash_ids,
                            max_tokens=req.params.max_tokens, req_id=req.req_id)
        st = policy.choose(rr, states)
        st.in_flight += 1
        policy.on_dispatch(rr, st)
        rr.token_ids = None   # keep no prompt alive for on_finish
        rr.hash_ids = None
        self._routes[req.req_id] = rr
        return st.index

    def on_finish(self, rep: Replica, tr: Track) -> None:
        """A request ended on a replica: tell the router, stream its record out."""
        self.finished += 1
        if self._router is not None:
            R, policy, states = self._router
            rr = self._routes.pop(tr.rec.req_id, None)
            st = states[rep.idx]
            st.in_flight -= 1
            if rr is not None:
                rr.now = tr.rec.finish
                policy.on_finish(rr, st, tr.ntok)
        self._emit(tr.close(lists=self._lists))

    def _emit(self, rec: RequestRecord) -> None:
        self.stats.add(rec)
        if self._on_record is not None:
            self._on_record(rec)
        if not self.cfg.keep_records:
            rec.token_times = []

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
        if tr.session and tr.prompt_ids is None:     # its answer continues the session (bench/traces.py session_stream)
            req.sim_stream = session_stream(tr, self.cfg.block_size)
        return req, target

    def run(self, trace: Iterable[TraceRequest], *, total: Optional[int] = None,
            on_record: Optional[Callable[[RequestRecord], None]] = None) -> SimResult:
        """Simulate `trace`: a list (sorted here by arrival) or any iterable in arrival
        order (read lazily: memory stays flat whatever its length). `on_record` sees
        each request's record as it ends (finish order)."""
        # Allocations and frees nearly balance here, yet at the default threshold (700) the
        # young generation is collected every few requests, and each collection walks every
        # young prompt and slot list element by element (5% of the run); cycles are rare
        # (radix nodes are unlinked when evicted), so collecting 30x less often costs nothing.
        old = gc.get_threshold()
        gc.set_threshold(max(old[0], GC_YOUNG_THRESHOLD), *old[1:])
        try:
            return self._run(trace, total, on_record)
        finally:
            gc.set_threshold(*old)

    def _run(self, trace: Iterable[TraceRequest], total: Optional[int],
             on_record: Optional[Callable[[RequestRecord], None]]) -> SimResult:
        cfg = self.cfg
        wall0 = time.perf_counter()
        if isinstance(trace, (list, tuple)):
            total = len(trace)
            trace = sorted(trace, key=lambda r: r.arrival)
        spec = ReplicaSpec(self.sched_cfg, self.cost, self.host_kv, self.max_model_len, self.vocab, fast=cfg.fast,
                           timeseries=cfg.timeseries, record_batches=cfg.record_batches)
        self.replicas = [Replica(i, spec, self.on_finish) for i in range(cfg.replicas)]
        self._router = self._make_router()
        index = getattr(self._router[1], "kv_index", None) if self._router is not None else None
        self._kv_feed = SimKVFeed(index, self.replicas) if index is not None else None
        self._lazy = self._router is None or cfg.router in LAZY_POLICIES
        self._skip_quiet = cfg.skip_quiet and cfg.router in COUNT_POLICIES
        self.finished = 0
        self.rejections: dict = {}
        beyond0 = (getattr(self.cost, "beyond_steps", 0), getattr(self.cost, "floored_steps", 0))
        self.stats = RecordStats(seed=cfg.seed)
        self._on_record = on_record
        self._lists = cfg.keep_records or on_record is not None    # else token times go to the stats alone
        bounds = HitRateBounds(self.kv_capacity * cfg.replicas, cfg.block_size) if cfg.cache_bounds else None
        records: list[RequestRecord] = []
        prog = _Progress(total, cfg.progress)
        last = -math.inf
        n = 0
        for n, tr in enumerate(trace, 1):
            if tr.arrival < last:
                raise ValueError(f"trace not in arrival order: request {n - 1} arrives at {tr.arrival} "
                                 f"after one at {last}")
            last = tr.arrival
            if bounds is not None:
                bounds.observe(tr)
            rec = self._arrive(tr, n - 1)
            if cfg.keep_records:
                records.append(rec)
            prog.update(n, tr.arrival)
        for rep in self.replicas:
            rep.advance_to(math.inf)
        if self._kv_feed is not None:
            self._kv_feed.sync()            # the router's index ends where the caches end
        prog.close(n, max((r.clock for r in self.replicas), default=0.0))
        for rep in self.replicas:
            for track in list(rep.tracks.values()):    # never finished (e.g. stuck without memory)
                self._emit(track.close(lists=self._lists))
        return self._result(records, bounds, time.perf_counter() - wall0, beyond0)

    def _arrive(self, tr: TraceRequest, i: int) -> RequestRecord:
        from shepherd.scheduler.scheduler import QueueFull, RequestRejected
        now = tr.arrival + self.cost.frontend    # the engine sees it after the frontend's part
        req, target = self.make_request(tr, i)
        req.arrival = now
        rec = RequestRecord(req_id=req.req_id, client=tr.client, arrival=tr.arrival, prompt_tokens=tr.prompt_tokens)
        if not self._lazy:
            for rep in self.replicas:
                rep.advance_to(now, settle=self._skip_quiet)
        ridx = self._choose(tr, req, now)
        rep = self.replicas[ridx]
        rec.replica = ridx
        rep.advance_to(now)
        try:
            rep.add(Track(rec, req, target), now)
        except (QueueFull, RequestRejected) as e:
            rec.ok, rec.finish = False, now
            rec.error_kind = e.kind
            r = self.rejections.setdefault(e.kind, {"count": 0, "reason": str(e)})
            r["count"] += 1
            self._drop_route(req.req_id, ridx)
            self._emit(rec)
        return rec

    def _cost_range(self, beyond0: tuple[int, int]) -> dict:
        """How many steps a fitted cost model priced past its profiled range in this run, and
        of those how many at the roofline floor (FittedCostModel); {} for other models."""
        prof = getattr(self.cost, "profiled_tokens", None)
        if prof is None:
            return {}
        return {"profiled_tokens": list(prof), "steps_beyond": self.cost.beyond_steps - beyond0[0],
                "steps_at_roofline_floor": self.cost.floored_steps - beyond0[1],
                "floor": "roofline" if getattr(self.cost, "floor", None) else "none"}

    def _result(self, records: list, bounds: Optional[HitRateBounds], wall: float,
                beyond0: tuple[int, int] = (0, 0)) -> SimResult:
        cfg = self.cfg
        ts, peak = self._timeseries()
        stats = [rep.sched.stats() for rep in self.replicas]
        batches = [b for rep in self.replicas for b in (rep.batches or [])]
        routing = dict(self._router[1].reasons) if self._router is not None else {}
        return SimResult(
            records=records, stats=self.stats, timeseries=ts,
            kv_capacity_tokens=self.kv_capacity * cfg.replicas, kv_peak_used_tokens=peak,
            prefix_query_tokens=sum(s.prefix_query_tokens for s in stats),
            prefix_hit_tokens=sum(s.prefix_hit_tokens for s in stats),
            preemptions=sum(s.preemptions for s in stats),
            steps=sum(r.steps for r in self.replicas), fast_steps=sum(r.fast_steps for r in self.replicas),
            wall_s=wall, config=cfg, cost_model=self.cost.name,
            batches=batches, replica_stats=stats, replicas=[r.counters() for r in self.replicas],
            routing=routing, hit_rate_bounds=bounds.result() if bounds is not None else {},
            rejections=dict(sorted(self.rejections.items())), cost_range=self._cost_range(beyond0),
            max_model_len=self.max_model_len)

    def _drop_route(self, req_id: str, ridx: int) -> None:
        if self._router is None:
            return
        R, policy, states = self._router
        rr = self._routes.pop(req_id, None)
        states[ridx].in_flight -= 1
        if rr is not None:
            policy.on_finish(rr, states[ridx], 0)

    def _timeseries(self) -> tuple[dict, int]:
        """The replicas' thinned series summed on the union of their times; the
        cluster's KV peak (exact for one replica, on the sampled points beyond)."""
        reps = self.replicas
        exact = max((r.kv_peak for r in reps), default=0)
        series = [r.ts for r in reps if r.ts is not None and r.ts.t]
        if not series:
            return {}, exact if len(reps) == 1 else sum(r.kv_peak for r in reps)
        alls = np.unique(np.concatenate([np.asarray(s.t) for s in series]))
        cols = np.zeros((4, alls.size))
        for s in series:
            idx = np.searchsorted(np.asarray(s.t), alls, side="right") - 1
            valid = idx >= 0
            idx = np.clip(idx, 0, None)
            for j, c in enumerate(s.cols):
                cols[j] += np.where(valid, np.asarray(c)[idx], 0)
        peak = max(int(cols[0].max()), exact)
        if alls.size > 4000:
            sel = np.linspace(0, alls.size - 1, 4000).astype(int)
            alls, cols = alls[sel], cols[:, sel]
        cap = self.kv_capacity * len(reps)
        return ({"t": alls.tolist(), "kv_used": cols[0].tolist(), "kv_cached": cols[1].tolist(),
                 "kv_capacity": [cap] * alls.size, "running": cols[2].tolist(), "waiting": cols[3].tolist()},
                peak)


def model_context(name: str) -> Optional[int]:
    """The model preset's context length (None for a model without a preset)."""
    try:
        return get_model(name).max_context
    except KeyError:
        return None


def simulate(trace: Iterable[TraceRequest], cfg: Optional[SimConfig] = None,
             cost_model: Optional[CostModel] = None) -> SimResult:
    return Simulator(cfg or SimConfig(), cost_model).run(trace)


__all__ = ["SimConfig", "SimResult", "Simulator", "simulate"]
