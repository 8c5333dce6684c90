"""Summary, terminal table and plots from RequestRecords (simulate and bench).

    summarize(records, *, duration_s=None, kv_capacity_tokens=None, kv_peak_used_tokens=None,
              prefix_hit_rate=None, slo_ttft=None, slo_tpot=None, wall_s=None, extra=None) -> dict
    write_report(out_dir, summary, records | RecordStats, timeseries=None, *, plots=True, title="",
                 timeline_window=None) -> list[Path]     summary.json and the plots (bench/plots.py)
    format_table(summary) -> str
    percentile(values, q) -> float | None

Definitions (seconds, tokens):
  completed      ok records with a finish time; failed = not ok (counted by error_kind in `failures`)
  duration_s     given, else first arrival .. last finish (or last token) over all records
  ttft           first_token - arrival
  tpot           (last token time - first token time) / (output_tokens - 1), requests with >= 2 tokens
  itl            every gap between consecutive token times, pooled over requests
  e2e            finish - arrival
  service        VTC's weighted tokens: 1 x prompt tokens + 2 x output tokens served (a
                 request's prompt counts once it got its first token)
  jain_fairness  Jain's index (sum x)^2 / (n sum x^2) over the clients' service, whole run
                 (the drain after arrivals stop included)
  jain_fairness_backlogged, service_gap_backlogged
                 the same index, and max - min service, over the time when at least two
                 clients had requests in the system (backlogged_s long)
  goodput_req_s  completed requests meeting every given SLO (ttft <= slo_ttft, tpot <= slo_tpot) per second
Percentiles are numpy's linear interpolation; None where there is no sample.

`timeseries` (optional, from the simulator): {"t": [...], "kv_used": [...],
"kv_capacity": [...], "running": [...], "waiting": [...], ...} all the same
length; plotted as KV use and running/queued over time. Without it the
in-flight count and throughput over time are derived from the records.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from shepherd.bench.records import RequestRecord
from shepherd.bench.stream import INPUT_WEIGHT, OUTPUT_WEIGHT, RecordStats, service_of, tpot_of

SUMMARY_KEYS = (
    "requests", "completed", "failed", "duration_s", "throughput_req_s", "output_tok_s", "total_tok_s",
    "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p50", "itl_p99", "e2e_p50", "e2e_p99",
    "preemptions", "kv_capacity_tokens", "kv_peak_used_tokens", "prefix_hit_rate",
    "per_client", "jain_fairness", "wall_s",
)
EXTRA_KEYS = ("goodput_req_s", "slo_attainment", "slo_ttft", "slo_tpot", "failures")



def out_folder(path) -> Path:
    """--out as a folder that can be written, made now: an existing file or /proc/x raised
    FileExistsError / FileNotFoundError at the end, after bench had sent every request.
    ValueError naming the flag otherwise."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".shepherd-write-test"
        probe.touch()
        probe.unlink()
    except OSError as e:
        why = "is a file, not a folder" if out.is_file() else f"cannot be written ({e.strerror or e})"
        raise ValueError(f"--out {path}: {why}") from None
    return out


def percentile(values: Sequence[float] | np.ndarray, q: float) -> Optional[float]:
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return None
    return float(np.percentile(a, q))


def jain(values: Iterable[float]) -> Optional[float]:
    x = np.asarray(list(values), dtype=np.float64)
    if x.size == 0:
        return None
    s2 = float((x * x).sum())
    if s2 == 0:
        return 1.0
    return float(x.sum() ** 2 / (x.size * s2))


def backlogged_fairness(stats: RecordStats) -> dict:
    """Jain's index and the service gap (max - min, weighted tokens) over the
    time when at least two clients had a request in the system, at the
    resolution of stats.bins; the whole-run jain_fairness also counts the drain
    after arrivals stop, when one client alone is served."""
    names, alive, svc = stats.backlog()
    out = {"jain_fairness_backlogged": None, "service_gap_backlogged": None, "backlogged_s": 0.0}
    if len(names) < 2:
        return out
    window = alive.sum(axis=0) >= 2
    if not window.any():
        return out
    inside = alive[:, window].any(axis=1)
    service = svc[:, window].sum(axis=1)[inside]
    out["jain_fairness_backlogged"] = jain(service)
    out["service_gap_backlogged"] = float(service.max() - service.min())
    out["backlogged_s"] = float(window.sum() * stats.bins.width)
    return out


def _per_client(stats: RecordStats, rate) -> dict:
    per_client = {}
    for name in sorted(stats.clients):
        c = stats.clients[name]
        per_client[name] = {
            "requests": c.requests, "completed": c.completed, "failed": c.failed,
            "service": c.service, "service_rate": rate(c.service),
            "input_tokens": c.input_tokens, "output_tokens": c.output_tokens,
            "output_tok_s": rate(c.output_tokens),
            "ttft_p50": percentile(c.ttft, 50), "ttft_p99": percentile(c.ttft, 99),
            "tpot_p50": percentile(c.tpot, 50), "tpot_p99": percentile(c.tpot, 99),
            "e2e_p50": percentile(c.e2e, 50), "preemptions": c.preemptions,
        }
    return per_client


def summarize(records: Sequence[RequestRecord] | RecordStats, *, duration_s: Optional[float] = None,
              kv_capacity_tokens: Optional[int] = None, kv_peak_used_tokens: Optional[int] = None,
              prefix_hit_rate: Optional[float] = None, slo_ttft: Optional[float] = None,
              slo_tpot: Optional[float] = None, wall_s: Optional[float] = None,
              extra: Optional[dict] = None) -> dict:
    """The summary of records, or of a RecordStats they were streamed into."""
    stats = records if isinstance(records, RecordStats) else stats_of(records)
    if duration_s is None:
        duration_s = stats.duration()
    dur = duration_s if duration_s and duration_s > 0 else float("nan")

    def rate(x):
        v = x / dur
        return None if math.isnan(v) else float(v)

    ttft = np.asarray(stats.ttft)
    tpot = np.asarray(stats.tpot)
    ttft, tpot = ttft[~np.isnan(ttft)], tpot[~np.isnan(tpot)]
    done = stats.completed
    good = stats.goodput_count(slo_ttft, slo_tpot)
    per_client = _per_client(stats, rate)
    summary: dict[str, Any] = {
        "requests": stats.n, "completed": done, "failed": stats.failed,
        "duration_s": float(duration_s),
        "throughput_req_s": rate(done), "output_tok_s": rate(stats.out_tok),
        "total_tok_s": rate(stats.out_tok + stats.in_tok),
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
        "itl_p50": percentile(stats.itl, 50), "itl_p99": percentile(stats.itl, 99),
        "e2e_p50": percentile(stats.e2e, 50), "e2e_p99": percentile(stats.e2e, 99),
        "preemptions": int(stats.preemptions),
        "kv_capacity_tokens": kv_capacity_tokens, "kv_peak_used_tokens": kv_peak_used_tokens,
        "prefix_hit_rate": prefix_hit_rate,
        "per_client": per_client,
        "jain_fairness": jain(v["service"] for v in per_client.values()),   # whole run, drain included
        **backlogged_fairness(stats),
        "wall_s": wall_s,
        # beyond docs/DESIGN.md's list
        "goodput_req_s": rate(good), "slo_attainment": (good / done) if done else None,
        "slo_ttft": slo_ttft, "slo_tpot": slo_tpot,
        "failures": dict(sorted(stats.failures.items())),
        "itl_samples": {"seen": stats.itl_seen, "kept": int(stats.itl.size)},
    }
    if extra:
        for k, v in extra.items():
            if k in summary and k not in ("wall_s",):
                raise ValueError(f"extra key {k!r} would overwrite a summary key")
            summary[k] = v
    return summary


def stats_of(records: Iterable[RequestRecord]) -> RecordStats:
    stats = RecordStats()
    for r in records:
        stats.add(r)
    return stats


# --------------------------------------------------------------------------
# terminal
# --------------------------------------------------------------------------

def _fmt(v, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if unit == "ms":
            return f"{v * 1e3:.1f} ms"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.3g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def _cache_rows(s: dict) -> list[tuple[str, str]]:
    """Prefix cache and routing rows (the simulator's extra keys, when present)."""
    rows = []
    if s.get("prefix_hit_rate") is not None:
        b = s.get("hit_rate_bounds") or {}
        ref = ""
        if b:
            ref = (f"   (bounds from the trace: infinite cache {_pct(b.get('infinite'))}, "
                   f"LRU with the cluster's KV {_pct(b.get('lru_cluster'))}, "
                   f"causal: answers in at their finish {_pct(b.get('lru_cluster_causal'))})")
        rows.append(("prefix hit rate", f"{_pct(s['prefix_hit_rate'])}{ref}"))
    cache = s.get("cache")
    if cache:
        rows.append(("KV cached (evictable)", f"peak {_fmt(cache.get('cached_peak_tokens'))} tokens; evicted "
                                             f"{_fmt(cache.get('evicted_tokens'))} tokens"))
    budgets = [r for r in s.get("replicas") or () if "prefill_budget_tokens" in r]
    if budgets:
        rows.append(("prefill budget beside decodes", "   ".join(
            f"r{r.get('replica')} {_fmt(r['prefill_budget_tokens'])} tokens"
            + (f" ({r['prefill_token_s'] * 1e3:.3f} ms a prompt token)" if r.get("prefill_token_s") is not None
               else " (no prefill seen)") for r in budgets)))
    bal = s.get("balance")
    if bal:
        rows.append(("load max/mean", "   ".join(f"{k} {v:.2f}" for k, v in bal.items() if v is not None)))
    rt = s.get("routing")
    if rt:
        rows.append(("routing decisions", ", ".join(f"{k}: {_fmt(v)}" for k, v in rt.items())))
    return rows


REJECT_HINTS = {"context_length": "longer than the model's context (--max-model-len)",
                "kv_capacity": "more KV than a replica holds",
                "queue_full": "raise --max-queue to queue them",
                "concurrency_full": "raise --max-concurrency to queue them"}


def _requests_rows(s: dict) -> list[tuple[str, str]]:
    """Completions, rejections (with their reasons: a simulator's `rejections`) and the
    other failures, side by side."""
    rej = s.get("rejections") or {}
    nrej = sum(v["count"] for v in rej.values())
    other = s["failed"] - nrej
    head = f"{_fmt(s['requests'])} ({_fmt(s['completed'])} completed"
    head += f", {_fmt(nrej)} rejected" if rej else ""
    head += f", {_fmt(other)} failed)" if other or not rej else ")"
    rows = [("requests", head)]
    for kind, v in rej.items():
        hint = REJECT_HINTS.get(kind)
        rows.append((f"  rejected: {kind}", f"{_fmt(v['count'])}: {v['reason']}" + (f" ({hint})" if hint else "")))
    clip = s.get("output_clipped")
    if clip and clip.get("count"):
        rows.append(("  output clipped", f"{_fmt(clip['count'])}: {clip['reason']}"))
    return rows


def _fleet_rows(s: dict) -> list[tuple[str, str]]:
    """A simulated fleet's price and energy (sim/fleet.py FleetCost.report) and its
    prefill/decode disaggregation (sim/disagg.py)."""
    rows = []
    c = s.get("cost")
    if c:
        groups = ", ".join(g["group"] for g in c["groups"])
        if c.get("dollars_per_hour") is not None:
            good = (f"; {_fmt(c['good_requests_per_dollar'])} requests within the SLOs per $"
                    if c.get("good_requests_per_dollar") is not None else "")
            rows.append(("cost", f"${_fmt(c['dollars_per_hour'])}/h for {c['gpus']} GPU(s) ({groups}); "
                                 f"${_fmt(c['dollars_per_million_output_tokens'])} per M output tokens{good}"))
        else:
            rows.append(("cost", f"no $/hour known for {groups}: give --gpu-price GPU=$"))
        if c.get("energy_kwh") is not None:
            rows.append(("energy", f"{_fmt(c['energy_kwh'])} kWh busy at board power; "
                                   f"{_fmt(c['joules_per_output_token'])} J per output token"))
    d = s.get("disaggregation")
    if d:
        mean = d.get("transfer_s_mean")
        rows.append(("P/D", f"{_fmt(d['disaggregated'])} prefilled on prefill replicas, "
                            f"{_fmt(d['prefilled_locally'])} where they decode (threshold {d['threshold']} tokens); "
                            f"KV transfer mean {_fmt(mean, 'ms') if mean is not None else '-'}"))
    return rows


def format_table(summary: dict) -> str:
    s = summary
    rows = [
        *_requests_rows(s),
        ("duration", f"{_fmt(s['duration_s'])} s" + (f"   (wall {_fmt(s['wall_s'])} s)" if s.get("wall_s") else "")),
        ("throughput", f"{_fmt(s['throughput_req_s'])} req/s   {_fmt(s['output_tok_s'])} out tok/s   "
                       f"{_fmt(s['total_tok_s'])} total tok/s"),
        ("TTFT p50 / p99", f"{_fmt(s['ttft_p50'], 'ms')} / {_fmt(s['ttft_p99'], 'ms')}"),
        ("TPOT p50 / p99", f"{_fmt(s['tpot_p50'], 'ms')} / {_fmt(s['tpot_p99'], 'ms')}"),
        ("ITL  p50 / p99", f"{_fmt(s['itl_p50'], 'ms')} / {_fmt(s['itl_p99'], 'ms')}"),
        ("E2E  p50 / p99", f"{_fmt(s['e2e_p50'], 'ms')} / {_fmt(s['e2e_p99'], 'ms')}"),
        ("preemptions", _fmt(s["preemptions"])),
    ]
    if s.get("kv_capacity_tokens") is not None:
        peak = s.get("kv_peak_used_tokens")
        frac = f" ({peak / s['kv_capacity_tokens']:.0%})" if peak is not None and s["kv_capacity_tokens"] else ""
        rows.append(("KV peak / capacity", f"{_fmt(peak)} / {_fmt(s['kv_capacity_tokens'])} tokens{frac}"))
    rows += _cache_rows(s)
    if s.get("slo_ttft") is not None or s.get("slo_tpot") is not None:
        rows.append(("goodput", f"{_fmt(s['goodput_req_s'])} req/s  ({_fmt(s['slo_attainment'])} of completed "
                                f"within TTFT<={s.get('slo_ttft')} s, TPOT<={s.get('slo_tpot')} s)"))
    rows += _fleet_rows(s)
    rej = s.get("rejections") or {}
    other = {k: v for k, v in (s.get("failures") or {}).items() if k not in rej}
    if other:
        rows.append(("failures", ", ".join(f"{k}: {v}" for k, v in other.items())))
    cr = (s.get("sim") or {}).get("cost_model_range")
    if cr and cr.get("steps_beyond"):
        lo, hi = cr["profiled_tokens"]
        floor = (f"; {_fmt(cr['steps_at_roofline_floor'])} of them at the roofline floor"
                 if cr.get("floor") == "roofline" else "; no roofline floor known: extrapolated, never downwards")
        rows.append(("cost model range", f"{_fmt(cr['steps_beyond'])} steps beyond the profiled {_fmt(hi)} tokens"
                                         f"{floor}"))
    pc = s.get("per_client") or {}
    if len(pc) > 1:
        rows.append(("Jain fairness", f"{_fmt(s.get('jain_fairness_backlogged'))} while >= 2 clients backlogged "
                                      f"({_fmt(s.get('backlogged_s'))} s, service gap "
                                      f"{_fmt(s.get('service_gap_backlogged'))}); "
                                      f"{_fmt(s.get('jain_fairness'))} whole run"))
    w = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(w)}  {v}" for k, v in rows]
    if len(pc) > 1:
        lines.append("")
        lines.append(f"{'client':<16} {'reqs':>6} {'done':>6} {'service':>12} {'TTFT p50':>10} {'TPOT p50':>10}")
        top = sorted(pc.items(), key=lambda kv: -kv[1]["service"])
        for c, v in top[:12]:
            lines.append(f"{c[:16]:<16} {v['requests']:>6} {v['completed']:>6} {v['service']:>12,.0f} "
                         f"{_fmt(v['ttft_p50'], 'ms'):>10} {_fmt(v['tpot_p50'], 'ms'):>10}")
        if len(top) > 12:
            lines.append(f"... {len(top) - 12} more clients")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# files and plots
# --------------------------------------------------------------------------

def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _clean(o):
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def write_summary(out_dir, summary: dict) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    p = out / "summary.json"
    p.write_text(json.dumps(_clean(summary), indent=1, default=_json_default))
    return p


def write_report(out_dir, summary: dict, records: Sequence[RequestRecord] | RecordStats,
                 timeseries: Optional[dict] = None, *, plots: bool = True, title: str = "",
                 timeline_window: Optional[tuple[float, float]] = None) -> list[Path]:
    """summary.json, and unless plots=False the plots of bench/plots.py. `title`
    goes into every plot's title (say the router, replicas and model there)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [write_summary(out, summary)]
    stats = records if isinstance(records, RecordStats) else stats_of(records)
    if not plots or not stats.n:
        return paths
    from shepherd.bench.plots import write_plots
    return paths + write_plots(out, stats, timeseries, title=title, timeline_window=timeline_window)


__all__ = ["SUMMARY_KEYS", "EXTRA_KEYS", "summarize", "stats_of", "format_table", "write_report", "write_summary",
           "percentile", "jain", "service_of", "backlogged_fairness"]
