"""Plots of a run (simulate and bench), from RecordStats and the simulator's time series.

    write_plots(out_dir, stats, timeseries=None, *, title="", timeline_window=None) -> list[Path]
        timeline.png        sampled Gantt: one row per sampled request, labelled with its id
        kv.png              KV used / cached (evictable) / free, stacked; running and queued (simulator)
        throughput.png      output tok/s and requests in flight over time
        latency_cdf.png     TTFT, TPOT, ITL, E2E
        client_service.png  cumulative service per client (more than one client)
        replicas.png        per replica: KV used and cached over its capacity; running and queued (simulator)
        prefix_time.png     prefix hit rate by arrival time against both bounds (simulator, with the bounds)
    draw_timeline(ax, records, ...)   the Gantt rows on an axis (benchmarks reuse it)

`title` names the run (router, replicas, model) and heads every plot.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from shepherd.bench.records import RequestRecord
from shepherd.bench.stream import RecordStats

STATE_COLORS = {"queued": "#bbbbbb", "prefill": "#ff7f0e", "decode": "#1f77b4", "preempted": "#d62728",
                "swapped": "#9467bd", "transfer": "#2ca02c"}    # transfer: KV between a prefill and a decode replica


def intervals_of(r: RequestRecord) -> list[tuple[str, float, float]]:
    """The record's state intervals; where the server side is unknown (no interval
    past the client-side queue), prefill = queue end (or arrival) .. first token and
    decode = first token .. finish."""
    ivs = list(r.intervals)
    if any(st != "queued" for st, _, _ in ivs):
        return ivs
    start = max([r.arrival] + [b for _, _, b in ivs])
    if r.first_token is not None:
        ivs.append(("prefill", start, max(start, r.first_token)))   # unknown split of queue and prefill
        if r.finish is not None:
            ivs.append(("decode", r.first_token, r.finish))
    elif r.finish is not None and not ivs:
        ivs.append(("queued", r.arrival, r.finish))
    return ivs


def draw_timeline(ax, records: Sequence[RequestRecord], *, legend: bool = True, label_ids: bool = True) -> None:
    """One row per request (top = first), coloured by state; rows labelled with request ids."""
    from matplotlib.collections import LineCollection
    from matplotlib.lines import Line2D
    segs: dict[str, list] = defaultdict(list)
    for y, r in enumerate(records):
        for st, a, b in intervals_of(r):
            segs[st].append([(a, y), (max(b, a + 1e-9), y)])
    lw = max(0.6, min(6.0, 300.0 / max(len(records), 1)))
    handles = []
    for st, color in STATE_COLORS.items():
        if segs.get(st):
            ax.add_collection(LineCollection(segs[st], colors=color, linewidths=lw))
            handles.append(Line2D([0], [0], color=color, lw=4, label=st))
    ax.autoscale()
    ax.set_xlabel("time (s)")
    ax.set_ylabel("request id")
    if label_ids and records:
        every = max(1, len(records) // 40)
        ys = list(range(0, len(records), every))
        ax.set_yticks(ys)
        ax.set_yticklabels([records[y].req_id for y in ys], fontsize=6)
    ax.invert_yaxis()
    if handles and legend:
        ax.legend(handles=handles, loc="upper right", fontsize=8)


def _head(title: str, what: str) -> str:
    return f"{title}\n{what}" if title else what


def _save(fig, path: Path, paths: list) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    paths.append(path)


def _timeline(plt, out: Path, stats: RecordStats, title: str, window, paths: list) -> None:
    """All requests when they fit; else a Gantt of a contiguous window (the last
    requests to end) above a density view of the whole run (uniform sample)."""
    whole = len(stats.sample) >= stats.n
    sel = sorted(stats.sample if whole or window is not None else stats.recent, key=lambda r: r.arrival)
    if window is not None:
        sel = [r for r in sel if window[0] <= r.arrival < window[1]]
    if not sel:
        return
    rows = 2 if not whole else 1
    fig, axs = plt.subplots(rows, 1, figsize=(11, max(4.0, min(14.0, 3 + len(sel) * 0.04)) + 3 * (rows - 1)),
                            gridspec_kw={"height_ratios": [3, 1][:rows]}, squeeze=False)
    draw_timeline(axs[0, 0], sel)
    what = (f"request timeline: all {stats.n:,} requests" if whole else
            f"request timeline: the last {len(sel)} of {stats.n:,} requests to end")
    if window is not None:
        what = f"request timeline: arrivals in [{window[0]:g}, {window[1]:g}) s"
    axs[0, 0].set_title(_head(title, what), fontsize=10)
    if rows == 2:
        _density(axs[1, 0], stats)
    _save(fig, out / "timeline.png", paths)
    plt.close(fig)


def _density(ax, stats: RecordStats) -> None:
    done = [r for r in stats.sample if r.finish is not None]
    if not done:
        return
    x = np.array([r.arrival for r in done])
    y = np.array([max(r.finish - r.arrival, 1e-6) for r in done])
    log = y.max() / y.min() > 10
    ax.hexbin(x, y, gridsize=(60, 12), yscale="log" if log else "linear", cmap="Blues", mincnt=1)
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("E2E latency (s)")
    ax.set_title(f"whole run: E2E latency by arrival time ({len(done)} sampled requests)", fontsize=9)


def _kv(plt, out: Path, ts: dict, title: str, paths: list) -> None:
    t = np.asarray(ts["t"])
    cap = np.asarray(ts["kv_capacity"], dtype=float)
    used = np.asarray(ts["kv_used"], dtype=float)
    cached = np.asarray(ts.get("kv_cached", np.zeros_like(used)), dtype=float)
    free = np.maximum(cap - used - cached, 0)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    a1.stackplot(t, used, cached, free, labels=["used by requests", "cached (evictable)", "free"],
                 colors=["#1f77b4", "#2ca02c", "#eeeeee"], step="post")
    a1.set_ylabel("KV tokens (all replicas)")
    a1.legend(fontsize=8, loc="upper right")
    for k in ("running", "waiting", "swapped"):
        if k in ts:
            a2.plot(t, ts[k], label=k, lw=1, drawstyle="steps-post")
    a2.set_ylabel("requests")
    a2.set_xlabel("time (s)")
    a2.legend(fontsize=8)
    a1.set_title(_head(title, "KV cache: used / cached / free; running and queued requests"), fontsize=10)
    _save(fig, out / "kv.png", paths)
    plt.close(fig)


def _throughput(plt, out: Path, stats: RecordStats, title: str, paths: list) -> None:
    b = stats.bins
    b.flush()
    edges = b.edges()
    end = max(stats.end, stats.start + 1e-6)
    nb = min(b.max_bins, int(end / b.width) + 1)
    mids = (edges[:-1] + edges[1:])[:nb] / 2
    tok = b.get("tokens")[:nb] / b.width
    inflight = (np.cumsum(b.get("arrivals")) - np.cumsum(b.get("finishes")))[:nb]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(11, 5), sharex=True)
    a1.plot(mids, tok, lw=1)
    a1.set_ylabel("output tok/s")
    a2.plot(mids, inflight, lw=1, color="C2")
    a2.set_ylabel("requests in flight")
    a2.set_xlabel("time (s)")
    a1.set_title(_head(title, f"throughput and requests in flight ({b.width:g} s bins)"), fontsize=10)
    _save(fig, out / "throughput.png", paths)
    plt.close(fig)


def _latency(plt, out: Path, stats: RecordStats, title: str, paths: list) -> None:
    series = {"TTFT": stats.ttft, "TPOT": stats.tpot, "ITL": stats.itl, "E2E": stats.e2e}
    fig, axs = plt.subplots(1, 4, figsize=(14, 3.6))
    for ax, (name, vals) in zip(axs, series.items()):
        v = np.sort(np.asarray(vals, dtype=np.float64))
        v = v[~np.isnan(v)]
        if v.size:
            ax.plot(v, np.arange(1, v.size + 1) / v.size, lw=1.2)
            if v.min() > 0:          # latencies span decades under load: always a log axis
                ax.set_xscale("log")
        ax.set_title(name)
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of token gaps")
        ax.grid(alpha=0.3)
    fig.suptitle(_head(title, "latency CDFs"), fontsize=10)
    _save(fig, out / "latency_cdf.png", paths)
    plt.close(fig)


def _latency_over_time(plt, out: Path, stats: RecordStats, title: str, paths: list) -> None:
    fig, axs = plt.subplots(1, 2, figsize=(14, 3.8), sharex=True)
    for ax, name in zip(axs, ("ttft", "tpot")):
        t, qs = stats.percentiles_over_time(name)
        for q, style in zip(qs, ("-", "--", ":")):
            ax.plot(t, qs[q], style, lw=1.2, label=f"p{q}")
        ax.set_yscale("log")
        ax.set_title(f"{name.upper()} by arrival time")
        ax.set_xlabel("arrival time (s)")
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(_head(title, "latency percentiles over time (to within 25%)"), fontsize=10)
    _save(fig, out / "latency_time.png", paths)
    plt.close(fig)


def _client_service(plt, out: Path, stats: RecordStats, title: str, paths: list) -> None:
    shown = sorted(stats.clients, key=lambda c: -stats.clients[c].service)[:10]
    b = stats.bins
    b.flush()
    end = max(stats.end, stats.start + 1e-6)
    nb = min(b.max_bins, int(end / b.width) + 1)
    x = b.edges()[1:nb + 1]
    fig, ax = plt.subplots(figsize=(11, 4))
    for c in shown:
        ax.plot(x, np.cumsum(b.get(f"service/{c}"))[:nb], lw=1.2, label=c)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("cumulative service (in + 2 x out tokens)")
    ax.set_title(_head(title, "per-client service" + (f" (top 10 of {len(stats.clients)})"
                                                     if len(stats.clients) > 10 else "")), fontsize=10)
    ax.legend(fontsize=8)
    _save(fig, out / "client_service.png", paths)
    plt.close(fig)


MAX_REPLICA_LINES = 16


def replicas_figure(plt, ts: dict, title: str = ""):
    """Each replica's KV (used by requests, and with the cached tokens, over its own capacity)
    and its running and queued requests over time; the first MAX_REPLICA_LINES replicas."""
    t = np.asarray(ts["t"])
    ids = ts["replica_ids"][:MAX_REPLICA_LINES]
    n = len(ids)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    colors = plt.get_cmap("tab20" if n > 10 else "tab10")
    for i, rid in enumerate(ids):
        cap = max(1.0, float(ts["replica_kv_capacity"][i]))
        used = np.asarray(ts["replica_kv_used"][i]) / cap
        held = used + np.asarray(ts["replica_kv_cached"][i]) / cap
        c = colors(i % colors.N)
        a1.plot(t, used, color=c, lw=1, drawstyle="steps-post", label=f"replica {rid}")
        a1.plot(t, held, color=c, lw=0.7, ls=":", drawstyle="steps-post")
        a2.plot(t, ts["replica_running"][i], color=c, lw=1, drawstyle="steps-post", label=f"replica {rid} running")
        a2.plot(t, ts["replica_waiting"][i], color=c, lw=0.8, ls="--", drawstyle="steps-post",
                label=f"replica {rid} queued")
    a1.set_ylabel("KV / capacity")
    a1.set_ylim(0, 1.05)
    a1.legend(fontsize=7, ncol=4, loc="upper right")
    a2.set_ylabel("requests (solid running, dashed queued)")
    a2.set_xlabel("time (s)")
    more = len(ts["replica_ids"]) - n
    a1.set_title(_head(title, "per replica: KV used by requests (solid) and with cached prefixes (dotted)"
                       + (f"; first {n} of {n + more} replicas" if more > 0 else "")), fontsize=10)
    return fig


PREFIX_BINS = 64
PREFIX_KEYS = ("prefix_hit_infinite", "prefix_hit_lru_cluster", "prefix_hit")


def prefix_rates(ts: dict, max_bins: int = PREFIX_BINS) -> tuple[np.ndarray, np.ndarray, dict]:
    """(edges, tokens asked, {key: hit rate}) of the arrival-time bins, adjacent bins merged
    (their tokens summed) so that there are at most `max_bins`: the simulator's bins are fine
    enough for a day, and a bin of a few requests is all or nothing. Bins where nothing was
    asked are left out of the rates (NaN)."""
    edges = np.asarray(ts["prefix_edges"], dtype=float)
    q = np.asarray(ts["prefix_query"], dtype=float)
    k = max(1, -(-len(q) // max_bins))
    pad = (-len(q)) % k

    def merged(a):
        return np.concatenate([np.asarray(a, dtype=float), np.zeros(pad)]).reshape(-1, k).sum(axis=1)
    qm = merged(q)
    width = edges[1] - edges[0]
    e = edges[0] + np.arange(len(qm) + 1) * width * k
    with np.errstate(invalid="ignore", divide="ignore"):
        rates = {key: np.where(qm > 0, merged(ts[key]) / np.where(qm > 0, qm, 1), np.nan) for key in PREFIX_KEYS}
    return e, qm, rates


def prefix_figure(plt, ts: dict, title: str = ""):
    """Prefix hit rate of the requests arriving in each time bin: achieved, and the two bounds
    (one cache that never forgets; one LRU cache of the whole cluster's KV)."""
    edges, q, rates = prefix_rates(ts)
    mid = (edges[:-1] + edges[1:]) / 2
    ok = q > 0
    fig, ax = plt.subplots(figsize=(11, 3.8))
    for key, label, style in zip(PREFIX_KEYS, ("bound: infinite cache", "bound: cluster-wide LRU", "achieved"),
                                 (":", "--", "-")):
        ax.plot(mid[ok], rates[key][ok], style, lw=1.3, marker="." if ok.sum() < 40 else None, label=label)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("prefix hit rate (tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(_head(title, f"prefix hit rate by arrival time, bins of {edges[1] - edges[0]:.3g} s"), fontsize=10)
    return fig


def write_plots(out_dir, stats: RecordStats, timeseries: Optional[dict] = None, *, title: str = "",
                timeline_window: Optional[tuple[float, float]] = None) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = Path(out_dir)
    paths: list[Path] = []
    _timeline(plt, out, stats, title, timeline_window, paths)
    if timeseries and len(timeseries.get("t", ())) > 1:
        _kv(plt, out, timeseries, title, paths)
        if timeseries.get("replica_ids"):
            fig = replicas_figure(plt, timeseries, title)
            _save(fig, out / "replicas.png", paths)
            plt.close(fig)
    if timeseries and timeseries.get("prefix_query"):
        fig = prefix_figure(plt, timeseries, title)
        _save(fig, out / "prefix_time.png", paths)
        plt.close(fig)
    _throughput(plt, out, stats, title, paths)
    _latency(plt, out, stats, title, paths)
    if stats.completed:
        _latency_over_time(plt, out, stats, title, paths)
    if len(stats.clients) > 1:
        _client_service(plt, out, stats, title, paths)
    return paths


__all__ = ["write_plots", "draw_timeline", "intervals_of", "STATE_COLORS", "replicas_figure", "prefix_figure", "prefix_rates"]
