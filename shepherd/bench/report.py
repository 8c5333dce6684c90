"""Summary, terminal table and plots from RequestRecords (simulate and bench).

    summarize(records, *, duration_s=None, kv_capacity_tokens=None, kv_peak_used_tokens=None,
              prefix_hit_rate=None, slo_ttft=None, slo_tpot=None, wall_s=None, extra=None) -> dict
    write_report(out_dir, summary, records, timeseries=None, *, plots=True, max_timeline_rows=400,
                 title="", timeline_window=None) -> list[Path]
    draw_timeline(ax, records, ...)      one row per request, queued/prefill/decode/preempted colours
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
  jain_fairness  Jain's index (sum x)^2 / (n sum x^2) over the clients' service
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
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from shepherd.bench.records import RequestRecord

SUMMARY_KEYS = (
    "requests", "completed", "failed", "duration_s", "throughput_req_s", "output_tok_s", "total_tok_s",
    "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p50", "itl_p99", "e2e_p50", "e2e_p99",
    "preemptions", "kv_capacity_tokens", "kv_peak_used_tokens", "prefix_hit_rate",
    "per_client", "jain_fairness", "wall_s",
)
EXTRA_KEYS = ("goodput_req_s", "slo_attainment", "slo_ttft", "slo_tpot", "failures")

INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


def percentile(values: Sequence[float] | np.ndarray, q: float) -> Optional[float]:
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return None
    return float(np.percentile(a, q))


def _tpot(r: RequestRecord) -> Optional[float]:
    if r.output_tokens < 2 or r.first_token is None:
        return None
    last = r.token_times[-1] if r.token_times else r.finish
    if last is None:
        return None
    n = len(r.token_times) if r.token_times else r.output_tokens
    if n < 2:
        return None
    return (last - r.first_token) / (n - 1)


def jain(values: Iterable[float]) -> Optional[float]:
    x = np.asarray(list(values), dtype=np.float64)
    if x.size == 0:
        return None
    s2 = float((x * x).sum())
    if s2 == 0:
        return 1.0
    return float(x.sum() ** 2 / (x.size * s2))


def service_of(r: RequestRecord, input_weight: float = INPUT_WEIGHT, output_weight: float = OUTPUT_WEIGHT) -> float:
    served_out = len(r.token_times) if r.token_times else (r.output_tokens if r.first_token is not None else 0)
    served_in = r.prompt_tokens if r.first_token is not None else 0
    return input_weight * served_in + output_weight * served_out


def summarize(records: Sequence[RequestRecord], *, duration_s: Optional[float] = None,
              kv_capacity_tokens: Optional[int] = None, kv_peak_used_tokens: Optional[int] = None,
              prefix_hit_rate: Optional[float] = None, slo_ttft: Optional[float] = None,
              slo_tpot: Optional[float] = None, wall_s: Optional[float] = None,
              extra: Optional[dict] = None) -> dict:
    recs = list(records)
    done = [r for r in recs if r.ok and r.finish is not None]
    failed = [r for r in recs if not r.ok]
    if duration_s is None:
        if recs:
            start = min(r.arrival for r in recs)
            ends = [r.finish for r in recs if r.finish is not None] + \
                   [r.token_times[-1] for r in recs if r.token_times]
            end = max(ends) if ends else start
            duration_s = max(end - start, 0.0)
        else:
            duration_s = 0.0
    dur = duration_s if duration_s and duration_s > 0 else float("nan")

    ttft = np.array([r.ttft for r in done if r.first_token is not None], dtype=np.float64)
    tpot = np.array([t for t in (_tpot(r) for r in done) if t is not None], dtype=np.float64)
    e2e = np.array([r.e2e for r in done], dtype=np.float64)
    gaps = [np.diff(np.asarray(r.token_times, dtype=np.float64)) for r in done if len(r.token_times) > 1]
    itl = np.concatenate(gaps) if gaps else np.zeros(0)

    out_tok = sum(r.output_tokens for r in done)
    in_tok = sum(r.prompt_tokens for r in done)

    def rate(x):
        v = x / dur
        return None if math.isnan(v) else float(v)

    # goodput
    good = 0
    for r in done:
        ok = True
        if slo_ttft is not None and (r.ttft is None or r.ttft > slo_ttft):
            ok = False
        if ok and slo_tpot is not None:
            tp = _tpot(r)
            if tp is not None and tp > slo_tpot:
                ok = False
        good += ok

    failures: dict[str, int] = defaultdict(int)
    for r in failed:
        failures[r.error_kind or "error"] += 1

    # per client
    by_client: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in recs:
        by_client[r.client].append(r)
    per_client = {}
    for c in sorted(by_client):
        rs = by_client[c]
        cd = [r for r in rs if r.ok and r.finish is not None]
        c_ttft = [r.ttft for r in cd if r.first_token is not None]
        c_tpot = [t for t in (_tpot(r) for r in cd) if t is not None]
        svc = sum(service_of(r) for r in rs)
        per_client[c] = {
            "requests": len(rs), "completed": len(cd), "failed": sum(1 for r in rs if not r.ok),
            "service": svc, "service_rate": rate(svc),
            "input_tokens": sum(r.prompt_tokens for r in cd), "output_tokens": sum(r.output_tokens for r in cd),
            "output_tok_s": rate(sum(r.output_tokens for r in cd)),
            "ttft_p50": percentile(c_ttft, 50), "ttft_p99": percentile(c_ttft, 99),
            "tpot_p50": percentile(c_tpot, 50), "tpot_p99": percentile(c_tpot, 99),
            "e2e_p50": percentile([r.e2e for r in cd], 50),
            "preemptions": sum(r.preemptions for r in rs),
        }

    summary: dict[str, Any] = {
        "requests": len(recs),
        "completed": len(done),
        "failed": len(failed),
        "duration_s": float(duration_s),
        "throughput_req_s": rate(len(done)),
        "output_tok_s": rate(out_tok),
        "total_tok_s": rate(out_tok + in_tok),
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
        "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
        "e2e_p50": percentile(e2e, 50), "e2e_p99": percentile(e2e, 99),
        "preemptions": int(sum(r.preemptions for r in recs)),
        "kv_capacity_tokens": kv_capacity_tokens,
        "kv_peak_used_tokens": kv_peak_used_tokens,
        "prefix_hit_rate": prefix_hit_rate,
        "per_client": per_client,
        "jain_fairness": jain(v["service"] for v in per_client.values()),
        "wall_s": wall_s,
        # beyond DESIGN.md's list
        "goodput_req_s": rate(good),
        "slo_attainment": (good / len(done)) if done else None,
        "slo_ttft": slo_ttft,
        "slo_tpot": slo_tpot,
        "failures": dict(sorted(failures.items())),
    }
    if extra:
        for k, v in extra.items():
            if k in summary and k not in ("wall_s",):
                raise ValueError(f"extra key {k!r} would overwrite a summary key")
            summary[k] = v
    return summary


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


def format_table(summary: dict) -> str:
    s = summary
    rows = [
        ("requests", f"{_fmt(s['requests'])} ({_fmt(s['completed'])} completed, {_fmt(s['failed'])} failed)"),
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
    if s.get("prefix_hit_rate") is not None:
        rows.append(("prefix hit rate", f"{s['prefix_hit_rate']:.1%}"))
    if s.get("slo_ttft") is not None or s.get("slo_tpot") is not None:
        rows.append(("goodput", f"{_fmt(s['goodput_req_s'])} req/s  ({_fmt(s['slo_attainment'])} of completed "
                                f"within TTFT<={s.get('slo_ttft')} s, TPOT<={s.get('slo_tpot')} s)"))
    if s.get("failures"):
        rows.append(("failures", ", ".join(f"{k}: {v}" for k, v in s["failures"].items())))
    pc = s.get("per_client") or {}
    if len(pc) > 1:
        rows.append(("Jain fairness", _fmt(s.get("jain_fairness"))))
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


STATE_COLORS = {"queued": "#bbbbbb", "prefill": "#ff7f0e", "decode": "#1f77b4", "preempted": "#d62728",
                "swapped": "#9467bd"}


def _intervals(r: RequestRecord):
    if r.intervals:
        return r.intervals
    ivs = []
    if r.first_token is not None:
        ivs.append(("prefill", r.arrival, r.first_token))   # unknown split of queue and prefill
        if r.finish is not None:
            ivs.append(("decode", r.first_token, r.finish))
    elif r.finish is not None:
        ivs.append(("queued", r.arrival, r.finish))
    return ivs


def draw_timeline(ax, records: Sequence[RequestRecord], *, subsampled: bool = False, every: float = 1.0,
                  legend: bool = True) -> None:
    """One row per request (top = first), coloured by state: queued, prefill,
    decode, preempted (from RequestRecord.intervals, or arrival/first token/finish)."""
    from matplotlib.collections import LineCollection
    from matplotlib.lines import Line2D
    segs: dict[str, list] = defaultdict(list)
    for y, r in enumerate(records):
        for st, a, b in _intervals(r):
            segs[st].append([(a, y), (max(b, a + 1e-9), y)])
    lw = max(0.6, min(6.0, 300.0 / max(len(records), 1)))
    handles = []
    for st, color in STATE_COLORS.items():
        if segs.get(st):
            ax.add_collection(LineCollection(segs[st], colors=color, linewidths=lw))
            handles.append(Line2D([0], [0], color=color, lw=4, label=st))
    ax.autoscale()
    ax.set_xlabel("time (s)")
    ax.set_ylabel("request" + (f" (every {every:.0f}th)" if subsampled else ""))
    ax.invert_yaxis()
    if handles and legend:
        ax.legend(handles=handles, loc="upper right", fontsize=8)


def write_report(out_dir, summary: dict, records: Sequence[RequestRecord], timeseries: Optional[dict] = None,
                 *, plots: bool = True, max_timeline_rows: int = 400, title: str = "",
                 timeline_window: Optional[tuple[float, float]] = None) -> list[Path]:
    """summary.json, and unless plots=False: timeline.png, kv.png (when timeseries),
    throughput.png, latency_cdf.png, client_service.png (more than one client)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [write_summary(out, summary)]
    if not plots or not records:
        return paths
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = list(records)

    # -- request timeline ---------------------------------------------------
    sel = recs
    if timeline_window is not None:
        lo, hi = timeline_window
        sel = [r for r in recs if lo <= r.arrival < hi]
    if len(sel) > max_timeline_rows:
        step = len(sel) / max_timeline_rows
        sel = [sel[int(i * step)] for i in range(max_timeline_rows)]
    fig, ax = plt.subplots(figsize=(11, max(3.0, min(12.0, 2 + len(sel) * 0.025))))
    draw_timeline(ax, sel, subsampled=len(sel) < len(recs) and timeline_window is None,
                  every=len(recs) / max(1, len(sel)))
    ax.set_title((title + ": " if title else "") + "request timeline"
                 + (f" (arrivals in [{timeline_window[0]:g}, {timeline_window[1]:g}) s)" if timeline_window else ""))
    fig.tight_layout()
    p = out / "timeline.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    # -- KV and running/queued over time (simulator) ---------------------------
    if timeseries and len(timeseries.get("t", ())) > 1:
        t = np.asarray(timeseries["t"])
        fig, (a1, a2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
        for k in ("kv_used", "kv_capacity"):
            if k in timeseries:
                a1.plot(t, timeseries[k], label=k, lw=1, drawstyle="steps-post",
                        ls="--" if k == "kv_capacity" else "-")
        a1.set_ylabel("KV tokens")
        a1.legend(fontsize=8)
        for k in ("running", "waiting", "swapped"):
            if k in timeseries:
                a2.plot(t, timeseries[k], label=k, lw=1, drawstyle="steps-post")
        a2.set_ylabel("requests")
        a2.set_xlabel("time (s)")
        a2.legend(fontsize=8)
        a1.set_title((title + ": " if title else "") + "KV use and running/queued")
        fig.tight_layout()
        p = out / "kv.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)

    # -- throughput and in-flight over time (from records) ----------------------
    t0 = min(r.arrival for r in recs)
    ends = [r.finish for r in recs if r.finish is not None] or [t0 + 1]
    t1 = max(ends)
    nb = 200
    edges = np.linspace(t0, max(t1, t0 + 1e-6), nb + 1)
    tok = np.concatenate([np.asarray(r.token_times) for r in recs if r.token_times]) if any(
        r.token_times for r in recs) else np.zeros(0)
    hist, _ = np.histogram(tok, bins=edges)
    width = edges[1] - edges[0]
    arr = np.array([r.arrival for r in recs])
    fin = np.array([r.finish if r.finish is not None else t1 for r in recs])
    mids = (edges[:-1] + edges[1:]) / 2
    inflight = np.searchsorted(np.sort(arr), mids, side="right") - np.searchsorted(np.sort(fin), mids, side="right")
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(11, 5), sharex=True)
    a1.plot(mids, hist / width, lw=1)
    a1.set_ylabel("output tok/s")
    a2.plot(mids, inflight, lw=1, color="C2")
    a2.set_ylabel("in flight")
    a2.set_xlabel("time (s)")
    a1.set_title((title + ": " if title else "") + "throughput and requests in flight")
    fig.tight_layout()
    p = out / "throughput.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    # -- latency CDFs ----------------------------------------------------------
    done = [r for r in recs if r.ok and r.finish is not None]
    series = {
        "TTFT": [r.ttft for r in done if r.first_token is not None],
        "TPOT": [t for t in (_tpot(r) for r in done) if t is not None],
        "ITL": np.concatenate([np.diff(r.token_times) for r in done if len(r.token_times) > 1])
        if any(len(r.token_times) > 1 for r in done) else [],
        "E2E": [r.e2e for r in done],
    }
    fig, axs = plt.subplots(1, 4, figsize=(14, 3.4))
    for ax, (name, vals) in zip(axs, series.items()):
        v = np.sort(np.asarray(vals, dtype=np.float64))
        if v.size:
            ax.plot(v, np.arange(1, v.size + 1) / v.size, lw=1.2)
            if v.min() > 0 and v.max() / v.min() > 50:
                ax.set_xscale("log")
        ax.set_title(name)
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
    axs[0].set_ylabel("CDF")
    fig.tight_layout()
    p = out / "latency_cdf.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    # -- per-client service over time ---------------------------------------------
    clients = sorted({r.client for r in recs})
    if len(clients) > 1:
        totals = {c: 0.0 for c in clients}
        for r in recs:
            totals[r.client] += service_of(r)
        shown = sorted(clients, key=lambda c: -totals[c])[:10]
        fig, ax = plt.subplots(figsize=(11, 4))
        for c in shown:
            ev_t, ev_w = [], []
            for r in recs:
                if r.client != c:
                    continue
                if r.first_token is not None:
                    ev_t.append(r.first_token)
                    ev_w.append(INPUT_WEIGHT * r.prompt_tokens)
                ev_t.extend(r.token_times)
                ev_w.extend([OUTPUT_WEIGHT] * len(r.token_times))
            if not ev_t:
                continue
            o = np.argsort(ev_t, kind="stable")
            ax.plot(np.asarray(ev_t)[o], np.cumsum(np.asarray(ev_w)[o]), lw=1.2, label=c)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("cumulative service (in + 2 x out tokens)")
        ax.set_title((title + ": " if title else "") + "per-client service")
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out / "client_service.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


__all__ = ["SUMMARY_KEYS", "EXTRA_KEYS", "summarize", "format_table", "write_report", "write_summary", "draw_timeline",
           "percentile", "jain", "service_of"]
