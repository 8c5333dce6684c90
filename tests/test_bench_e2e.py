"""`shepherd bench` against a real `python -m shepherd serve` on the default model.

~20 short requests; the same invariants as the unit tests, on real tokens:
every request counted, output token counts equal max_tokens (ignore_eos),
prompt token counts equal what the bench built (the completions endpoint does
not add special tokens), TTFT <= E2E, and the server's own usage agrees.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shepherd.cli import main as cli_main

sys.path.insert(0, os.path.dirname(__file__))
from gateway_fakes import SERVE_START_S, free_port  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.model]


@pytest.fixture(scope="module")
def shepherd_url(tmp_path_factory):
    try:
        from shepherd.model.loader import default_model_path
        default_model_path()
    except Exception as e:
        pytest.skip(f"default model not installed: {e}")
    import httpx

    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shepherd", "serve", "--port", str(port), "--max-total-tokens", "4096",
             "--max-batch-size", "8"],
            stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + SERVE_START_S
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"shepherd serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"shepherd serve did not come up:\n{log.read_text()[-3000:]}")
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _records(out: Path):
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_bench_real_server(shepherd_url, tmp_path):
    out = tmp_path / "run"
    rc = cli_main(["bench", "--url", shepherd_url, "--out", str(out), "--num-requests", "20",
                   "--input-len", "uniform:16:96", "--output-len", "uniform:4:16", "--rate", "20",
                   "--max-concurrency", "8", "--clients", "2", "--shared-prefix", "32", "--no-progress",
                   "--no-plots", "--timeout", "120"])
    assert rc == 0
    summ = json.loads((out / "summary.json").read_text())
    assert summ["requests"] == 20 and summ["completed"] == 20 and summ["failed"] == 0
    assert summ["output_tok_s"] > 0
    assert set(summ["per_client"]) == {"client-0", "client-1"}
    recs = _records(out)
    assert len(recs) == 20
    # the workload the bench drew, to compare token counts against
    from shepherd.bench import loadgen
    trace = loadgen.synthetic(20, rate=20, input_len="uniform:16:96", output_len="uniform:4:16",
                              shared_prefix=32, clients=2, seed=0)
    want = {f"bench-{i}": tr for i, tr in enumerate(trace)}
    for r in recs:
        tr = want[r["req_id"]]
        assert r["ok"], r
        assert r["output_tokens"] == tr.output_tokens
        assert r["prompt_tokens"] == tr.prompt_tokens
        assert r["first_token"] is not None and r["finish"] is not None
        assert 0 < r["first_token"] - r["arrival"] <= r["finish"] - r["arrival"]
        assert 1 <= len(r["token_times"]) <= r["output_tokens"]
        assert r["token_times"] == sorted(r["token_times"])
    # the shared 32-token system prompt was served from the prefix cache at least once
    assert sum(r["cached_tokens"] for r in recs) > 0
    # and the server's own side, read from its /metrics during the run (the poller's names had been
    # left in another module: every poll raised NameError, swallowed, and the summary had none)
    assert summ["kv_capacity_tokens"] == 4096 and 0 < summ["kv_peak_used_tokens"] <= 4096
    assert 0 < summ["prefix_hit_rate"] <= 1
    server = json.loads((out / "timeseries.json").read_text())["server"]
    assert server["t"] and "running" in server and "kv_used" in server


@pytest.mark.timeout(300)
def test_bench_real_server_chat_and_failures(shepherd_url, tmp_path):
    rc = cli_main(["bench", "--url", shepherd_url, "--out", str(tmp_path / "chat"), "--endpoint", "chat",
                   "--num-requests", "4", "--input-len", "24", "--output-len", "6", "--no-progress", "--no-plots",
                   "--timeout", "120"])
    assert rc == 0
    for r in _records(tmp_path / "chat"):
        assert r["ok"] and r["output_tokens"] == 6 and r["first_token"] <= r["finish"]
    # a wrong model name: the server answers 4xx; every request is counted as failed, exit 1
    rc = cli_main(["bench", "--url", shepherd_url, "--out", str(tmp_path / "bad"), "--model", "no-such-model",
                   "--num-requests", "3", "--input-len", "8", "--output-len", "4", "--no-progress", "--no-plots",
                   "--timeout", "120"])
    summ = json.loads((tmp_path / "bad" / "summary.json").read_text())
    if summ["failed"]:  # servers may also serve any name; shepherd rejects unknown ones
        assert rc == 1 and summ["failed"] == 3
        assert all(k.startswith("http_4") for k in summ["failures"])
    else:
        assert rc == 0
