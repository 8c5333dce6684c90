"""`shepherd simulate --search`: the cheapest fleet that meets the SLOs on a trace (Vidur's
config search, with shepherd's own scheduler and routers).

Every candidate (GPU type, TP, replica count, max batch, chunk size, admission mode, router,
prefill/decode split) is simulated on the same trace. A candidate meets the SLOs when at
least `attainment` of *all* requests (rejected ones count as misses) have TTFT <= slo_ttft and
TPOT <= slo_tpot; it is affordable when its fleet costs at most `budget` $/hour. The answer
is the cheapest candidate that meets the SLOs and the Pareto set over ($/hour, attainment):
every candidate no other one beats on both.

Replica counts are tried in increasing order for each of the other settings, and the larger
counts are skipped once one meets the SLOs (more replicas of the same kind cost more and do
not serve a fixed trace worse, to the resolution a planner needs): a grid of G settings and
R counts costs at most G x R runs, usually far fewer.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from shepherd.sim.fleet import FleetCost, ReplicaGroup
from shepherd.sim.hardware import get_gpu


@dataclass
class SearchSpace:
    gpus: list = field(default_factory=lambda: ["a100-80gb", "h100", "h200"])
    tps: list = field(default_factory=lambda: [1, 2])
    replicas: list = field(default_factory=lambda: [1, 2, 4, 8])
    max_batch: list = field(default_factory=lambda: [256])
    chunk: list = field(default_factory=lambda: [2048])        # max_num_tokens
    admission: list = field(default_factory=lambda: ["optimistic"])
    routers: list = field(default_factory=lambda: ["least-request"])
    # prefill replicas per fleet (0: none); with k > 0 a fleet of n replicas has k prefill and n - k decode
    pd_prefill: list = field(default_factory=lambda: [0])


@dataclass
class Candidate:
    gpu: str
    tp: int
    replicas: int
    max_batch: int
    chunk: int
    admission: str
    router: str
    pd_prefill: int = 0

    def fleet(self) -> list[ReplicaGroup]:
        if self.pd_prefill:
            return [ReplicaGroup(self.pd_prefill, self.gpu, self.tp, "prefill"),
                    ReplicaGroup(self.replicas - self.pd_prefill, self.gpu, self.tp, "decode")]
        return [ReplicaGroup(self.replicas, self.gpu, self.tp)]

    def label(self) -> str:
        return ",".join(g.label() for g in self.fleet())


@dataclass
class Outcome:
    candidate: Candidate
    dollars_per_hour: float
    attainment: float                 # of all requests: within both SLOs
    meets: bool
    ttft_p99: Optional[float] = None
    tpot_p99: Optional[float] = None
    error: Optional[str] = None       # the candidate could not run (e.g. the model does not fit)

    def row(self) -> dict:
        return {**dataclasses.asdict(self.candidate), "fleet": self.candidate.label(),
                "dollars_per_hour": self.dollars_per_hour, "attainment": self.attainment, "meets_slos": self.meets,
                "ttft_p99": self.ttft_p99, "tpot_p99": self.tpot_p99, "error": self.error}


@dataclass
class SearchResult:
    outcomes: list[Outcome]
    best: Optional[Outcome]           # the cheapest that meets the SLOs within the budget
    pareto: list[Outcome]             # by $/hour ascending
    runs: int
    skipped: int
    wall_s: float


def candidates(space: SearchSpace) -> list[list[Candidate]]:
    """The grid, grouped: each inner list differs only in replica count (ascending)."""
    groups = []
    for gpu, tp, mb, ch, adm, router, k in itertools.product(space.gpus, space.tps, space.max_batch, space.chunk,
                                                            space.admission, space.routers, space.pd_prefill):
        row = [Candidate(gpu, tp, n, mb, ch, adm, router, k) for n in sorted(space.replicas) if n > k]
        if row:
            groups.append(row)
    return groups


def pareto(outcomes: list[Outcome]) -> list[Outcome]:
    """Outcomes no other beats on both lower $/hour and higher attainment (ties: the first)."""
    ok = sorted((o for o in outcomes if o.error is None), key=lambda o: (o.dollars_per_hour, -o.attainment))
    front, best = [], -1.0
    for o in ok:
        if o.attainment > best:
            front.append(o)
            best = o.attainment
    return front


def search(space: SearchSpace, evaluate: Callable[[Candidate], tuple[float, Optional[float], Optional[float]]], *,
           attainment: float = 0.9, budget: Optional[float] = None, prices: Optional[dict] = None,
           progress: Optional[Callable[[Outcome], None]] = None) -> SearchResult:
    """evaluate(candidate) -> (attainment, ttft_p99, tpot_p99); raises ValueError/KeyError when the
    candidate cannot run. prices: gpu -> $/GPU-hour over the presets'."""
    t0 = time.perf_counter()
    outcomes: list[Outcome] = []
    runs = skipped = 0
    for row in candidates(space):
        for i, c in enumerate(row):
            dph = FleetCost(c.fleet(), prices or {}).dollars_per_hour()
            if dph is None:
                raise ValueError(f"no $/hour known for {c.gpu}: give --gpu-price {c.gpu}=$")
            if budget is not None and dph > budget:
                skipped += len(row) - i          # the larger counts cost more still
                break
            runs += 1
            try:
                att, t99, p99 = evaluate(c)
                o = Outcome(c, dph, att, att >= attainment, t99, p99)
            except (ValueError, KeyError) as e:
                o = Outcome(c, dph, 0.0, False, error=str(e))
            outcomes.append(o)
            if progress is not None:
                progress(o)
            if o.meets:
                skipped += len(row) - i - 1
                break
    meets = [o for o in outcomes if o.meets]
    best = min(meets, key=lambda o: (o.dollars_per_hour, -o.attainment)) if meets else None
    return SearchResult(outcomes, best, pareto(outcomes), runs, skipped, time.perf_counter() - t0)


def simulate_candidate(trace: list, base, cost_model: Optional[str], slo_ttft: Optional[float],
                       slo_tpot: Optional[float]):
    """An evaluate() for search(): simulate the candidate on `trace` from SimConfig `base`."""
    from shepherd.sim.simulator import Simulator

    def evaluate(c: Candidate):
        sched = dataclasses.replace(base.scheduler, max_batch_size=c.max_batch, max_num_tokens=c.chunk,
                                    admission=c.admission)
        cfg = dataclasses.replace(base, fleet=c.fleet(), router=c.router, scheduler=sched, cost_model=cost_model,
                                  keep_records=False, progress=False, timeseries=False, cache_bounds=False)
        get_gpu(c.gpu)
        res = Simulator(cfg).run(trace)
        st = res.stats
        good = st.goodput_count(slo_ttft, slo_tpot)
        s = res.summary(slo_ttft=slo_ttft, slo_tpot=slo_tpot)
        return good / max(1, st.n), s["ttft_p99"], s["tpot_p99"]

    return evaluate


def format_search(res: SearchResult, attainment: float, budget: Optional[float]) -> str:
    lines = [f"{res.runs} configurations simulated, {res.skipped} skipped (a smaller one already met the SLOs, "
             f"or over the budget), in {res.wall_s:.1f} s wall"]
    if res.best is None:
        lines.append(f"no configuration meets the SLOs for {attainment:.0%} of requests"
                     + (f" within ${budget:g}/h" if budget is not None else ""))
    else:
        b = res.best
        lines.append(f"cheapest that meets the SLOs: {b.candidate.label()} (max batch {b.candidate.max_batch}, "
                     f"chunk {b.candidate.chunk}, {b.candidate.admission}, router {b.candidate.router}): "
                     f"${b.dollars_per_hour:.2f}/h, {b.attainment:.1%} within the SLOs")
    lines += ["", "Pareto set ($/hour against attainment):",
              f"{'fleet':<34} {'batch':>6} {'chunk':>6} {'admission':>10} {'router':>14} {'$/h':>7} {'attain':>7}"]
    for o in res.pareto:
        c = o.candidate
        lines.append(f"{c.label():<34} {c.max_batch:>6} {c.chunk:>6} {c.admission:>10} {c.router:>14} "
                     f"{o.dollars_per_hour:>7.2f} {o.attainment:>7.1%}")
    return "\n".join(lines)


__all__ = ["SearchSpace", "Candidate", "Outcome", "SearchResult", "candidates", "pareto", "search",
           "simulate_candidate", "format_search"]
