"""The gateway in-process against small fake OpenAI backends (tests/gateway_fakes.py)."""
from __future__ import annotations

import json
import os
import sys
import time

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from gateway_fakes import FakeBackend, ServerThread  # noqa: E402

from shepherd.gateway.app import Gateway, GatewayConfig  # noqa: E402
from shepherd.gateway.backends import BackendPool, HealthConfig, parse_backend_metrics, read_backend_file  # noqa: E402
from shepherd.routing import make_policy  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def wait_for(cond, timeout=5.0, step=0.02):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


class Cluster:
    def __init__(self, n=2, policy="round-robin", health=None, cfg=None, backend_file=None, fakes=None,
                 **fake_kw):
        self.fakes = fakes or [FakeBackend(name=f"m{i}", **fake_kw) for i in range(n)]
        self.servers = [ServerThread(f).start() for f in self.fakes]
        self.health = health or HealthConfig(health_interval=0.05, metrics_interval=0.05, file_interval=0.05,
                                             fail_threshold=3, success_threshold=2)
        urls = [] if backend_file else [s.url for s in self.servers]
        self.pool = BackendPool(urls, health=self.health, backend_file=backend_file)
        self.gw = Gateway(self.pool, make_policy(policy),
                          cfg or GatewayConfig(retries=2, retry_backoff=0.001, read_timeout=5.0,
                                               connect_timeout=1.0))
        self.gws = ServerThread(self.gw).start()
        self.client = httpx.Client(base_url=self.gws.url, timeout=15.0)

    def close(self):
        self.client.close()
        self.gws.stop()
        for s in self.servers:
            s.stop()

    def in_flight(self):
        return [b.state.in_flight for b in self.pool.backends()], self.gw.in_flight

    def idle(self):
        per, total = self.in_flight()
        return total == 0 and all(x == 0 for x in per)


@pytest.fixture
def cluster_factory():
    made = []

    def make(**kw):
        c = Cluster(**kw)
        made.append(c)
        return c
    yield make
    for c in made:
        c.close()


def post_stream(client, body, path="/v1/completions"):
    body = dict(body, stream=True)
    with client.stream("POST", path, json=body) as r:
        return r.status_code, dict(r.headers), b"".join(r.iter_raw())


BODY = {"model": "m", "prompt": "hello there", "max_tokens": 5}


# --- pass-through --------------------------------------------------------------------------

def test_streaming_pass_through_is_byte_identical(cluster_factory):
    c = cluster_factory(n=1)
    with httpx.Client(base_url=c.servers[0].url) as direct:
        st0, _, want = post_stream(direct, BODY)
    st, headers, got = post_stream(c.client, BODY)
    assert st == st0 == 200
    assert got == want
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["x-shepherd-backend"] == c.servers[0].url
    # chat too
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert post_stream(c.client, chat, "/v1/chat/completions")[2] == \
        post_stream(httpx.Client(base_url=c.servers[0].url), chat, "/v1/chat/completions")[2]


def test_streaming_is_not_buffered(cluster_factory):
    c = cluster_factory(n=1, chunk_delay=0.4)
    t0 = time.time()
    with c.client.stream("POST", "/v1/completions", json=dict(BODY, stream=True, max_tokens=4)) as r:
        it = r.iter_raw()
        first = next(it)
        t_first = time.time() - t0
        rest = b"".join(it)
        t_all = time.time() - t0
    assert first.startswith(b"data: ")
    # the first event reached the client while the backend was still generating
    assert t_all - t_first > 1.0, (t_first, t_all)
    assert rest.endswith(b"data: [DONE]\n\n")


def test_non_streaming_pass_through(cluster_factory):
    c = cluster_factory(n=1)
    r = c.client.post("/v1/completions", json=BODY)
    assert r.status_code == 200
    assert r.content == c.fakes[0].json_answer(BODY)
    assert c.fakes[0].bodies[-1] == BODY            # body forwarded unchanged


def test_usage_is_read_from_the_answers_tail():
    """vtc-basic counts each answer's completion_tokens; it reads the usage after its key, whatever
    the answer holds before it (text that says "usage", logprobs), and 0 when there is none."""
    from shepherd.gateway.intake import usage_tokens
    usage = {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}
    body = {"choices": [{"text": 'the "usage": {"completion_tokens": 99}', "logprobs": {"tokens": ["a"] * 1000}}],
            "usage": usage}
    assert usage_tokens(json.dumps(body).encode()) == 7
    assert usage_tokens(json.dumps(body, separators=(",", ":")).encode()) == 7
    assert usage_tokens(json.dumps({"usage": usage, "choices": ["usage"]}).encode()) == 7
    assert usage_tokens(json.dumps({"choices": [{"text": "no usage here"}]}).encode()) == 0
    assert usage_tokens(b'{"usage": null}') == 0 and usage_tokens(b"not json") == 0


def test_models_merged_health_and_metrics(cluster_factory):
    c = cluster_factory(n=2)
    ids = sorted(m["id"] for m in c.client.get("/v1/models").json()["data"])
    assert ids == ["m0", "m1"]
    h = c.client.get("/health")
    assert h.status_code == 200 and h.json()["healthy_backends"] == 2
    for _ in range(4):
        assert c.client.post("/v1/completions", json=BODY).status_code == 200
    text = c.client.get("/metrics").text
    for name in ("shepherd_gateway_requests_total", "shepherd_gateway_in_flight",
                 "shepherd_gateway_routing_decisions_total", "shepherd_gateway_retries_total",
                 "shepherd_gateway_backend_healthy"):
        assert name in text, name
    assert f'shepherd_gateway_requests_total{{backend="{c.servers[0].url}",status="200"}} 2.0' in text
    assert 'shepherd_gateway_routing_decisions_total{policy="round-robin",reason="rr"} 4.0' in text


# --- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize("raw,param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (json.dumps({"model": "m"}).encode(), "prompt"),
    (json.dumps({"model": "m", "prompt": "x", "stream": "yes"}).encode(), "stream"),
    (json.dumps({"model": "m", "prompt": {"a": 1}}).encode(), "prompt"),
])
def test_bad_input_is_400_openai_style(cluster_factory, raw, param):
    c = cluster_factory(n=1)
    r = c.client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and err["param"] == param
    r = c.client.post("/v1/chat/completions", json={"model": "m", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert c.fakes[0].requests == 0


def test_client_4xx_passes_through_and_is_not_a_failure(cluster_factory):
    c = cluster_factory(n=1)
    c.fakes[0].mode = "bad400"
    for _ in range(10):
        r = c.client.post("/v1/completions", json=BODY)
        assert r.status_code == 400 and r.json()["error"]["message"] == "bad prompt"
    b = c.pool.backends()[0]
    assert b.healthy and b.consecutive_failures == 0 and b.total_failures == 0
    assert c.fakes[0].requests == 10                 # never retried either


# --- retries -----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["die_before_first", "overload503"])
def test_retry_on_another_replica_before_first_byte(cluster_factory, mode):
    c = cluster_factory(n=2, policy="round-robin")
    c.fakes[0].mode = mode
    for i in range(6):
        st, _, data = post_stream(c.client, BODY)
        assert st == 200 and data.endswith(b"data: [DONE]\n\n")
        assert c.client.post("/v1/completions", json=BODY).status_code == 200
    # die_before_first only affects streams
    assert c.fakes[1].requests >= (6 if mode == "die_before_first" else 12)
    assert 'shepherd_gateway_retries_total' in c.client.get("/metrics").text
    assert wait_for(c.idle)


def test_retry_when_backend_is_down(cluster_factory):
    c = cluster_factory(n=2, policy="round-robin",
                        health=HealthConfig(health_interval=10, metrics_interval=0))
    c.servers[0].stop()                                # connection refused, still listed as healthy
    for _ in range(4):
        assert c.client.post("/v1/completions", json=BODY).status_code == 200
    b0 = c.pool.backends()[0]
    assert b0.total_failures >= 2
    assert wait_for(c.idle)


def test_all_replicas_fail_gives_the_last_answer_or_502(cluster_factory):
    c = cluster_factory(n=2)
    for f in c.fakes:
        f.mode = "overload503"
    r = c.client.post("/v1/completions", json=BODY)
    assert r.status_code == 503 and r.json()["error"]["message"] == "busy"
    for s in c.servers:
        s.stop()
    r = c.client.post("/v1/completions", json=BODY)
    assert r.status_code in (502, 503) and "error" in r.json()
    assert wait_for(c.idle)


def test_error_event_after_first_byte_and_no_retry(cluster_factory):
    c = cluster_factory(n=2, policy="round-robin")
    for f in c.fakes:
        f.mode = "die_after_first"
    t0 = time.time()
    st, _, data = post_stream(c.client, BODY)
    assert st == 200 and time.time() - t0 < 5
    events = [e for e in data.split(b"\n\n") if e]
    assert events[0].startswith(b"data: {") and b"tok0" in events[0]
    assert events[-1] == b"data: [DONE]"                         # the client is not left waiting
    err = json.loads(events[-2][len(b"data: "):])
    assert err["error"]["type"] == "upstream_error"
    assert c.fakes[0].requests + c.fakes[1].requests == 1       # not retried after the first byte
    assert 'shepherd_gateway_errors_total{kind="stream_error"} 1.0' in c.client.get("/metrics").text
    assert wait_for(c.idle)


def test_read_timeout_is_504_not_retried_and_not_a_fault(cluster_factory):
    """A slow replica has the request (it may be running it): the gateway neither runs it again
    elsewhere nor holds the timeout against the replica."""
    c = cluster_factory(n=2, policy="round-robin",
                        health=HealthConfig(health_interval=30, metrics_interval=0, fail_threshold=1),
                        cfg=GatewayConfig(retries=1, retry_backoff=0.001, read_timeout=0.3, connect_timeout=0.5))
    c.fakes[0].mode = "hang"
    t0 = time.time()
    statuses = [c.client.post("/v1/completions", json=BODY).status_code for _ in range(4)]
    assert time.time() - t0 < 5
    assert sorted(statuses) == [200, 200, 504, 504]
    assert c.fakes[0].requests == 2 and c.fakes[1].requests == 2          # never run twice
    st, _, data = post_stream(c.client, BODY)                              # rr: to the hanging one
    assert st == 504 and c.fakes[1].requests == 2
    assert all(b.healthy and b.total_failures == 0 for b in c.pool.backends())
    assert wait_for(c.idle)


class ReadThenClose:
    """A backend that reads a whole request and closes the connection without answering."""

    def __init__(self):
        import socket
        import threading
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            n = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
            while len(rest) < n:
                rest += conn.recv(65536)
            self.requests += 1
            conn.close()


def test_non_streaming_request_lost_after_sending_is_not_run_again(cluster_factory):
    """The backend took the request and closed the connection without an answer: it may have run
    it, so a non-streaming request is answered 502, not sent to the other replica; a stream that
    gave nothing yet is retried (its client has nothing)."""
    c = cluster_factory(n=1, health=HealthConfig(health_interval=30, metrics_interval=0, fail_threshold=5))
    dead = ReadThenClose()
    c.pool.add(dead.url, source="admin")
    statuses = [c.client.post("/v1/completions", json=BODY).status_code for _ in range(4)]
    assert sorted(statuses) == [200, 200, 502, 502] and dead.requests == 2 and c.fakes[0].requests == 2
    for _ in range(2):
        st, _, data = post_stream(c.client, BODY)
        assert st == 200 and data.endswith(b"data: [DONE]\n\n")
    assert dead.requests == 3
    assert wait_for(c.idle)
    dead.sock.close()


def test_429_is_not_a_fault_and_moves_only_to_a_replica_with_room(cluster_factory):
    c = cluster_factory(n=2, policy="round-robin",
                        health=HealthConfig(health_interval=30, metrics_interval=0, fail_threshold=1))
    c.fakes[0].mode = "full429"
    for _ in range(4):
        r = c.client.post("/v1/completions", json=BODY)
        assert r.status_code == 200 and r.headers["x-shepherd-backend"] == c.servers[1].url
    # m0 said "full for 30 s" once: it is not asked again meanwhile, and the retry says so
    assert c.fakes[0].requests == 1
    c.fakes[1].mode = "full429"
    c.gw.proxy.full_until.clear()
    r = c.client.post("/v1/completions", json=BODY)
    assert r.status_code == 429 and r.headers["retry-after"] == "30"
    assert "429" in r.headers["x-shepherd-attempts"]
    r = c.client.post("/v1/completions", json=BODY)                # both full: answered at once
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 29
    assert c.fakes[0].requests == 2 and c.fakes[1].requests == 5
    assert all(b.healthy and b.total_failures == 0 for b in c.pool.backends())


# --- in-flight accounting ------------------------------------------------------------------

def test_in_flight_returns_to_zero_after_client_aborts(cluster_factory):
    c = cluster_factory(n=2, chunk_delay=0.2, chunks=20)
    for _ in range(4):
        with c.client.stream("POST", "/v1/completions", json=dict(BODY, stream=True, max_tokens=20)) as r:
            it = r.iter_raw()           # keep a reference: a dropped generator closes the stream
            next(it)
            per, total = c.in_flight()
            assert total == 1 and sum(per) == 1
        # leaving the block closes the connection mid-stream
    assert wait_for(c.idle, timeout=5), c.in_flight()
    assert wait_for(lambda: sum(f.aborted for f in c.fakes) == 4, timeout=5)    # aborts reach the backend
    assert 'kind="client_abort"' in c.client.get("/metrics").text
    # abort while waiting for headers (backend hangs)
    c.fakes[0].mode = c.fakes[1].mode = "hang"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(c.gws.url + "/v1/completions", json=BODY, timeout=0.3)
    assert wait_for(c.idle, timeout=5), c.in_flight()


def test_in_flight_counts_concurrent_requests_and_returns_to_zero(cluster_factory):
    import concurrent.futures as cf
    c = cluster_factory(n=2, chunk_delay=0.05, chunks=4, policy="least-request")
    c.fakes[1].mode = "overload503"
    with cf.ThreadPoolExecutor(16) as ex:
        futs = [ex.submit(post_stream, c.client, BODY) for _ in range(40)]
        seen = 0
        while not all(f.done() for f in futs):
            seen = max(seen, c.gw.in_flight)
            time.sleep(0.005)
        assert all(f.result()[0] == 200 for f in futs)
    assert seen > 1
    assert wait_for(c.idle), c.in_flight()


# --- health ----------------------------------------------------------------------------

def test_ejection_and_readmission(cluster_factory):
    c = cluster_factory(n=2, policy="round-robin",
                        health=HealthConfig(health_interval=0.05, metrics_interval=0, fail_threshold=3,
                                            success_threshold=3))
    c.fakes[0].mode = "health_fail"
    b0 = c.pool.backends()[0]
    assert wait_for(lambda: not b0.healthy, timeout=3)
    before = c.fakes[0].requests
    for _ in range(6):
        assert c.client.post("/v1/completions", json=BODY).status_code == 200
    assert c.fakes[0].requests == before                        # no traffic while ejected
    assert 'shepherd_gateway_backend_healthy{backend="%s"} 0.0' % b0.url in c.client.get("/metrics").text
    c.fakes[0].mode = "ok"
    assert wait_for(lambda: b0.healthy, timeout=3)
    for _ in range(6):
        assert c.client.post("/v1/completions", json=BODY).status_code == 200
    assert c.fakes[0].requests > before
    assert b0.ejections == 1


def test_a_slow_health_check_does_not_eject_a_busy_replica_but_silence_does(cluster_factory):
    c = cluster_factory(n=2, policy="round-robin",
                        health=HealthConfig(health_interval=0.05, health_timeout=0.1, metrics_interval=0,
                                            fail_threshold=2, stall_timeout=1.0))
    c.fakes[0].mode = "health_slow"
    b0 = c.pool.backends()[0]
    t0 = time.time()
    while time.time() - t0 < 2.0:                    # traffic keeps flowing from it: slow, not dead
        assert c.client.post("/v1/completions", json=BODY).status_code == 200
        time.sleep(0.05)
    assert b0.healthy and b0.ejections == 0
    assert wait_for(lambda: not b0.healthy, timeout=5)  # nothing from it for stall_timeout: stalled
    assert "stalled" in b0.last_error


def test_passive_ejection_from_connection_failures(cluster_factory):
    c = cluster_factory(n=2, policy="round-robin",
                        health=HealthConfig(health_interval=30, metrics_interval=0, fail_threshold=2))
    c.servers[0].stop()                  # /health is not polled in time; requests cannot connect
    for _ in range(6):
        assert c.client.post("/v1/completions", json=BODY).status_code == 200
    assert not c.pool.backends()[0].healthy


def test_a_500_answer_is_passed_through_and_never_ejects(cluster_factory):
    """Three bad requests that make replicas answer 500 must not take the service down."""
    c = cluster_factory(n=2, policy="round-robin",
                        health=HealthConfig(health_interval=30, metrics_interval=0, fail_threshold=1))
    for f in c.fakes:
        f.mode = "fail500"
    for _ in range(3):
        r = c.client.post("/v1/completions", json=BODY)
        assert r.status_code == 500 and "error" in r.json()
    assert sum(f.requests for f in c.fakes) == 3          # not retried on the other replica
    assert all(b.healthy and b.total_failures == 0 for b in c.pool.backends())
    for f in c.fakes:
        f.mode = "ok"
    for _ in range(4):
        assert c.client.post("/v1/completions", json=BODY).status_code == 200


def test_gateway_own_errors_are_openai_json(cluster_factory):
    c = cluster_factory(n=1)
    deep = b"[" * 100000 + b"]" * 100000
    r = c.client.post("/v1/completions", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = c.client.post("/v1/completions", content=b'{"prompt": "a\\ud800b", "max_tokens": 2}',
                      headers={"content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
    assert c.fakes[0].requests == 0
    assert c.client.post("/v1/completions", json=BODY).status_code == 200


def test_no_healthy_backend_is_503(cluster_factory):
    c = cluster_factory(n=1, health=HealthConfig(health_interval=0.05, metrics_interval=0, fail_threshold=1))
    c.fakes[0].mode = "health_fail"
    assert wait_for(lambda: not c.pool.backends()[0].healthy)
    r = c.client.post("/v1/completions", json=BODY)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    assert c.client.get("/health").status_code == 503


# --- metrics scraping ----------------------------------------------------------------------

def test_parse_backend_metrics_vllm_and_sglang():
    vllm = ('# HELP x\nvllm:num_requests_running{model_name="a"} 3.0\nvllm:num_requests_running{model_name="b"} 2.0\n'
            'vllm:num_requests_waiting{model_name="a"} 4.0\nvllm:gpu_cache_usage_perc{model_name="a"} 0.25\n')
    assert parse_backend_metrics(vllm) == {"running": 5, "waiting": 4, "kv_usage": 0.25}
    sg = 'sglang:num_running_reqs{x="1"} 7\nsglang:num_queue_reqs{x="1"} 1\nsglang:token_usage{x="1"} 0.5\n'
    assert parse_backend_metrics(sg) == {"running": 7, "waiting": 1, "kv_usage": 0.5}
    assert parse_backend_metrics("vllm:kv_cache_usage_perc 55\n")["kv_usage"] == 0.55
    assert parse_backend_metrics("garbage\n\n# nothing") == {"running": None, "waiting": None, "kv_usage": None}


def test_backend_metrics_are_scraped(cluster_factory):
    fakes = [FakeBackend("a", running=7, waiting=2, kv=0.4), FakeBackend("b", metric_style="sglang", running=1, kv=0.9)]
    c = cluster_factory(fakes=fakes, policy="least-request")
    a, b = c.pool.backends()
    assert wait_for(lambda: a.state.running == 7 and b.state.kv_usage == 0.9, timeout=3)
    assert (a.state.waiting, a.state.kv_usage, b.state.running) == (2, 0.4, 1)
    # least-request sees a's 9 requests: everything goes to b
    for _ in range(4):
        assert c.client.post("/v1/completions", json=BODY).headers["x-shepherd-backend"] == b.url


# --- membership ------------------------------------------------------------------------------

def test_backend_file_is_reloaded(cluster_factory, tmp_path):
    fakes = [FakeBackend("a"), FakeBackend("b")]
    servers = [ServerThread(f).start() for f in fakes]
    path = tmp_path / "backends.txt"
    path.write_text(f"# replicas\n{servers[0].url}\n")
    try:
        c = cluster_factory(fakes=[FakeBackend("unused")], backend_file=str(path))
        assert [b.url for b in c.pool.backends()] == [servers[0].url]
        path.write_text(f"{servers[0].url}\n{servers[1].url}  # second\n")
        assert wait_for(lambda: len(c.pool.backends()) == 2, timeout=3)
        path.write_text(f"[\"{servers[1].url}\"]")
        assert wait_for(lambda: [b.url for b in c.pool.backends()] == [servers[1].url], timeout=3)
        for _ in range(3):
            assert c.client.post("/v1/completions", json=BODY).headers["x-shepherd-backend"] == servers[1].url
        path.write_text("not a url at all ://")      # unreadable: keep the current set
        time.sleep(0.3)
        assert [b.url for b in c.pool.backends()] == [servers[1].url]
    finally:
        for s in servers:
            s.stop()


def test_read_backend_file_formats(tmp_path):
    p = tmp_path / "f"
    p.write_text("127.0.0.1:1\nhttp://h:2/v1/\n\n# c\n")
    assert read_backend_file(str(p)) == ["http://127.0.0.1:1", "http://h:2"]
    p.write_text('{"backends": ["http://x:3"]}')
    assert read_backend_file(str(p)) == ["http://x:3"]


def test_admin_add_and_remove(cluster_factory):
    c = cluster_factory(n=1, cfg=GatewayConfig(admin_key="adm"))
    c.client.headers["authorization"] = "Bearer adm"
    extra = ServerThread(FakeBackend("extra")).start()
    try:
        r = c.client.post("/admin/backends", json={"url": extra.url})
        assert r.status_code == 200 and r.json()["added"] == extra.url
        assert len(c.client.get("/admin/backends").json()["backends"]) == 2
        ids = sorted(m["id"] for m in c.client.get("/v1/models").json()["data"])
        assert ids == ["extra", "m0"]
        r = c.client.request("DELETE", "/admin/backends", json={"url": c.servers[0].url})
        assert r.status_code == 200
        for _ in range(3):
            assert c.client.post("/v1/completions", json=BODY).headers["x-shepherd-backend"] == extra.url
        assert c.client.delete("/admin/backends", params={"url": "http://nope:1"}).status_code == 404
        assert c.client.post("/admin/backends", json={}).status_code == 400
        r = c.client.post("/admin/backends", json={"url": "http://169.254.169.254"})
        assert r.status_code == 400 and "link-local" in r.json()["error"]["message"]
    finally:
        extra.stop()


def test_admin_is_off_without_a_key_and_needs_it_with_one(cluster_factory):
    c = cluster_factory(n=1)
    for method in ("GET", "POST", "DELETE"):
        r = c.client.request(method, "/admin/backends", json={"url": "http://127.0.0.1:1"})
        assert r.status_code == 404 and "--admin-key" in r.json()["error"]["message"]
    c = cluster_factory(n=1, cfg=GatewayConfig(admin_key="adm", api_key="client"))
    client_auth = {"authorization": "Bearer client"}
    for method in ("GET", "POST", "DELETE"):
        for hdrs in ({}, client_auth, {"authorization": "Bearer nope"}):
            r = c.client.request(method, "/admin/backends", json={"url": "http://127.0.0.1:1"}, headers=hdrs)
            assert r.status_code == 401, (method, hdrs, r.status_code)
    assert len(c.pool.backends()) == 1
    assert c.client.post("/v1/completions", json=BODY, headers=client_auth).status_code == 200


def test_gateway_keys_client_and_backend(cluster_factory):
    c = cluster_factory(n=1, cfg=GatewayConfig(api_key="client", backend_api_key="inner"))
    assert c.client.post("/v1/completions", json=BODY).status_code == 401
    assert c.client.post("/v1/completions", json=BODY, headers={"authorization": "Bearer x"}).status_code == 401
    assert c.client.get("/v1/models").status_code == 401
    assert c.client.get("/health").status_code == 200 and c.client.get("/metrics").status_code == 200
    r = c.client.post("/v1/completions", json=BODY, headers={"authorization": "Bearer client"})
    assert r.status_code == 200
    # the backend sees the gateway's key, never the client's
    assert c.fakes[0].auth == ["Bearer inner"]


def test_large_unauthenticated_body_is_refused_before_it_is_read(cluster_factory):
    """A client without the key declares 100 MB and sends a trickle: 401 at once."""
    import socket
    c = cluster_factory(n=1, cfg=GatewayConfig(api_key="client"))
    with socket.create_connection(("127.0.0.1", c.gws.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000000\r\n\r\n{\"prompt\": \"")
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 401")
    assert c.fakes[0].requests == 0


def test_cli_parses_and_rejects_bad_config():
    import argparse
    from shepherd.gateway import gateway_cli
    p = argparse.ArgumentParser()
    gateway_cli.add_arguments(p)
    gw, name = gateway_cli.build_gateway(p.parse_args(
        ["--backend", "127.0.0.1:9", "--policy", "weighted", "--scorer-weights", "prefix=3,load=1"]))
    assert name == "weighted" and gw.policy.weights == {"prefix": 3.0, "load": 1.0}
    gw, _ = gateway_cli.build_gateway(p.parse_args(
        ["--backend", "http://a:1", "--policy", "prefix-aware", "--policy-knob", "block_size=32"]))
    assert gw.policy.block_size == 32
    for bad in (["--policy", "least-request"], ["--backend", "x:1", "--policy", "nope"],
                ["--backend", "x:1", "--policy", "prefix-aware", "--policy-knob", "zzz=1"],
                ["--backend", "ftp://x"]):
        with pytest.raises(ValueError):
            gateway_cli.build_gateway(p.parse_args(bad))
    assert gateway_cli.main(p.parse_args(["--backend", "x:1", "--policy", "nope"])) == 2


def test_gateway_on_a_taken_port_exits_2_with_one_line(capsys):
    import argparse
    import socket
    from shepherd.gateway import gateway_cli
    p = argparse.ArgumentParser()
    gateway_cli.add_arguments(p)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert gateway_cli.main(p.parse_args(["--backend", "127.0.0.1:9", "--port", str(port)])) == 2
    assert f"shepherd gateway: cannot listen on 127.0.0.1 port {port}" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", ["gateway", "epp"])
@pytest.mark.parametrize("flags,msg", [
    # the socket layer took 70000 as 4464 and -1 as 65535 (exit 0, the wrong port)
    (["--port", "70000"], "--port must be in 0..65535, got 70000"),
    (["--port", "-1"], "--port must be in 0..65535, got -1"),
    # 0 turned the health checks off without a word
    (["--health-interval", "0"], "--health-interval must be > 0 seconds"),
    (["--health-interval", "nan"], "--health-interval must be > 0 seconds"),
])
def test_gateway_and_epp_refuse_out_of_range_flags(capsys, cmd, flags, msg):
    from shepherd.cli import main
    where = ["--backend", "127.0.0.1:9"] if cmd == "gateway" else ["--endpoint", "127.0.0.1:9"]
    assert main([cmd, *where, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shepherd {cmd}: {msg}") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flags,msg", [
    (["--backend", "http://127.0.0.1:99999"], "backend URL 'http://127.0.0.1:99999': Port out of range"),
    (["--backend", "http://:80"], "has no host"),
    (["--backend", "x:1", "--read-timeout", "0"], "--read-timeout must be > 0 seconds"),
    (["--backend", "x:1", "--metrics-interval", "-1"], "--metrics-interval must be >= 0 seconds"),
    # NaN passed the `<= 0` comparisons these had
    (["--backend", "x:1", "--body-timeout", "nan"], "--body-timeout must be > 0 seconds, got nan"),
    (["--backend", "x:1", "--stall-timeout", "nan"], "--stall-timeout must be > 0 seconds, got nan"),
])
def test_gateway_refuses_a_bad_backend_url_or_timeout(capsys, flags, msg):
    from shepherd.cli import main
    assert main(["gateway", *flags]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1


def test_backend_restart_stale_keepalive_connections_are_replaced(cluster_factory):
    c = cluster_factory(n=1, health=HealthConfig(health_interval=30, metrics_interval=0))
    for _ in range(3):
        assert c.client.post("/v1/completions", json=BODY).status_code == 200
    port = c.servers[0].port
    c.servers[0].stop()
    c.servers[0] = ServerThread(c.fakes[0], port=port).start()
    for _ in range(3):
        assert c.client.post("/v1/completions", json=BODY).status_code == 200
    assert c.pool.backends()[0].total_failures == 0


def test_http1_client_framings_and_errors():
    import asyncio
    from shepherd.gateway.http1 import Http1Pool, RemoteClosed, UpstreamTimeout, ConnectError

    answers = {
        "/close": b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello",
        "/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-T: 1\r\n\r\n",
        "/length": b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nabc",
    }

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ")[1].decode()
                n = int([ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0])
                await reader.readexactly(n)
                if path == "/drop":
                    break
                if path == "/hang":
                    await asyncio.sleep(5)
                    break
                writer.write(answers[path])
                await writer.drain()
                if path == "/close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def main():
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        pool = Http1Pool(read_timeout=0.3)
        r = await pool.request("POST", base, "/close", [], b"{}")
        assert r.status_code == 200 and await r.read() == b"hello"
        r = await pool.request("POST", base, "/chunked", [], b"{}")
        assert [c async for c in r.iter_raw()] == [b"hello", b" world"]
        r = await pool.request("POST", base, "/length", [(b"x-a", b"1")], b"{}")   # reuses the connection
        assert r.status_code == 404 and await r.read() == b"abc"
        try:
            await pool.request("POST", base, "/drop", [], b"{}")
            raise AssertionError("no error")
        except RemoteClosed:
            pass
        try:
            await pool.request("POST", base, "/hang", [], b"{}")
            raise AssertionError("no error")
        except UpstreamTimeout:
            pass
        srv.close()
        await srv.wait_closed()
        try:
            await pool.request("POST", base, "/close", [], b"{}")
            raise AssertionError("no error")
        except (ConnectError, RemoteClosed):
            pass
        await pool.aclose()

    asyncio.run(main())


def test_gateway_refuses_from_content_length_what_every_replica_would_refuse(cluster_factory):
    """Replicas name their body cap in /health's answer: a body over the largest is refused at once
    (413 from Content-Length, before reading or parsing it; issue 31: 10 bodies of 13 MB parsed by
    the gateway and then refused by the replicas stalled it for 3.3 s), one under it goes on, and
    while any backend names none (not shepherd) the gateway's own cap holds."""
    c = cluster_factory(n=2)
    c.fakes[0].body_cap, c.fakes[1].body_cap = 4096, 8192
    assert wait_for(lambda: sorted(b.max_body_bytes or 0 for b in c.pool.backends()) == [4096, 8192])
    r = c.client.post("/v1/completions", json=dict(BODY, prompt="x" * 10_000))
    assert r.status_code == 413 and "the replicas' --max-body-bytes" in r.json()["error"]["message"], r.text
    assert sum(f.requests for f in c.fakes) == 0
    assert c.client.post("/v1/completions", json=dict(BODY, prompt="x" * 6000)).status_code == 200
    c.fakes[1].body_cap = None
    assert wait_for(lambda: any(b.max_body_bytes is None for b in c.pool.backends()))
    assert c.client.post("/v1/completions", json=dict(BODY, prompt="x" * 10_000)).status_code == 200
