"""Streaming statistics over RequestRecords: what summary.json and the plots
need, in memory that does not grow with the token count of the run.

    stats = RecordStats()
    stats.add(record)            # as each request ends; the record can be dropped after
    stats.summary(...)           # the dict of report.summarize
    stats.sample                 # up to SAMPLE_RECORDS records (reservoir), for the timeline
    stats.recent                 # the last RECENT_RECORDS records to end (a readable window)

Per finished request a few floats are kept (TTFT, TPOT, E2E: exact
percentiles for any run); inter-token latencies are pooled exactly up to
ITL_RESERVOIR gaps and sampled uniformly beyond (a reservoir, seeded, so a
run is reproducible). Rates over time (tokens, arrivals, finishes, service
per client) go into TimeBins: fixed-count bins whose width doubles when the
run outgrows them.
"""
from __future__ import annotations

import math
import random
from array import array
from collections import defaultdict, deque
from typing import Optional

import numpy as np

from shepherd.bench.records import RequestRecord

INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0
ITL_RESERVOIR = 1 << 21
SAMPLE_RECORDS = 300
RECENT_RECORDS = 150
PENDING_RECORDS = 256      # token times are binned and pooled this many records at a time


# latency percentiles over time: each completed request's TTFT and TPOT counted, at its arrival,
# in one of LAT_BUCKETS geometric buckets (ratio LAT_RATIO from LAT_MIN s: 1 ms to ~30 min), so a
# percentile per time bin costs buckets x bins of memory, not one value per request
LAT_MIN = 1e-3
LAT_RATIO = 1.25
LAT_BUCKETS = 64


def lat_bucket(v: float) -> int:
    if not v > LAT_MIN:
        return 0
    return min(LAT_BUCKETS - 1, int(math.log(v / LAT_MIN) / math.log(LAT_RATIO)) + 1)


def bucket_value(k: np.ndarray) -> np.ndarray:
    """A bucket's representative latency: the geometric middle of its edges (bucket 0: LAT_MIN)."""
    k = np.asarray(k, dtype=np.float64)
    return np.where(k <= 0, LAT_MIN, LAT_MIN * LAT_RATIO ** (k - 0.5))


def tpot_of(r: RequestRecord) -> Optional[float]:
    if r.output_tokens < 2 or r.first_token is None:
        return None
    last = float(r.token_times[-1]) if len(r.token_times) else r.finish
    if last is None:
        return None
    n = len(r.token_times) or r.output_tokens
    if n < 2:
        return None
    return (last - r.first_token) / (n - 1)


def service_of(r: RequestRecord, input_weight: float = INPUT_WEIGHT, output_weight: float = OUTPUT_WEIGHT) -> float:
    served_out = len(r.token_times) or (r.output_tokens if r.first_token is not None else 0)
    served_in = r.prompt_tokens if r.first_token is not None else 0
    return input_weight * served_in + output_weight * served_out


class TimeBins:
    """Named series of per-bin sums over time, all on one grid of at most
    `max_bins` bins from t = 0; the width doubles (pairs merge) as needed.
    Times are buffered and binned in bulk (one bincount per PENDING values)."""

    PENDING = 1 << 16

    def __init__(self, width: float = 0.01, max_bins: int = 2048):
        self.width = width
        self.max_bins = max_bins
        self.series: dict[str, np.ndarray] = {}
        self._pending: dict[str, list] = {}
        self._npending = 0
        self._tmax = 0.0

    def _fit(self, t_max: float) -> None:
        while t_max >= self.width * self.max_bins:
            self.width *= 2
            for k, v in self.series.items():
                self.series[k] = np.concatenate([v.reshape(-1, 2).sum(axis=1), np.zeros(self.max_bins // 2)])

    def _series(self, name: str) -> np.ndarray:
        s = self.series.get(name)
        if s is None:
            s = self.series[name] = np.zeros(self.max_bins)
        return s

    def flush(self) -> None:
        if not self._npending:
            return
        self._fit(self._tmax)
        for name, parts in self._pending.items():
            t = np.concatenate([p[0] for p in parts])
            w = np.repeat([p[1] for p in parts], [p[0].size for p in parts])
            idx = np.minimum((t / self.width).astype(np.int64), self.max_bins - 1)
            self._series(name)[:] += np.bincount(idx, weights=w, minlength=self.max_bins)
        self._pending.clear()
        self._npending = 0

    def add(self, name: str, times, weight: float = 1.0) -> None:
        t = np.asarray(times, dtype=np.float64)
        if t.size == 0:
            return
        self._tmax = max(self._tmax, float(t[-1]) if t.size == 1 else float(t.max()))
        self._pending.setdefault(name, []).append((t, weight))
        self._npending += t.size
        if self._npending >= self.PENDING:
            self.flush()

    def add1(self, name: str, t: float, w: float = 1.0) -> None:
        # pending times are unbinned, so widening the grid here leaves them right
        if t >= self.width * self.max_bins:
            self._fit(t)
        self._series(name)[max(0, int(t / self.width))] += w

    def get(self, name: str) -> np.ndarray:
        self.flush()
        s = self.series.get(name)
        return s if s is not None else np.zeros(self.max_bins)

    def edges(self) -> np.ndarray:
        self.flush()
        return np.arange(self.max_bins + 1) * self.width


class _Client:
    __slots__ = ("requests", "completed", "failed", "service", "input_tokens", "output_tokens",
                 "ttft", "tpot", "e2e", "preemptions")

    def __init__(self):
        self.requests = self.completed = self.failed = self.preemptions = 0
        self.service = 0.0
        self.input_tokens = self.output_tokens = 0
        self.ttft, self.tpot, self.e2e = array("d"), array("d"), array("d")


class RecordStats:
    def __init__(self, seed: int = 0, sample_records: int = SAMPLE_RECORDS):
        self.n = 0
        self.failures: dict[str, int] = defaultdict(int)
        self.ttft, self.tpot, self.e2e = array("d"), array("d"), array("d")   # completed, aligned
        self._itl = np.zeros(1024)      # grows by doubling up to ITL_RESERVOIR
        self._itl_n = 0
        self._itl_seen = 0
        self.out_tok = self.in_tok = 0
        self.preemptions = 0
        self.start = math.inf
        self.end = -math.inf
        self.clients: dict[str, _Client] = {}
        self._bins = TimeBins()
        # records' token times not yet binned / pooled: (times, client, completed); numpy per call
        # costs more than the work on one request's few hundred times, so they go in batches
        self._tok_pending: list = []
        self.sample: list[RequestRecord] = []          # uniform over the run
        self.recent: deque = deque(maxlen=RECENT_RECORDS)   # the last to end: a contiguous window
        self.sample_cap = sample_records
        self._rng = random.Random(seed)
        self._itl_rng = np.random.default_rng(seed)

    # -- intake ------------------------------------------------------------------
    def add(self, r: RequestRecord) -> None:
        self.n += 1
        c = self.clients.get(r.client)
        if c is None:
            c = self.clients[r.client] = _Client()
        c.requests += 1
        c.preemptions += r.preemptions
        self.preemptions += r.preemptions
        self.start = min(self.start, r.arrival)
        for t in (r.finish, float(r.token_times[-1]) if len(r.token_times) else None):
            if t is not None and t > self.end:
                self.end = t
        svc = service_of(r)
        c.service += svc
        self._add_bins(r)
        done = False
        if not r.ok:
            c.failed += 1
            self.failures[r.error_kind or "error"] += 1
        elif r.finish is not None:
            self._add_done(r, c)
            done = True
        if len(r.token_times):
            self._tok_pending.append((r.token_times, r.client, done))
            if len(self._tok_pending) >= PENDING_RECORDS:
                self._flush_tokens()
        self._add_sample(r)

    def _flush_tokens(self) -> None:
        """Bin and pool the pending records' token times, in record order: the same
        bins, and the same gaps given to the reservoir in the same order (so the same
        draws), as one record at a time."""
        pend = self._tok_pending
        if not pend:
            return
        self._tok_pending = []
        sizes = np.fromiter((len(p[0]) for p in pend), dtype=np.int64, count=len(pend))
        tt = np.concatenate([p[0] for p in pend]).astype(np.float64, copy=False)
        b = self._bins
        b.add("tokens", tt)
        ends = np.cumsum(sizes)
        starts = ends - sizes
        for c in {p[1] for p in pend}:
            mine = [i for i, p in enumerate(pend) if p[1] == c]
            part = tt if len(mine) == len(pend) else np.concatenate([tt[starts[i]:ends[i]] for i in mine])
            b.add(f"service/{c}", part, OUTPUT_WEIGHT)
        # inter-token gaps of completed records: diffs within each record, none across two
        keep = np.ones(tt.size, dtype=bool)
        keep[starts] = False
        for i, p in enumerate(pend):
            if not p[2]:
                keep[starts[i]:ends[i]] = False
        gaps = np.diff(tt, prepend=tt[0] if tt.size else 0.0)[keep]
        if gaps.size:
            self._add_itl(gaps)

    @property
    def bins(self) -> TimeBins:
        self._flush_tokens()
        return self._bins

    @property
    def itl_seen(self) -> int:
        self._flush_tokens()
        return self._itl_seen

    def _add_done(self, r: RequestRecord, c: _Client) -> None:
        tp = tpot_of(r)
        ttft = r.ttft if r.first_token is not None else math.nan
        self.ttft.append(ttft)
        self.tpot.append(math.nan if tp is None else tp)
        self.e2e.append(r.e2e)
        if not math.isnan(ttft):
            self._bins.add1(f"ttft_h/{lat_bucket(ttft)}", r.arrival)
        if tp is not None:
            self._bins.add1(f"tpot_h/{lat_bucket(tp)}", r.arrival)
        c.completed += 1
        if r.first_token is not None:
            c.ttft.append(ttft)
        if tp is not None:
            c.tpot.append(tp)
        c.e2e.append(r.e2e)
        c.input_tokens += r.prompt_tokens
        c.output_tokens += r.output_tokens
        self.in_tok += r.prompt_tokens
        self.out_tok += r.output_tokens

    def percentiles_over_time(self, name: str, qs=(50, 90, 99), points: int = 60):
        """(bin middles, {q: latency}) of `name` ("ttft" or "tpot") by arrival time, in at most
        `points` bins: each percentile read from the bin's bucket counts (to within a bucket,
        25%); NaN where a bin has no completed request."""
        b = self.bins
        b.flush()
        end = max(self.end, self.start + 1e-6)
        nb = min(b.max_bins, int(end / b.width) + 1)
        group = max(1, -(-nb // points))
        counts = np.zeros((LAT_BUCKETS, -(-nb // group)))
        for k in range(LAT_BUCKETS):
            s = b.series.get(f"{name}_h/{k}")
            if s is not None:
                v = s[:nb]
                counts[k] = np.add.reduceat(v, np.arange(0, nb, group))
        edges = b.edges()
        mids = (edges[0:nb:group] + np.minimum(edges[0:nb:group] + group * b.width, end)) / 2
        total = counts.sum(axis=0)
        cum = np.cumsum(counts, axis=0)
        out = {}
        for q in qs:
            k = np.argmax(cum >= (q / 100.0) * total, axis=0)
            out[q] = np.where(total > 0, bucket_value(k), np.nan)
        return mids, out

    @property
    def itl(self) -> np.ndarray:
        """The pooled inter-token gaps (all of them, or a uniform sample of ITL_RESERVOIR)."""
        self._flush_tokens()
        return self._itl[:self._itl_n]

    def _add_itl(self, gaps: np.ndarray) -> None:
        cap = ITL_RESERVOIR
        seen = self._itl_seen
        self._itl_seen += gaps.size
        n = self._itl_n
        take = min(cap - n, gaps.size)
        if take > 0:
            if n + take > self._itl.size:
                grown = np.zeros(min(cap, max(2 * self._itl.size, n + take)))
                grown[:n] = self._itl[:n]
                self._itl = grown
            self._itl[n:n + take] = gaps[:take]
            self._itl_n = n + take
            gaps = gaps[take:]
            seen += take
        if gaps.size:
            # reservoir (algorithm R), vectorised: gap j replaces slot r if r < cap, r uniform in [0, seen + j]
            r = (self._itl_rng.random(gaps.size) * (seen + 1 + np.arange(gaps.size))).astype(np.int64)
            keep = r < cap
            self._itl[r[keep]] = gaps[keep]

    def _add_bins(self, r: RequestRecord) -> None:
        b = self._bins
        c = r.client
        b.add1("arrivals", r.arrival)
        b.add1(f"arrive/{c}", r.arrival)
        if r.finish is not None:
            b.add1("finishes", r.finish)
            b.add1(f"finish/{c}", r.finish)
        if r.first_token is not None:
            b.add1(f"service/{c}", r.first_token, INPUT_WEIGHT * r.prompt_tokens)

    def _add_sample(self, r: RequestRecord) -> None:
        # the records themselves: a caller that streams drops their token times after add()
        self.recent.append(r)
        if len(self.sample) < self.sample_cap:
            self.sample.append(r)
            return
        j = self._rng.randrange(self.n)
        if j < self.sample_cap:
            self.sample[j] = r

    # -- results -------------------------------------------------------------------
    @property
    def completed(self) -> int:
        return len(self.e2e)

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def duration(self) -> float:
        if self.n == 0:
            return 0.0
        end = self.end if self.end > -math.inf else self.start
        return max(end - self.start, 0.0)

    def goodput_count(self, slo_ttft: Optional[float], slo_tpot: Optional[float]) -> int:
        if not self.e2e:
            return 0
        ok = np.ones(len(self.e2e), dtype=bool)
        ttft = np.asarray(self.ttft)
        tpot = np.asarray(self.tpot)
        if slo_ttft is not None:
            ok &= ~np.isnan(ttft) & (ttft <= slo_ttft)
        if slo_tpot is not None:
            ok &= np.isnan(tpot) | (tpot <= slo_tpot)
        return int(ok.sum())

    def backlog(self) -> tuple[list[str], np.ndarray, np.ndarray]:
        """(clients, alive[client, bin], service[client, bin]): alive = the client had a
        request in the system at some time in the bin (arrived by its end, not finished
        before its start)."""
        names = sorted(self.clients)
        b = self.bins    # flushed
        alive = np.zeros((len(names), b.max_bins), dtype=bool)
        svc = np.zeros((len(names), b.max_bins))
        for i, c in enumerate(names):
            arrived = np.cumsum(b.get(f"arrive/{c}"))
            gone_before = np.concatenate(([0.0], np.cumsum(b.get(f"finish/{c}"))[:-1]))
            alive[i] = arrived - gone_before > 0
            svc[i] = b.get(f"service/{c}")
        return names, alive, svc


__all__ = ["RecordStats", "TimeBins", "service_of", "tpot_of", "INPUT_WEIGHT", "OUTPUT_WEIGHT"]
