"""No request can stall the others (issue 31), a small version of benchmarks/stall_attacks.py.

Real `shepherd serve` processes (simulated executor, real tokenizer, so the
HTTP side does all its real work) and a real `shepherd gateway` over two of
them. For each attack, an innocent client streams a completion and polls
/health while several copies of the attack arrive at once; the same client
first measures both with no attack, in the same test. Bounds: every attacker
gets 400, 413 or 429; /health p99 stays under 0.5 s; the innocent stream's
longest gap stays under twice its no-attack figure plus 0.5 s of slack for a
shared 2-core machine (before issue 31 these attacks stalled both for seconds
to tens of seconds). A row that misses a timing bound is measured once more and
fails only if it misses again (check_attacks says why). The window ends when every attacker has its answer; the
test never sleeps to synchronise.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from shepherd.bench import loadgen

sys.path.insert(0, os.path.dirname(__file__))
from gateway_fakes import SERVE_START_S, free_port  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPEAT = 4
GAP_SLACK = 0.5


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


# a spec over any compile budget this suite sets (see the row that uses it)
SLOW_REGEX = "".join(f"[a-z]{{1,{30_000 + i}}}x" for i in range(64))

# name -> (path, body): each sized past one of the limits of docs/SERVING.md "Input limits"
ATTACKS = {
    "3 MB prompt (413 before reading)": ("/v1/completions", _json({"prompt": "hello world " * 250_000})),
    "900k-character prompt (400 untokenized)": ("/v1/completions", _json({"prompt": "hi " * 300_000})),
    "900k-character chat message": ("/v1/chat/completions",
                                    _json({"messages": [{"role": "user", "content": "hi " * 300_000}]})),
    "logit_bias of 60k entries": ("/v1/completions", _json({"prompt": "hi", "logit_bias": {
        str(i): 1.0 for i in range(60_000)}})),
    # over the replicas' cap but under a gateway's or the Ray ingress's own 16 MiB: refused by them
    # from Content-Length too, not parsed first (a 400k-entry dict takes ~0.1 s of the loop each)
    "5 MB logit_bias of 400k entries (413 before reading)": ("/v1/completions", _json({
        "prompt": "hi", "logit_bias": {str(i): 1.0 for i in range(400_000)}})),
    "guided_choice of 10k choices": ("/v1/completions", _json({"prompt": "hi", "max_tokens": 4, "guided_choice": [
        f"choice number {i}" for i in range(10_000)]})),
    # a regex of 960 bytes that xgrammar compiles for seconds, linearly in the repeats' bounds (9 s on
    # the 2-core AMD EPYC Zen 4, xgrammar 0.2.8 and 0.2.9 alike), over the 1 s budget on any host. The
    # row it replaces, a json_schema of eight strings with a maxLength of 300,000, compiled for 6.3 s
    # with 0.2.8 and in 0.01 s with 0.2.9: answered 200, it failed CI when 0.2.9 was released.
    "64 repeats of up to 30,063 letters (compile over budget)": ("/v1/chat/completions", _json({
        "messages": [{"role": "user", "content": "pick"}], "max_tokens": 8,
        "guided_regex": SLOW_REGEX})),
    # under the body cap: what grows is the objects to parse, validate and render (validated in
    # the work thread; a full garbage collection walking ten such bodies held the loop 0.18 s).
    # A chat has at most 2,048 messages (refused before they are validated), so the most objects
    # one can still bring are in its messages' parts: 43,000 of them, rendered, then too long
    "chat of 2,048 messages of 21 empty parts": ("/v1/chat/completions", _json({
        "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 21}] * 2048,
        "max_tokens": 1})),
    "/detokenize of 150k tokens": ("/detokenize", _json({"tokens": [i % 49152 for i in range(150_000)]})),
    "/tokenize of 900k characters": ("/tokenize", _json({"prompt": "abc " * 225_000})),
}


def _start(args: list, log_path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "shepherd"] + args, cwd=ROOT, env=env,
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("stall")
    procs, urls = [], []
    try:
        for i in range(2):
            port = free_port()
            procs.append(_start(["serve", "--executor", "sim", "--port", str(port), "--log-level", "warning",
                                 "--grammar-timeout", "1", "--max-total-tokens", "16384", "--body-timeout", "3", "--header-timeout", "3"],
                                logs / f"r{i}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        gport = free_port()
        procs.append(_start(["gateway", "--port", str(gport), "--backend", urls[0], "--backend", urls[1],
                             "--health-interval", "0.2", "--fail-threshold", "2", "--policy", "round-robin",
                             "--header-timeout", "3"],
                            logs / "gateway.log"))
        for url, p in zip(urls, procs):
            loadgen.wait_healthy(url, p, timeout=SERVE_START_S, what=f"replica {url}")
        gurl = f"http://127.0.0.1:{gport}"
        loadgen.wait_healthy(gurl, procs[-1], timeout=60, what="gateway")
        yield {"replica": urls[0], "gateway": gurl, "logs": logs}
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


class Innocent:
    """A streaming client and a /health poller, each in a thread, recording while `on`."""

    def __init__(self, url: str):
        self.url, self.stop = url, threading.Event()
        self.chunks: list[tuple[int, float]] = []      # (stream no, arrival)
        self.health: list[tuple[float, float]] = []    # (sent, latency)
        self.threads = [threading.Thread(target=self._stream, daemon=True),
                        threading.Thread(target=self._poll, daemon=True)]

    def _stream(self):
        body = {"prompt": "Tell me a story.", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        k = 0
        with httpx.Client(timeout=60) as c:
            while not self.stop.is_set():
                with c.stream("POST", self.url + "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            self.chunks.append((k, time.perf_counter()))
                        if self.stop.is_set():
                            break
                k += 1

    def _poll(self):
        with httpx.Client(timeout=60) as c:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                c.get(self.url + "/health")
                self.health.append((t0, time.perf_counter() - t0))
                self.stop.wait(0.02)

    def __enter__(self):
        for t in self.threads:
            t.start()
        deadline = time.time() + 60
        while len(self.chunks) < 10:                    # the stream is flowing
            assert time.time() < deadline, "the innocent stream never started"
            time.sleep(0.005)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def figures(self, t0: float, t1: float) -> tuple[float, float]:
        """(/health p99, longest gap between two chunks of one stream) over [t0, t1]."""
        lat = sorted(d for t, d in self.health if t0 <= t <= t1 or t < t0 <= t + d)
        p99 = lat[min(len(lat) - 1, int(0.99 * (len(lat) - 1) + 0.5))] if lat else 0.0
        ch = list(self.chunks)
        gap = max((b - a for (k0, a), (k1, b) in zip(ch, ch[1:]) if k0 == k1 and b >= t0 and a <= t1),
                  default=0.0)
        return p99, gap


def post(url: str, path: str, body: bytes) -> int:
    try:
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"},
                          timeout=120).status_code
    except httpx.HTTPError as e:       # refused before the body was all sent: still an answer
        return 413 if isinstance(e, (httpx.WriteError, httpx.RemoteProtocolError)) else -1


ENDLESS_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: "
# a chunked body's trailers are headers after the body
ENDLESS_TRAILER = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n1e\r\n{\"prompt\":\"hi\",\"max_tokens\":2}\r\n0\r\nX-T: ")


def endless(url: str, start: bytes) -> int:
    """`start`, then one header that never ends (64 MB sent as fast as the server takes it): 431
    when the server cut it within a few MB (its answer, or the reset that lost it), else its status."""
    host, port = url.rsplit("/", 1)[1].split(":")
    sent, chunk = 0, b"a" * (64 << 10)
    with socket.create_connection((host, int(port)), timeout=60) as s:
        try:
            s.sendall(start)
            while sent < (64 << 20):
                s.sendall(chunk)
                sent += len(chunk)
            s.sendall(b"\r\n\r\n")
            answer = s.recv(64)
        except (BrokenPipeError, ConnectionResetError):
            answer = b""
    if sent < (16 << 20):
        return 431
    return int(answer.split()[1]) if answer.startswith(b"HTTP/1.1 ") else -1


def measure(url: str, attack, repeat: int = REPEAT) -> tuple[list, float, float]:
    """(the attackers' statuses, /health p99, the innocent stream's longest gap) while `repeat`
    copies of `attack` (path and body, or a function of the url that sends its own and returns
    a status) are answered (attack None: ~150 tokens with nothing else going on)."""
    with Innocent(url) as inn:
        t0 = time.perf_counter()
        if attack is None:
            n = len(inn.chunks)
            while len(inn.chunks) < n + 150:           # ~150 tokens with nothing else going on
                time.sleep(0.01)
            statuses = []
        else:
            with cf.ThreadPoolExecutor(repeat) as ex:
                send = attack if callable(attack) else (lambda u: post(u, *attack))
                statuses = list(ex.map(lambda _: send(url), range(repeat)))
        t1 = time.perf_counter()
        n = len(inn.chunks)
        while len(inn.chunks) < n + 2:                 # the gap that spans the window's end
            time.sleep(0.005)
        p99, gap = inn.figures(t0, t1)
    return statuses, p99, gap


def check_attacks(url: str, target: str, attacks: dict, repeat: int = REPEAT) -> None:
    """The bounds of the module doc for each attack, against a no-attack baseline measured first."""
    _, base_p99, base_gap = measure(url, None)
    report, failed = [f"{target}: no attack: /health p99 {base_p99:.3f} s, longest gap {base_gap:.3f} s"], []
    for name, attack in attacks.items():
        for attempt in (1, 2):
            statuses, p99, gap = measure(url, attack, repeat)
            report.append(f"{name}{' (again)' if attempt == 2 else ''}: {statuses}, "
                          f"/health p99 {p99:.3f} s, longest gap {gap:.3f} s")
            if not all(s in (400, 413, 429, 431) for s in statuses):
                failed.append(report[-1])      # a wrong answer is never a matter of timing
                break
            # A window holds a few dozen polls, so its p99 is its slowest poll: one preemption of
            # the server by another process on a shared 2-core machine can cross the bound once
            # (CI, c02b802: one Ray row 0.52 s, its neighbours 0.13-0.21 s). A stall the issue is
            # about (seconds, on every copy) misses both windows, so only a second miss fails.
            if p99 < 0.5 and gap < 2 * base_gap + GAP_SLACK:
                break
            if attempt == 2:
                failed.append(report[-1])
    print("\n".join(report))
    assert not failed, "\n".join(report)
    assert httpx.get(url + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize("target", ["replica", "gateway"])
def test_no_attack_stalls_health_or_an_innocent_stream(stack, target):
    check_attacks(stack[target], target, ATTACKS)


@pytest.mark.parametrize("target", ["replica", "gateway"])
def test_a_head_that_never_ends_is_cut_and_stalls_nobody(stack, target):
    """Before server/http_head.py uvicorn read such a header whole, quadratically: 100 MB took 12 s
    of the event loop (/health max 3.3 s) and was answered 200; a 40 MB trailer 2 s (0.9 s)."""
    check_attacks(stack[target], target, {"a header that never ends": lambda u: endless(u, ENDLESS_HEAD),
                                          "a trailer that never ends": lambda u: endless(u, ENDLESS_TRAILER)})


def trickled_get_408(url: str, start: bytes, silent: int = 0) -> None:
    """Three connections send `start` and no more, `silent` ones nothing at all; a request beside
    them is served, then each of the three gets 408 and each silent one is closed unanswered."""
    port = int(url.rsplit(":", 1)[1])
    slow = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(3)]
    quiet = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(silent)]
    for s in slow:
        s.sendall(start)
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=10)
    assert r.status_code == 200
    for s in slow:
        head = s.recv(4096)            # blocks until the server answers: its timeout, 3 s
        assert head.startswith(b"HTTP/1.1 408"), head[:80]
        s.close()
    for s in quiet:
        assert s.recv(10) == b""
        s.close()


@pytest.mark.parametrize("target", ["replica", "gateway"])
def test_slow_or_silent_heads_time_out_and_others_go_on(stack, target):
    """Connections that send their head a piece at a time, or nothing, are closed once
    --header-timeout passes (408 when a head had begun); meanwhile others are served."""
    trickled_get_408(stack[target], b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", silent=1)


def test_slow_body_times_out_and_others_go_on(stack):
    """A body that trickles in gets 408 once --body-timeout passes; meanwhile others are served."""
    trickled_get_408(stack["replica"], b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                       b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")
