"""`shepherd bench` against a fake OpenAI SSE server started inside the test (no model).

The fake server streams one chunk per token with a small delay, reports usage,
and can misbehave on purpose (HTTP 500, a connection cut mid-stream, a stream
that ends without finishing, a stall past the client's timeout). It records
when each request arrived, so trace replay timing is checked on the server's
clock, independently of the client's own records.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

sys.path.insert(0, os.path.dirname(__file__))
from gateway_fakes import free_port  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from shepherd.bench import loadgen, prompts  # noqa: E402
from shepherd.bench.records import TraceRequest  # noqa: E402
from shepherd.cli import main as cli_main  # noqa: E402

TOKEN_DELAY = 0.002


class FakeServer:
    def __init__(self):
        self.app = FastAPI()
        self.arrivals: list[tuple[float, dict]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.count = 0
        self.lock = threading.Lock()
        app = self.app

        @app.get("/{mode}/v1/models")
        @app.get("/v1/models")
        async def models(mode: str = "ok"):
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        @app.post("/{mode}/v1/completions")
        @app.post("/v1/completions")
        async def completions(request: Request, mode: str = "ok"):
            return await self.handle(request, mode, chat=False)

        @app.post("/{mode}/v1/chat/completions")
        @app.post("/v1/chat/completions")
        async def chat(request: Request, mode: str = "ok"):
            return await self.handle(request, mode, chat=True)

    async def handle(self, request: Request, mode: str, chat: bool):
        body = await request.json()
        with self.lock:
            self.arrivals.append((time.perf_counter(), body))
            self.count += 1
            k = self.count
        n = int(body["max_tokens"])
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        p_tokens = len(prompt.split()) + (len(body["messages"]) - 1 if chat else 0)
        if mode == "flaky" and k % 4 == 1:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        if mode == "all500":
            return JSONResponse({"error": {"message": "down"}}, status_code=500)

        async def gen():
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                if mode == "slow":
                    await asyncio.sleep(5)
                for i in range(n):
                    await asyncio.sleep(TOKEN_DELAY)
                    if mode == "flaky" and k % 4 == 2 and i == n // 2:
                        raise RuntimeError("connection dropped on purpose")
                    if mode == "flaky" and k % 4 == 3 and i == n // 2:
                        return  # ends cleanly, but without finish_reason or [DONE]
                    fin = "length" if i == n - 1 else None
                    if chat:
                        ch = {"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": fin}
                    else:
                        ch = {"index": 0, "text": f" t{i}", "finish_reason": fin}
                    yield f"data: {json.dumps({'choices': [ch]})}\n\n"
                usage = {"prompt_tokens": p_tokens, "completion_tokens": n, "total_tokens": p_tokens + n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                self.in_flight -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def server():
    fake = FakeServer()
    port = free_port()
    cfg = uvicorn.Config(fake.app, host="127.0.0.1", port=port, log_level="error", lifespan="off")
    srv = uvicorn.Server(cfg)
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.time() + 20
    while not srv.started and time.time() < deadline:
        time.sleep(0.02)
    assert srv.started, "fake server did not start"
    fake.url = f"http://127.0.0.1:{port}"
    yield fake
    srv.should_exit = True
    th.join(timeout=5)


def _reset(fake):
    with fake.lock:
        fake.arrivals.clear()
        fake.count = 0
        fake.max_in_flight = 0


def _records(out: Path):
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def _bench(url, out, *extra):
    return cli_main(["bench", "--url", url, "--out", str(out), "--tokenizer", "none", "--no-progress",
                     "--no-plots", *map(str, extra)])


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_counts_and_latency_invariants(server, tmp_path, endpoint):
    _reset(server)
    rc = _bench(server.url, tmp_path, "--num-requests", 24, "--input-len", "uniform:8:40",
                "--output-len", "uniform:4:20", "--clients", 3, "--max-concurrency", 6,
                "--endpoint", endpoint, "--rate", 200)
    assert rc == 0
    summ = json.loads((tmp_path / "summary.json").read_text())
    assert summ["requests"] == 24 and summ["completed"] == 24 and summ["failed"] == 0
    assert set(summ["per_client"]) == {"client-0", "client-1", "client-2"}
    recs = _records(tmp_path)
    assert len(recs) == 24 == len(server.arrivals)
    bodies = {b["user"] for _, b in server.arrivals}
    assert bodies == {"client-0", "client-1", "client-2"}
    assert server.max_in_flight <= 6
    sent = sorted(b["max_tokens"] for _, b in server.arrivals)
    assert sorted(r["output_tokens"] for r in recs) == sent
    for _, b in server.arrivals:
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
        assert b["ignore_eos"] is True and b["model"] == "fake-model"
    for r in recs:
        assert r["ok"] and r["error_kind"] is None
        ttft, e2e = r["first_token"] - r["arrival"], r["finish"] - r["arrival"]
        assert 0 < ttft <= e2e
        assert len(r["token_times"]) == r["output_tokens"]
        assert r["token_times"] == sorted(r["token_times"])
        assert r["prompt_tokens"] > 0
    assert summ["output_tok_s"] > 0 and summ["ttft_p50"] <= summ["e2e_p50"]


def test_failures_are_counted_not_hidden(server, tmp_path, capsys):
    _reset(server)
    rc = _bench(server.url + "/flaky", tmp_path, "--num-requests", 16, "--input-len", 8, "--output-len", 12,
                "--max-concurrency", 4)
    assert rc == 1
    summ = json.loads((tmp_path / "summary.json").read_text())
    assert summ["requests"] == 16
    assert summ["failures"] == {"http_500": 4, "disconnect": 8}
    assert summ["completed"] == 4 and summ["failed"] == 12
    err = capsys.readouterr().err
    assert "12 of 16 requests failed" in err and "http_500: 4" in err
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert sorted(kinds) == sorted(["http_500"] * 4 + ["disconnect"] * 8)


def test_timeout_and_dead_endpoint(server, tmp_path):
    rc = _bench(server.url + "/slow", tmp_path / "slow", "--num-requests", 3, "--input-len", 4,
                "--output-len", 4, "--timeout", 0.5)
    assert rc == 1
    assert json.loads((tmp_path / "slow" / "summary.json").read_text())["failures"] == {"timeout": 3}
    # nothing listening: every request fails to connect, counted; no crash
    dead = f"http://127.0.0.1:{free_port()}"
    rc = _bench(dead, tmp_path / "dead", "--num-requests", 3, "--input-len", 4, "--output-len", 4,
                "--model", "x")
    assert rc == 1
    assert json.loads((tmp_path / "dead" / "summary.json").read_text())["failures"] == {"disconnect": 3}
    # without --model the listing fails first: a clear error, exit 2
    assert _bench(dead, tmp_path / "dead2", "--num-requests", 1) == 2


@pytest.mark.parametrize("rate", ["0", "-1", "nan"])
def test_a_rate_that_is_not_positive_is_refused_before_anything_is_sent(server, tmp_path, capsys, rate):
    _reset(server)
    assert _bench(server.url, tmp_path, "--num-requests", 2, "--input-len", 4, "--output-len", 4,
                  f"--rate={rate}") == 2
    assert "--rate must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "summary.json").exists() and server.count == 0


@pytest.mark.parametrize("flags,msg", [
    (["--time-scale", "-1"], "--time-scale must be > 0"),         # reversed the arrivals
    (["--length-scale", "0"], "--length-scale must be > 0"),
    (["--timeout", "0"], "--timeout must be > 0"),                # every request failed
    (["--max-concurrency", "-1"], "--max-concurrency must be >= 1"),
    (["--limit", "-1"], "--limit must be >= 0"),                  # "Stop argument for islice()"
    (["--input-len", "uniform:5:1"], "bad length distribution 'uniform:5:1'"),  # "empty range for randrange()"
    (["--input-len", "1000000000000"], "lengths 1..10,000,000"),           # hung building the prompt
    (["--tokenizer", "/nonexist"], "--tokenizer /nonexist: "),               # ModelNotFoundError traceback
])
def test_bad_flags_are_refused_before_anything_is_sent(server, tmp_path, capsys, flags, msg):
    _reset(server)
    argv = ["bench", "--url", server.url, "--out", str(tmp_path / "o"), "--no-progress", "--no-plots",
            "--num-requests", "2", "--output-len", "4"]
    if "--tokenizer" not in flags:
        argv += ["--tokenizer", "none"]
    assert cli_main(argv + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("shepherd bench: ") and msg in err and len(err.strip().splitlines()) == 1
    assert server.count == 0


def test_an_unusable_out_is_refused_before_anything_is_sent(server, tmp_path, capsys):
    # an existing file as --out raised FileExistsError after every request had run
    _reset(server)
    (tmp_path / "f").write_text("x")
    assert _bench(server.url, tmp_path / "f", "--num-requests", 2, "--input-len", 4, "--output-len", 4) == 2
    assert f"shepherd bench: --out {tmp_path / 'f'}: is a file, not a folder" in capsys.readouterr().err
    assert server.count == 0


def test_all_fail_500(server, tmp_path):
    rc = _bench(server.url + "/all500", tmp_path, "--num-requests", 5, "--input-len", 4, "--output-len", 4)
    assert rc == 1
    summ = json.loads((tmp_path / "summary.json").read_text())
    assert summ["failures"] == {"http_500": 5} and summ["completed"] == 0


def test_trace_replay_timing(server, tmp_path):
    # an Azure-format trace: arrivals at 0, 0.4, 1.0, 1.1, 2.0 s; replayed at --time-scale 0.5
    offsets = [0.0, 0.4, 1.0, 1.1, 2.0]
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i, off in enumerate(offsets):
        sec = 10 + off
        lines.append(f"2023-11-16 18:15:{sec:010.7f},{20 + i},{5 + i}")
    trace = tmp_path / "azure.csv"
    trace.write_text("\n".join(lines) + "\n")
    _reset(server)
    rc = _bench(server.url, tmp_path / "out", "--trace", trace, "--format", "azure", "--time-scale", 0.5)
    assert rc == 0
    want = [o * 0.5 for o in offsets]
    # on the client's clock: each request is sent at its scaled trace time
    recs = sorted(_records(tmp_path / "out"), key=lambda r: r["arrival"])
    sent = [r["arrival"] - recs[0]["arrival"] for r in recs]
    for g, w in zip(sent, want):
        assert abs(g - w) < 0.1, (sent, want)
    # on the server's clock: the same spacing, up to one common delay (connection set-up)
    t = sorted(a for a, _ in server.arrivals)
    assert len(t) == 5
    lag = sorted((x - t[0]) - w for x, w in zip(t, want))[2]
    for x, w in zip(t, want):
        assert abs((x - t[0]) - w - lag) < 0.15, ([x - t[0] for x in t], want)
    assert [r["output_tokens"] for r in recs] == [5, 6, 7, 8, 9]
    # --limit takes the first N
    _reset(server)
    assert _bench(server.url, tmp_path / "lim", "--trace", trace, "--limit", 2, "--time-scale", 0.1) == 0
    assert len(server.arrivals) == 2


def test_mooncake_prefix_blocks_survive(server, tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 20, "output_length": 3, "hash_ids": [0, 1, 2]},
        {"timestamp": 50, "input_length": 24, "output_length": 3, "hash_ids": [0, 1, 3]},
        {"timestamp": 100, "input_length": 16, "output_length": 3, "hash_ids": [4, 5]},
    ]
    trace = tmp_path / "mc.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _reset(server)
    rc = _bench(server.url, tmp_path / "out", "--trace", trace, "--format", "mooncake", "--block-size", 8)
    assert rc == 0
    p = [b["prompt"].split() for _, b in sorted(server.arrivals, key=lambda a: a[0])]
    assert [len(x) for x in p] == [20, 24, 16]
    assert p[0][:16] == p[1][:16] and p[0][16:] != p[1][16:20]
    assert p[2][:8] != p[0][:8]


def test_shared_prefix_and_determinism(server, tmp_path):
    _reset(server)
    assert _bench(server.url, tmp_path / "a", "--num-requests", 4, "--shared-prefix", 30, "--input-len", 5,
                  "--output-len", 2, "--seed", 7) == 0
    first = [b["prompt"] for _, b in sorted(server.arrivals, key=lambda a: a[0])]
    words = [x.split() for x in first]
    assert all(len(w) == 35 for w in words)
    assert all(w[:30] == words[0][:30] for w in words)
    assert len({tuple(w[30:]) for w in words}) == 4
    _reset(server)
    assert _bench(server.url, tmp_path / "b", "--num-requests", 4, "--shared-prefix", 30, "--input-len", 5,
                  "--output-len", 2, "--seed", 7) == 0
    assert sorted(b["prompt"] for _, b in server.arrivals) == sorted(first)


def test_a_synthetic_specs_system_prompt_is_really_shared(server, tmp_path):
    """A spec's system_prompt_tokens reach the server as a shared prefix (without --shared-prefix):
    the simulator counts those prompts as sharing it, so the real replay must too."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"seed": 1, "num_requests": 4, "clients": [
        {"name": "a", "rate": 50.0, "input_len": "fixed:6", "output_len": "fixed:2", "system_prompt_tokens": 20}]}))
    _reset(server)
    assert _bench(server.url, tmp_path / "out", "--trace", spec, "--format", "synthetic") == 0
    words = [b["prompt"].split() for _, b in sorted(server.arrivals, key=lambda a: a[0])]
    assert [len(w) for w in words] == [26] * 4
    assert all(w[:20] == words[0][:20] for w in words), words
    assert len({tuple(w[20:]) for w in words}) == 4


def test_no_ignore_eos_and_extra_body(server, tmp_path):
    _reset(server)
    assert _bench(server.url, tmp_path, "--num-requests", 2, "--input-len", 4, "--output-len", 3,
                  "--no-ignore-eos", "--extra-body", '{"top_k": 5}') == 0
    for _, b in server.arrivals:
        assert "ignore_eos" not in b and "min_tokens" not in b and b["top_k"] == 5


def test_synthetic_arrivals_and_dists():
    import random
    rng = random.Random(0)
    t = loadgen.arrival_times(4000, 20.0, 1.0, rng)
    gaps = [b - a for a, b in zip(t, t[1:])]
    mean = sum(gaps) / len(gaps)
    assert abs(mean - 0.05) < 0.005
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert 0.9 < cv < 1.1  # Poisson
    t2 = loadgen.arrival_times(4000, 20.0, 0.25, random.Random(0))
    g2 = [b - a for a, b in zip(t2, t2[1:])]
    m2 = sum(g2) / len(g2)
    assert (sum((g - m2) ** 2 for g in g2) / len(g2)) ** 0.5 / m2 > 1.5  # burstier
    assert loadgen.arrival_times(3, float("inf"), 1.0, rng) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("spec,lo,hi", [("64", 64, 64), ("fixed:64", 64, 64), ("uniform:10:20", 10, 20),
                                        ("u:10:20", 10, 20), ("normal:50:5", 1, 100), ("exp:30", 1, 10 ** 4),
                                        ("lognormal:100:0.5", 1, 10 ** 4), ("zipf:1.2:50", 1, 50)])
def test_bench_and_simulate_read_one_set_of_length_spellings(spec, lo, hi):
    """shepherd bench once had its own parser (no zipf, no fixed:N, no trace:FILE) beside the
    simulator's (no N, no exp): one spec now means the same on both commands."""
    reqs = loadgen.synthetic(200, input_len=spec, output_len=spec, seed=1)
    assert all(lo <= r.prompt_tokens <= hi and lo <= r.output_tokens <= hi for r in reqs)
    from shepherd.bench.synthetic import ClientSpec, SyntheticSpec, synthetic
    sim = synthetic(SyntheticSpec(clients=[ClientSpec(input_len=spec, output_len=spec)], num_requests=50))
    assert all(lo <= r.prompt_tokens <= hi for r in sim)


@pytest.mark.parametrize("spec", ["zipf:3", "uniform:5:1", "0", "exp:1e30", "nan", "lognormal:x:1"])
def test_bench_refuses_a_bad_length_spec_naming_the_forms(spec):
    with pytest.raises(ValueError, match="bad length distribution.*trace:FILE"):
        loadgen.synthetic(3, input_len=spec)


def test_prompt_lengths_with_real_tokenizer():
    try:
        tok = prompts.load_tokenizer(None)
    except Exception as e:  # the default model package is not installed
        pytest.skip(f"no default tokenizer: {e}")
    b = prompts.PromptBuilder(tok, seed=1, shared_prefix=100)
    for i, n in enumerate([1, 7, 100, 101, 333, 1500]):
        p = b.build(TraceRequest(0.0, n, 4, prefix_group="g"), i)
        assert p.tokens == n == len(tok.encode(p.text))
    a = b.build(TraceRequest(0.0, 300, 4, prefix_group="g"), 10)
    c = b.build(TraceRequest(0.0, 300, 4, prefix_group="g"), 11)
    ea, ec = tok.encode(a.text), tok.encode(c.text)
    assert ea[:100] == ec[:100] and ea[100:] != ec[100:]
    b2 = prompts.PromptBuilder(tok, seed=1, block_size=64)
    x = b2.build(TraceRequest(0.0, 200, 4, hash_ids=[5, 6, 7, 8]), 0)
    y = b2.build(TraceRequest(0.0, 150, 4, hash_ids=[5, 6, 9]), 1)
    ex, ey = tok.encode(x.text), tok.encode(y.text)
    assert len(ex) == 200 and len(ey) == 150 and ex[:128] == ey[:128] and ex[128:150] != ey[128:150]
    # RAGPulse's variable-length chunks: shared as far as the leading chunk ids agree
    u = b2.build(TraceRequest(0.0, 200, 4, chunks=[(1, 90), (2, 70), (3, 30)]), 2)
    v = b2.build(TraceRequest(0.0, 200, 4, chunks=[(1, 90), (4, 70), (3, 30)]), 3)
    eu, ev = tok.encode(u.text), tok.encode(v.text)
    assert len(eu) == len(ev) == 200 and eu[:90] == ev[:90] and eu[90:160] != ev[90:160]


def test_prometheus_parse():
    text = ('# HELP x\nvllm:num_requests_running{model_name="a"} 3\nvllm:num_requests_running{model_name="b"} 2\n'
            'vllm:num_requests_waiting 1.0\n')
    m = loadgen.parse_prometheus(text)
    assert m["vllm:num_requests_running"] == 5 and m["vllm:num_requests_waiting"] == 1.0


def test_wait_healthy_fails_fast_when_the_server_process_dies():
    """A server that exits during start-up is reported with its exit code at once, not after
    the whole start-up timeout; one that never answers times out with the URL in the error."""
    import subprocess
    import sys
    import time as _time

    from shepherd.bench import loadgen
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    t0 = _time.monotonic()
    with pytest.raises(RuntimeError, match="exited with 3"):
        loadgen.wait_healthy("http://127.0.0.1:9", proc, timeout=60, what="test server")
    assert _time.monotonic() - t0 < 5
    with pytest.raises(RuntimeError, match="127.0.0.1:9 not healthy"):
        loadgen.wait_healthy("http://127.0.0.1:9", None, timeout=0.1)


def test_a_benchmark_cut_off_by_sigterm_still_stops_the_server_it_started():
    # `timeout` or a cancelled job sends SIGTERM; a server started in its own session (as every
    # served benchmark starts `shepherd serve`) must not be left running when the benchmark dies
    import signal
    import subprocess
    script = (
        "import subprocess, sys\n"
        "from shepherd.bench.loadgen import exit_on_sigterm, stop_server\n"
        "exit_on_sigterm()\n"
        "server = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],"
        " start_new_session=True)\n"
        "try:\n"
        "    print(server.pid, flush=True)\n"
        "    sys.stdin.read()\n"          # the benchmark's work: blocks until SIGTERM
        "finally:\n"
        "    stop_server(server)\n")
    root = str(Path(__file__).resolve().parents[1])
    bench = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": root})
    server_pid = int(bench.stdout.readline())
    os.kill(bench.pid, signal.SIGTERM)
    assert bench.wait(60) == 128 + signal.SIGTERM
    with pytest.raises(ProcessLookupError):     # stopped and reaped, not orphaned
        os.kill(server_pid, 0)
