"""End to end: two real `shepherd serve` replicas (SmolLM2-135M on CPU) behind
a real `shepherd gateway` process. Short requests (max_tokens <= 8)."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from shepherd.bench import loadgen

sys.path.insert(0, os.path.dirname(__file__))
from gateway_fakes import free_port  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.timeout(300)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADMIN = "e2e-admin"
AUTH = {"authorization": f"Bearer {ADMIN}"}


def _wait_health(url, proc, timeout):
    loadgen.wait_healthy(url, proc, timeout=timeout, what=f"process for {url}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("e2e")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs, replicas = [], []
    try:
        for i in range(2):
            port = free_port()
            log = open(logs / f"replica{i}.log", "w")
            p = subprocess.Popen([sys.executable, "-m", "shepherd", "serve", "--host", "127.0.0.1",
                                  "--port", str(port), "--max-total-tokens", "4096", "--max-batch-size", "16",
                                  "--num-threads", "1", "--log-level", "warning"],
                                 cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            procs.append(p)
            replicas.append((f"http://127.0.0.1:{port}", p))
        gport = free_port()
        glog = open(logs / "gateway.log", "w")
        gw = subprocess.Popen([sys.executable, "-m", "shepherd", "gateway", "--port", str(gport),
                               "--backend", replicas[0][0], "--backend", replicas[1][0],
                               "--policy", "prefix-aware", "--health-interval", "0.2",
                               "--metrics-interval", "0.25", "--fail-threshold", "2",
                               "--read-timeout", "60", "--retries", "2", "--admin-key", ADMIN],
                              cwd=ROOT, env=env, stdout=glog, stderr=subprocess.STDOUT)
        procs.append(gw)
        gurl = f"http://127.0.0.1:{gport}"
        for url, p in replicas:
            _wait_health(url, p, 240)
        _wait_health(gurl, gw, 30)
        # the gateway re-admits a backend only after consecutive good health checks: wait for both
        deadline = time.time() + 30
        while httpx.get(gurl + "/health", timeout=5).json()["healthy_backends"] < 2:
            assert time.time() < deadline, "gateway never saw both replicas healthy"
            time.sleep(0.1)
        yield {"gateway": gurl, "replicas": replicas, "logs": logs}
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def gateway_idle(gurl) -> bool:
    bs = httpx.get(gurl + "/admin/backends", timeout=5, headers=AUTH).json()["backends"]
    return all(b["in_flight"] == 0 for b in bs)


def wait_idle(gurl, timeout=15.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if gateway_idle(gurl):
            return True
        time.sleep(0.1)
    return gateway_idle(gurl)


SYSTEM = ("You are a careful assistant for a library. You answer questions about opening hours, "
          "loans, renewals, fines, reading rooms and the catalogue. Keep answers short and polite. "
          "Never invent a rule; when unsure, say that a librarian will help. ") * 2   # 478 chars: 3 blocks


def test_models_and_health_through_gateway(stack):
    g = stack["gateway"]
    models = httpx.get(g + "/v1/models", timeout=10).json()["data"]
    assert len(models) == 1 and models[0]["id"]          # both replicas serve the same model: merged
    assert httpx.get(g + "/health", timeout=5).json()["healthy_backends"] == 2


def test_one_request_id_from_the_client_through_the_gateway_to_the_replica_and_back(stack):
    """The gateway gives a request with no X-Request-Id one and forwards it, so the replica's answer
    id, the header the client gets and the gateway's own refusals all name the same request once."""
    g = stack["gateway"]
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    given = httpx.post(g + "/v1/chat/completions", json=body, headers={"X-Request-Id": "t-7"}, timeout=60)
    assert given.headers.get_list("x-request-id") == ["t-7"] and given.json()["id"] == "chatcmpl-t-7"
    minted = httpx.post(g + "/v1/chat/completions", json=body, timeout=60)
    ids = minted.headers.get_list("x-request-id")
    assert len(ids) == 1 and minted.json()["id"] == f"chatcmpl-{ids[0]}"
    refused = httpx.post(g + "/v1/chat/completions", content=b"{not json", timeout=60)
    assert refused.status_code == 400 and len(refused.headers.get_list("x-request-id")) == 1


def test_prefix_aware_keeps_a_shared_prefix_on_one_replica(stack):
    g = stack["gateway"]
    served = []
    with httpx.Client(base_url=g, timeout=60) as c:
        for q in ("When do you open?", "Can I renew a book?", "How much is a late fine?",
                  "Where is the quiet room?"):
            r = c.post("/v1/completions", json={"prompt": SYSTEM + "\nQuestion: " + q + "\nAnswer:",
                                                "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            served.append(r.headers["x-shepherd-backend"])
        assert len(set(served)) == 1, served
        # unrelated prompts in flight together spread over both replicas (sent one after another,
        # each would go wherever the replicas' last polled metrics said was idle: a race, not routing)
        def unrelated(i):
            r = httpx.post(g + "/v1/completions", timeout=60,
                           json={"prompt": f"{i} unrelated topic number {i * 7919}: " + "xyz " * (35 + i),
                                 "max_tokens": 32, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.headers["x-shepherd-backend"]
        with cf.ThreadPoolExecutor(4) as pool:
            other = list(pool.map(unrelated, range(4)))
        assert len(set(other)) == 2, other
        # streaming through the gateway ends with [DONE]
        with c.stream("POST", "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4,
                            "stream": True}) as r:
            data = b"".join(r.iter_raw())
        assert r.status_code == 200 and data.rstrip().endswith(b"data: [DONE]")
    assert wait_idle(g)
    metrics = httpx.get(g + "/metrics", timeout=5).text
    assert 'reason="hit"' in metrics


def _one_stream(g, i):
    """-> (status, started, ok, error_event)"""
    started = ok = err = False
    try:
        with httpx.stream("POST", g + "/v1/completions",
                          json={"prompt": f"Request {i}: count slowly from one to ten.", "max_tokens": 6,
                                "stream": True, "temperature": 0}, timeout=60) as r:
            if r.status_code != 200:
                return r.status_code, False, False, False
            buf = b""
            for chunk in r.iter_raw():
                started = True
                buf += chunk
            ok = buf.rstrip().endswith(b"data: [DONE]")
            err = b'"error"' in buf
            return 200, started, ok, err
    except httpx.HTTPError as e:
        return repr(e), started, False, False


def test_killing_a_replica_under_load_loses_nothing_not_yet_streaming(stack):
    g = stack["gateway"]
    (_, p0), (_, p1) = stack["replicas"]
    results = []
    with cf.ThreadPoolExecutor(8) as ex:
        futs = [ex.submit(_one_stream, g, i) for i in range(50)]
        # kill replica 1 once the load is under way
        deadline = time.time() + 60
        while sum(f.done() for f in futs) < 8 and time.time() < deadline:
            time.sleep(0.02)
        p1.send_signal(signal.SIGKILL)
        for f in futs:
            results.append(f.result(timeout=120))
    failed = [r for r in results if not r[2]]
    # every request either finished, or had started streaming and got an error event
    for status, started, ok, err in results:
        assert ok or (status == 200 and started and err), (status, started, ok, err)
    assert len(failed) <= 8, failed                         # at most those streaming on the dead replica
    # the gateway keeps serving, on the survivor
    with httpx.Client(base_url=g, timeout=60) as c:
        for i in range(5):
            r = c.post("/v1/completions", json={"prompt": f"after {i}", "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert r.headers["x-shepherd-backend"] == stack["replicas"][0][0]
    assert wait_idle(g), httpx.get(g + "/admin/backends", headers=AUTH).json()
    bs = {b["url"]: b for b in httpx.get(g + "/admin/backends", headers=AUTH).json()["backends"]}
    assert not bs[stack["replicas"][1][0]]["healthy"]
    m = httpx.get(g + "/metrics", timeout=5).text
    assert "shepherd_gateway_in_flight_total 0.0" in m
    assert p0.poll() is None
