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
from shepherd.bench.stream import RecordStats, TimeBins
from shepherd.bench.traces import prompt_token_ids, session_stream
from shepherd.config import SchedulerConfig, host_pool_tokens, whole_pages
from shepherd.request import Request, SamplingParams
from shepherd.sim.cache_bounds import HitRateBounds
from shepherd.sim.cost_model import LORA_LOAD_S, CostModel, RooflineCostModel
from shepherd.sim.disagg import Disaggregation
from shepherd.sim.fitted_cost import make_cost_model
from shepherd.sim.fleet import FleetCost, PDConfig, ReplicaGroup
from shepherd.sim.hardware import get_model
from shepherd.sim.kv_feed import SimKVFeed
from shepherd.sim.pools import RoutePool
from shepherd.sim.replica import Replica, ReplicaSpec, Track

GC_YOUNG_THRESHOLD = 20_000     # see Simulator.run


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
    skip_quiet: bool = True               # see pools.COUNT_POLICIES (False: advance every replica; tests)
    # a fleet of several GPU types, tensor-parallel degrees or roles (sim/fleet.py); [] = `replicas`
    # replicas of (gpu, tp). A fleet with prefill replicas disaggregates (sim/disagg.py, `pd`).
    fleet: list = field(default_factory=list)
    pd: PDConfig = field(default_factory=PDConfig)
    # when no CostModel is handed to the Simulator: each group's is make_cost_model(model, its gpu,
    # its tp, cost_model=this, **cost_knobs) (roofline | vidur | splitwise | distserve | FILE)
    cost_model: Optional[str] = None
    cost_knobs: dict = field(default_factory=dict)
    gpu_prices: dict = field(default_factory=dict)    # gpu -> $/GPU-hour, over the presets' (FleetCost)
    gpu_powers: dict = field(default_factory=dict)    # gpu -> W per GPU
    # seconds one LoRA adapter load (host -> adapter slot) adds to the step that makes it resident;
    # None: cost_model.LORA_LOAD_S, the engine's measured figure (shepherd:lora_load_seconds)
    adapter_load_time: Optional[float] = None


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
    output_clipped: int = 0                          # outputs cut to max_model_len - prompt
    max_model_len: Optional[int] = None
    fleet: Optional[FleetCost] = None                # the replica groups and their prices
    disagg: dict = field(default_factory=dict)       # prefill/decode disaggregation's counts
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
        ex = {"sim": {"model": c.model, "gpu": c.gpu, "tp": c.tp, "replicas": len(self.replicas), "router": c.router,
                      "cost_model": self.cost_model, "steps": self.steps, "fast_steps": self.fast_steps,
                      "admission": c.scheduler.admission, "preemption": c.scheduler.preemption,
                      "policy": c.scheduler.policy, "prefix_cache": c.scheduler.prefix_cache,
                      "kv_capacity_per_replica": self.kv_capacity_tokens // max(1, len(self.replicas)),
                      "prefix_hit_tokens": self.prefix_hit_tokens,
                      "prefix_query_tokens": self.prefix_query_tokens, "max_model_len": self.max_model_len,
                      **({"cost_model_range": self.cost_range} if self.cost_range else {})},
              "rejections": self.rejections,
              "output_clipped": {"count": self.output_clipped,
                                 "reason": f"trace outputs longer than max_model_len={self.max_model_len} "
                                           "minus the prompt, generated only that far"},
              "hit_rate_bounds": self.hit_rate_bounds,
              "cache": {"cached_peak_tokens": sum(r["cached_peak_tokens"] for r in self.replicas),
                        "evicted_tokens": sum(r["evicted_tokens"] for r in self.replicas)},
              "replicas": self.replicas, "balance": self.balance(), "routing": self.routing}
        if self.fleet is not None:
            ex["sim"]["fleet"] = [g.label() for g in self.fleet.groups]
        if self.disagg:
            ex["disaggregation"] = self.disagg
        if extra:
            ex.update(extra)
        s = summarize(self.stats, kv_capacity_tokens=self.kv_capacity_tokens,
                      kv_peak_used_tokens=self.kv_peak_used_tokens, prefix_hit_rate=self.prefix_hit_rate,
                      slo_ttft=slo_ttft, slo_tpot=slo_tpot, wall_s=self.wall_s, extra=ex)
        if self.fleet is not None:
            dur = s["duration_s"]
            good = (round(s["goodput_req_s"] * dur) if (slo_ttft is not None or slo_tpot is not None)
                    and s["goodput_req_s"] is not None else None)
            s["cost"] = self.fleet.report(dur, [r["busy_s"] for r in self.replicas],
                                          [r["group"] for r in self.replicas],
                                          output_tokens=self.stats.out_tok,
                                          total_tokens=self.stats.out_tok + self.stats.in_tok, good_requests=good)
        return s


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
        """cost_model: every replica's (a plain run, or a fleet of one GPU type); None: each
        replica group's own, from cfg.cost_model and cfg.cost_knobs."""
        self.cfg = cfg
        self.groups = list(cfg.fleet) or [ReplicaGroup(cfg.replicas, cfg.gpu, cfg.tp)]
        if cost_model is not None and len({(g.gpu, g.tp) for g in self.groups}) > 1:
            raise ValueError("one cost model handed in for a fleet of several GPU types or TP degrees: "
                             "leave it None and name it in SimConfig.cost_model (each group gets its own)")
        self.costs = [cost_model or make_cost_model(cfg.model, g.gpu, tp=g.tp, cost_model=cfg.cost_model,
                                                    **cfg.cost_knobs) for g in self.groups]
        self.cost = self.costs[0]
        self.fleet = FleetCost(self.groups, cfg.gpu_prices, cfg.gpu_powers)
        self.num_replicas = sum(g.count for g in self.groups)
        self.specs = [self._spec(gi, g, cost) for gi, (g, cost) in enumerate(zip(self.groups, self.costs))]
        self.kv_capacity = self.specs[0].sched_cfg.max_total_tokens      # per replica (of the first group)
        self.kv_capacity_total = sum(sp.sched_cfg.max_total_tokens * g.count for sp, g in zip(self.specs, self.groups))
        self.sched_cfg = self.specs[0].sched_cfg
        self.host_kv = self.specs[0].host_kv
        self.max_model_len = self.specs[0].max_model_len
        self._pools: list[RoutePool] = []
        self._rr = -1                # the built-in round robin's last choice (routing/ missing)
        self._routes: dict = {}
        self._bounds: Optional[HitRateBounds] = None    # the run's, while it runs

    def _spec(self, gi: int, g: ReplicaGroup, cost: CostModel) -> ReplicaSpec:
        """What group gi's replicas are built from: its KV capacity from its cost model (or
        cfg.kv_capacity), its scheduler knobs validated once."""
        cfg = self.cfg
        page = cfg.scheduler.page_size
        if cfg.kv_capacity:
            cap = cfg.kv_capacity
        else:
            gpu_model = getattr(cost, "gpu_model", cost)       # a HostPathCostModel's own GPU model
            cap = cost.kv_capacity_tokens(mem_fraction=cfg.mem_fraction, page_size=page) \
                if isinstance(gpu_model, RooflineCostModel) else cost.kv_capacity_tokens()
        cap = whole_pages(cap, page)
        sched = dataclasses.replace(cfg.scheduler, max_total_tokens=cap, **g.scheduler).validate()
        host = host_pool_tokens(cfg.host_kv_tokens, cap, sched.preemption)
        mml = cfg.max_model_len or model_context(cfg.model) or cap
        return ReplicaSpec(sched, cost, host, mml, self.vocab_size(), fast=cfg.fast, timeseries=cfg.timeseries,
                           record_batches=cfg.record_batches, group=gi, role=g.role,
                           label=f"{g.gpu}" + (f"/tp{g.tp}" if g.tp > 1 else ""),
                           lora_load_time=LORA_LOAD_S if cfg.adapter_load_time is None else cfg.adapter_load_time)

    def vocab_size(self) -> int:
        cfg = self.cfg
        if cfg.vocab_size:
            return cfg.vocab_size
        try:
            return get_model(cfg.model).vocab_size
        except KeyError:
            return 32000

    @property
    def vocab(self) -> int:
        return self.specs[0].vocab

    # -- routing -----------------------------------------------------------------
    @property
    def policy(self):
        """The routing policy of the last run (None before one)."""
        return self._router.policy if self._router is not None else None

    def on_finish(self, rep: Replica, tr: Track) -> None:
        """A request ended on a replica: a prefill hands it over to its decode replica (sim/
        disagg.py); anything else tells the router and streams its record out."""
        rid = tr.rec.req_id
        if rep.role == "prefill" and self._disagg is not None and self._disagg.owns(rid):
            rep, nxt = self._disagg.prefilled(rep, tr)
            if nxt is not None:
                return                   # decodes on `rep` once its KV has crossed (Disaggregation.due)
        self.finished += 1
        if self._bounds is not None:          # the answer is whole in that engine's cache now (causal bound)
            if tr.rec.ok:
                self._bounds.finished(rid, tr.rec.finish)
            else:
                self._bounds.forget(rid)
        if self._router is not None:
            self._router.finished(rep, rid, tr.rec.finish, tr.ntok)
        self._emit(tr.close(lists=self._lists))

    def _emit(self, rec: RequestRecord) -> None:
        self.stats.add(rec)
        if rec.cached_tokens:
            self._hits.add1("prefix_hit", rec.arrival, rec.cached_tokens)
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
        rid = request_id(tr, i)
        req = Request(req_id=rid, prompt_ids=prompt_token_ids(tr, self.vocab, self.cfg.block_size), params=params,
                      arrival=tr.arrival, client=tr.client, priority=tr.priority, eos_token_ids=(2,),
                      adapter=tr.adapter)
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
        self.replicas = []
        for g, spec in zip(self.groups, self.specs):
            for _ in range(g.count):
                self.replicas.append(Replica(len(self.replicas), spec, self.on_finish))
        serve = [r for r in self.replicas if r.role != "prefill"]
        prefill = [r for r in self.replicas if r.role == "prefill"]
        if not serve:
            raise ValueError("the fleet has prefill replicas only: add replicas that decode (@decode or no role)")
        self._router = RoutePool(serve, cfg.router, cfg.router_knobs, cfg.seed, cfg.skip_quiet)
        self._disagg = (Disaggregation(cfg.pd, RoutePool(prefill, cfg.pd.prefill_router, {}, cfg.seed,
                                                         cfg.skip_quiet)) if prefill else None)
        # a policy that reads KV events (precise-prefix) gets every replica's cache as of each decision
        index = getattr(self._router.policy, "kv_index", None)
        self._kv_feed = SimKVFeed(index, serve) if index is not None else None
        self._router.feed = self._kv_feed
        self.finished = 0
        self.rejections: dict = {}
        self.output_clipped = 0          # accepted requests whose trace output ran past max_model_len
        beyond0 = self._beyond_counts()
        self.stats = RecordStats(seed=cfg.seed)
        self._hits = TimeBins()          # prefix tokens asked, hit, and the bounds' hits, by arrival time
        self._on_record = on_record
        self._lists = cfg.keep_records or on_record is not None    # else token times go to the stats alone
        bounds = (HitRateBounds(self.kv_capacity_total, cfg.block_size,
                                on_causal_hit=lambda t, h: self._hits.add1("prefix_hit_lru_cluster_causal",
                                                                           t.arrival, h))
                  if cfg.cache_bounds else None)
        self._bounds = bounds
        records: list[RequestRecord] = []
        prog = _Progress(total, cfg.progress)
        last = -math.inf
        n = 0
        for n, tr in enumerate(trace, 1):
            if tr.arrival < last:
                raise ValueError(f"trace not in arrival order: request {n - 1} arrives at {tr.arrival} "
                                 f"after one at {last}")
            last = tr.arrival
            rec = self._arrive(tr, n - 1)
            # the bounds see the requests the achieved rate sees: not one refused at arrival (context
            # length, queue full), which counted 50 rejected prompts against 50 served ones. Observed
            # after the add, with the same state: only observe() changes what the bounds match against
            if bounds is not None and rec.error_kind is None:
                inf0, lru0 = bounds.hit_inf, bounds.hit_lru
                bounds.observe(tr, request_id(tr, n - 1), at=tr.arrival + self.cost.frontend)
                # the bounds' hits by arrival time, beside the achieved ones (_emit): plots.py's prefix_time.png
                bins = self._hits
                bins.add1("prefix_query", tr.arrival, tr.prompt_tokens)
                bins.add1("prefix_hit_infinite", tr.arrival, bounds.hit_inf - inf0)
                bins.add1("prefix_hit_lru_cluster", tr.arrival, bounds.hit_lru - lru0)
            if bounds is not None:
                bounds.settle(self._reported_until(tr.arrival + self.cost.frontend))
            if cfg.keep_records:
                records.append(rec)
            prog.update(n, tr.arrival)
        self._land(math.inf)
        for rep in self.replicas:
            rep.advance_to(math.inf)
        if self._kv_feed is not None:
            self._kv_feed.sync()            # the router's index ends where the caches end
        if bounds is not None:
            bounds.settle(math.inf)         # every finish is in: the causal bound's last arrivals
        prog.close(n, max((r.clock for r in self.replicas), default=0.0))
        for rep in self.replicas:
            for track in list(rep.tracks.values()):    # never finished (e.g. stuck without memory)
                self._emit(track.close(lists=self._lists))
        return self._result(records, bounds, time.perf_counter() - wall0, beyond0)

    def _arrive(self, tr: TraceRequest, i: int) -> RequestRecord:
        now = tr.arrival + self.cost.frontend    # the engine sees it after the frontend's part
        req, target = self.make_request(tr, i)
        req.arrival = now
        rec = RequestRecord(req_id=req.req_id, client=tr.client, arrival=tr.arrival, prompt_tokens=tr.prompt_tokens)
        self._land(now)
        self._router.advance(now)
        rep = self._router.choose(tr, req, now)
        rec.replica = rep.idx
        rep.advance_to(now)
        track = Track(rec, req, target)
        if self._disagg is not None:
            if self._disagg.wants(rep, req):
                pre, track = self._disagg.send(tr, req, target, rep, rec, now)
                pre.advance_to(now)
                self._add(pre, track, now, self._disagg.pool)
                return rec
            self._disagg.local += 1
        self._add(rep, track, now, self._router)
        return rec

    def _add(self, rep: Replica, track: Track, now: float, pool: RoutePool) -> None:
        """Hand a request to a replica; one it refuses (QueueFull, RequestRejected) is a counted
        rejection, its record out at once."""
        from shepherd.scheduler.scheduler import QueueFull, RequestRejected
        try:
            rep.add(track, now)
            # the scheduler clips max_tokens to the context left (as the engine does); the trace's
            # longer output then never happens, which was silent: count it for the summary
            room = self.max_model_len - len(track.req.prompt_ids)
            if track.target > room:
                self.output_clipped += 1
        except (QueueFull, RequestRejected) as e:
            rec = track.rec
            rec.ok, rec.finish = False, now
            rec.error_kind = e.kind
            r = self.rejections.setdefault(e.kind, {"count": 0, "reason": str(e)})
            r["count"] += 1
            rid = rec.req_id
            if self._bounds is not None:
                self._bounds.forget(rid)
            pool.finished(rep, rid, now, 0)
            if pool is not self._router:       # a prefill refused: the decode replica chosen for it too
                self._router.finished(self._disagg.dropped(rid), rid, now, 0)
            self._emit(track.close(lists=self._lists))

    def _reported_until(self, now: float) -> float:
        """Every request that finishes at or before this time has been reported (on_finish):
        a replica with requests has run every step up to its clock, its next finish is later;
        a request crossing from a prefill replica finishes after it lands."""
        t = now
        for rep in self.replicas:
            if rep.tracks and rep.clock < t:
                t = rep.clock
        if self._disagg is not None:
            t = min(t, self._disagg.next_landing())
        return t

    def _land(self, t: float) -> None:
        """Every KV transfer from a prefill replica that lands by t joins its decode replica
        (sim/disagg.py), in time order."""
        if self._disagg is None:
            return
        for when, rep, track in self._disagg.due(t):
            rep.advance_to(when)
            track.move("queued", when)
            track.req.arrival = when
            self._add(rep, track, when, self._router)

    def _beyond_counts(self) -> tuple[int, int]:
        costs = {id(c): c for c in self.costs}.values()     # groups may share one model (not hashable)
        return (sum(getattr(c, "beyond_steps", 0) for c in costs), sum(getattr(c, "floored_steps", 0) for c in costs))

    def _cost_range(self, beyond0: tuple[int, int]) -> dict:
        """How many steps a fitted cost model priced past its profiled range in this run, and
        of those how many at the roofline floor (FittedCostModel); {} for other models."""
        prof = getattr(self.cost, "profiled_tokens", None)
        if prof is None:
            return {}
        now = self._beyond_counts()
        return {"profiled_tokens": list(prof), "steps_beyond": now[0] - beyond0[0],
                "steps_at_roofline_floor": now[1] - beyond0[1],
                "floor": "roofline" if getattr(self.cost, "floor", None) else "none"}

    def _result(self, records: list, bounds: Optional[HitRateBounds], wall: float,
                beyond0: tuple[int, int] = (0, 0)) -> SimResult:
        cfg = self.cfg
        ts, peak = self._timeseries()
        stats = [rep.sched.stats() for rep in self.replicas]
        batches = [b for rep in self.replicas for b in (rep.batches or [])]
        routing = self._router.reasons if self._router is not None else {}
        return SimResult(
            records=records, stats=self.stats, timeseries=ts,
            kv_capacity_tokens=self.kv_capacity_total, kv_peak_used_tokens=peak,
            prefix_query_tokens=sum(s.prefix_query_tokens for s in stats),
            prefix_hit_tokens=sum(s.prefix_hit_tokens for s in stats),
            preemptions=sum(s.preemptions for s in stats),
            steps=sum(r.steps for r in self.replicas), fast_steps=sum(r.fast_steps for r in self.replicas),
            wall_s=wall, config=cfg, cost_model=self.cost.name,
            batches=batches, replica_stats=stats, replicas=[r.counters() for r in self.replicas],
            routing=routing, hit_rate_bounds=bounds.result() if bounds is not None else {},
            rejections=dict(sorted(self.rejections.items())), output_clipped=self.output_clipped,
            cost_range=self._cost_range(beyond0),
            max_model_len=self.max_model_len, fleet=self.fleet,
            disagg=self._disagg.summary() if self._disagg is not None else {})

    def _timeseries(self) -> tuple[dict, int]:
        """The replicas' thinned series summed on the union of their times; the
        cluster's KV peak (exact for one replica, on the sampled points beyond)."""
        reps = self.replicas
        exact = max((r.kv_peak for r in reps), default=0)
        series = [r.ts for r in reps if r.ts is not None and r.ts.t]
        if not series:
            return {}, exact if len(reps) == 1 else sum(r.kv_peak for r in reps)
        alls = np.unique(np.concatenate([np.asarray(s.t) for s in series]))
        # per replica (those with a series, in replica order): [replica, column, time]
        per = np.zeros((len(series), 4, alls.size))
        for i, s in enumerate(series):
            idx = np.searchsorted(np.asarray(s.t), alls, side="right") - 1
            valid = idx >= 0
            idx = np.clip(idx, 0, None)
            for j, c in enumerate(s.cols):
                per[i, j] = np.where(valid, np.asarray(c)[idx], 0)
        cols = per.sum(axis=0)
        peak = max(int(cols[0].max()), exact)
        if alls.size > 4000:
            sel = np.linspace(0, alls.size - 1, 4000).astype(int)
            alls, cols, per = alls[sel], cols[:, sel], per[:, :, sel]
        cap = self.kv_capacity_total
        return ({"t": alls.tolist(), "kv_used": cols[0].tolist(), "kv_cached": cols[1].tolist(),
                 "kv_capacity": [cap] * alls.size, "running": cols[2].tolist(), "waiting": cols[3].tolist(),
                 # each replica's own: what plots.py's replicas.png draws
                 "replica_ids": [i for i, r in enumerate(reps) if r.ts is not None and r.ts.t],
                 "replica_kv_used": per[:, 0].tolist(), "replica_kv_cached": per[:, 1].tolist(),
                 "replica_kv_capacity": [r.kv_capacity for r in reps if r.ts is not None and r.ts.t],
                 "replica_running": per[:, 2].tolist(), "replica_waiting": per[:, 3].tolist(),
                 **self._hit_series()},
                peak)

    def _hit_series(self) -> dict:
        """Prefix tokens asked and hit per arrival-time bin, with both bounds' hits (when the
        bounds ran): {"prefix_edges": [bins + 1], "prefix_query", "prefix_hit", ...}."""
        h = self._hits
        q = h.get("prefix_query")
        if not q.any():
            return {}
        last = int(np.nonzero(q)[0][-1]) + 1
        out = {"prefix_edges": h.edges()[:last + 1].tolist()}
        for k in ("prefix_query", "prefix_hit", "prefix_hit_infinite", "prefix_hit_lru_cluster",
                  "prefix_hit_lru_cluster_causal"):
            out[k] = h.get(k)[:last].tolist()
        return out


def request_id(tr: TraceRequest, i: int) -> str:
    """The simulator's id for the i-th request of a trace (its records' req_id)."""
    return f"r{tr.index if tr.index is not None else i}"


def model_context(name: str) -> Optional[int]:
    """The model preset's context length (None for a model without a preset)."""
    try:
        return get_model(name).max_context
    except KeyError:
        return None


def simulate(trace: Iterable[TraceRequest], cfg: Optional[SimConfig] = None,
             cost_model: Optional[CostModel] = None) -> SimResult:
    return Simulator(cfg or SimConfig(), cost_model).run(trace)


__all__ = ["SimConfig", "SimResult", "Simulator", "request_id", "simulate"]
