"""summary.json keys and percentiles on hand-made records (bench/report.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from shepherd.bench.records import RequestRecord
from shepherd.bench.report import SUMMARY_KEYS, format_table, summarize, write_report


def rec(i, client, arrival, times, prompt=10, ok=True, kind=None, preempt=0):
    return RequestRecord(req_id=f"r{i}", client=client, arrival=arrival, prompt_tokens=prompt,
                         output_tokens=len(times), first_token=times[0] if times else None,
                         token_times=list(times), finish=times[-1] if times else None, ok=ok,
                         error_kind=kind, preemptions=preempt,
                         intervals=[("queued", arrival, arrival + 0.1), ("prefill", arrival + 0.1, times[0]),
                                    ("decode", times[0], times[-1])] if times else [])


def records():
    return [
        rec(0, "a", 0.0, [1.0, 1.5, 2.0]),          # ttft 1, tpot .5, e2e 2
        rec(1, "a", 1.0, [1.5, 2.5]),               # ttft .5, tpot 1, e2e 1.5
        rec(2, "b", 2.0, [4.0, 4.2, 4.4, 4.6, 4.8], preempt=2),  # ttft 2, tpot .2, e2e 2.8
        rec(3, "b", 3.0, [], ok=False, kind="http_500"),
        rec(4, "b", 3.5, [], ok=False, kind="timeout"),
    ]


def test_keys_and_values():
    s = summarize(records(), kv_capacity_tokens=1000, kv_peak_used_tokens=400, prefix_hit_rate=0.25, wall_s=1.5)
    for k in SUMMARY_KEYS:
        assert k in s, k
    assert s["requests"] == 5 and s["completed"] == 3 and s["failed"] == 2
    assert s["duration_s"] == pytest.approx(4.8)
    assert s["throughput_req_s"] == pytest.approx(3 / 4.8)
    assert s["output_tok_s"] == pytest.approx(10 / 4.8)
    assert s["total_tok_s"] == pytest.approx(40 / 4.8)
    assert s["ttft_p50"] == pytest.approx(1.0)
    assert s["ttft_p99"] == pytest.approx(np.percentile([1.0, 0.5, 2.0], 99))
    assert s["tpot_p50"] == pytest.approx(0.5)
    assert s["tpot_p99"] == pytest.approx(np.percentile([0.5, 1.0, 0.2], 99))
    itl = [0.5, 0.5, 1.0, 0.2, 0.2, 0.2, 0.2]
    assert s["itl_p50"] == pytest.approx(np.percentile(itl, 50))
    assert s["itl_p99"] == pytest.approx(np.percentile(itl, 99))
    assert s["e2e_p50"] == pytest.approx(2.0)
    assert s["preemptions"] == 2
    assert s["failures"] == {"http_500": 1, "timeout": 1}
    assert s["kv_capacity_tokens"] == 1000 and s["kv_peak_used_tokens"] == 400 and s["prefix_hit_rate"] == 0.25
    # VTC service: 1 x prompt + 2 x output tokens served
    assert s["per_client"]["a"]["service"] == 10 + 2 * 3 + 10 + 2 * 2
    assert s["per_client"]["b"]["service"] == 10 + 2 * 5
    assert s["per_client"]["a"]["requests"] == 2 and s["per_client"]["b"]["requests"] == 3
    assert s["per_client"]["a"]["ttft_p50"] == pytest.approx(0.75)
    x = np.array([30.0, 20.0])
    assert s["jain_fairness"] == pytest.approx(x.sum() ** 2 / (2 * (x ** 2).sum()))
    assert s["wall_s"] == 1.5


def test_goodput():
    s = summarize(records(), slo_ttft=1.0, slo_tpot=0.6)
    # r0: ttft 1 <= 1, tpot .5 ok -> good; r1: tpot 1 > .6 bad; r2: ttft 2 bad
    assert s["goodput_req_s"] == pytest.approx(1 / 4.8)
    assert s["slo_attainment"] == pytest.approx(1 / 3)


def test_empty_and_given_duration():
    s = summarize([])
    assert s["requests"] == 0 and s["ttft_p50"] is None and s["throughput_req_s"] is None
    s = summarize(records(), duration_s=10.0)
    assert s["throughput_req_s"] == pytest.approx(0.3)


def test_write_report_and_table(tmp_path):
    recs = records()
    s = summarize(recs, kv_capacity_tokens=1000, kv_peak_used_tokens=400)
    ts = {"t": [0, 1, 2, 3], "kv_used": [0, 100, 400, 0], "kv_capacity": [1000] * 4,
          "running": [0, 1, 2, 0], "waiting": [1, 0, 0, 0]}
    paths = write_report(tmp_path, s, recs, ts)
    names = {p.name for p in paths}
    assert {"summary.json", "timeline.png", "kv.png", "latency_cdf.png", "client_service.png",
            "throughput.png"} <= names
    loaded = json.loads((tmp_path / "summary.json").read_text())
    assert set(SUMMARY_KEYS) <= set(loaded)
    t = format_table(s)
    assert "TTFT" in t and "http_500: 1" in t and "Jain" in t


def test_jain_over_the_backlogged_window_and_whole_run():
    # a and b each get 10 tokens over [0, 10] while both are backlogged; then a alone gets 20 more
    def r(i, client, arrival, t0, n):
        times = [t0 + k for k in range(n)]
        return RequestRecord(req_id=f"r{i}", client=client, arrival=arrival, prompt_tokens=0, output_tokens=n,
                             first_token=times[0], token_times=times, finish=times[-1])
    recs = [r(0, "a", 0.0, 1.0, 10), r(1, "b", 0.0, 1.0, 10), r(2, "a", 12.0, 12.5, 20)]
    s = summarize(recs)
    # whole run: services 2 x 30 = 60 and 2 x 10 = 20 -> (80)^2 / (2 (60^2 + 20^2)) = 0.8
    assert s["jain_fairness"] == pytest.approx(0.8)
    assert s["jain_fairness_backlogged"] == pytest.approx(1.0)
    assert s["service_gap_backlogged"] == pytest.approx(0.0)
    assert 9.9 < s["backlogged_s"] < 10.2
    assert "whole run" in format_table(s)


def test_timeline_draws_requests_that_waited_on_the_client_side():
    from shepherd.bench.plots import intervals_of
    r = RequestRecord(req_id="q", arrival=0.0, prompt_tokens=5, output_tokens=2, first_token=2.0,
                      token_times=[2.0, 3.0], finish=3.0, intervals=[("queued", 0.0, 1.0)])
    assert intervals_of(r) == [("queued", 0.0, 1.0), ("prefill", 1.0, 2.0), ("decode", 2.0, 3.0)]
    # a record with server-side intervals is drawn as recorded
    full = records()[0]
    assert intervals_of(full) == full.intervals


def test_latency_percentiles_over_time_follow_a_change_in_ttft():
    from shepherd.bench.stream import RecordStats
    st = RecordStats()
    # arrivals 0-10 s wait 0.1 s for their first token, arrivals 10-20 s wait 1 s (one in ten: 10 s)
    for i, t in enumerate(np.arange(0, 20, 0.1)):
        ttft = 0.1 if t < 10 else (10.0 if i % 10 == 0 else 1.0)
        st.add(RequestRecord(req_id=str(i), arrival=float(t), prompt_tokens=10, output_tokens=3,
                             first_token=t + ttft, token_times=[t + ttft, t + ttft + 0.05, t + ttft + 0.1],
                             finish=t + ttft + 0.1))
    t, q = st.percentiles_over_time("ttft", points=4)
    first = t < 9
    late = (t > 11) & (t < 20)
    assert first.any() and late.any()
    # to within a bucket (25%)
    assert np.allclose(q[50][first], 0.1, rtol=0.25) and np.allclose(q[90][first], 0.1, rtol=0.25)
    assert np.allclose(q[50][late], 1.0, rtol=0.25)
    assert np.allclose(q[99][late], 10.0, rtol=0.25)           # the slow tenth
    assert np.isnan(q[50][t > 22]).all()                       # the drain after the last arrival: none
    _, tp = st.percentiles_over_time("tpot", points=4)
    assert np.allclose(tp[50][first], 0.05, rtol=0.25)
