"""Small fake OpenAI backends and a thread-hosted uvicorn server, for the
gateway tests and benchmarks/gateway_overhead.py. Not a model: each fake
answers with a fixed, deterministic text, and its behaviour is switched by
`FakeBackend.mode`. The server thread (`ServerThread`, `EngineServer` for a
real `build_app` over an Engine), `free_port` and the start waits are the one
copy every test uses."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Optional

import uvicorn

from shepherd.server.guard import BODY_CAP_HEADER

# How long a test gives a `shepherd serve` process to answer /health: a wait, not a bound under
# test. serve answers only once its grammar worker (nice 10) has imported xgrammar; on the Intel
# Xeon (family 6 model 207, 2 cores KVM) a replica took ~20 s beside two busy loops, and a test
# that starts one 66-74 s with another test run beside those.
SERVE_START_S = 240.0

# How long a ServerThread may take to start: a wait, not a bound under test. With warm_grammar_worker
# a build_app server answers only once its grammar worker (nice 10) has imported xgrammar, and gives
# that up to GrammarCheck.wait_ready's 120 s. On the Intel Xeon (family 6 model 207, 2 cores KVM) that
# start took 2.4-2.7 s quiet and 22.5 s beside two busy loops. A server thread that dies fails at once.
START_DEADLINE = 180.0

MODES = ("ok", "fail500", "overload503", "full429", "bad400", "die_before_first", "die_after_first", "hang",
         "close_after_read", "health_fail", "health_slow")


class FakeBackend:
    """ASGI app. mode: ok | fail500 | overload503 | bad400 | die_before_first |
    die_after_first | hang | health_fail (health 500 and requests 500)."""

    def __init__(self, name: str = "fake", chunks: int = 5, chunk_delay: float = 0.0,
                 running: int = 0, waiting: int = 0, kv: float = 0.0, metric_style: str = "vllm") -> None:
        self.name = name
        self.mode = "ok"
        self.chunks = chunks
        self.chunk_delay = chunk_delay
        self.running, self.waiting, self.kv = running, waiting, kv
        self.metric_style = metric_style
        self.requests = 0          # proxied requests received (completions + chat)
        self.active = 0            # requests being answered now
        self.aborted = 0           # streams whose client went away
        self.bodies: list = []
        self.tokenized = 0         # /tokenize calls
        self.auth: list = []       # the Authorization header of each proxied request
        self.body_cap: Optional[int] = None   # named in /health's answer, as shepherd's replicas name theirs
        self._lock = threading.Lock()

    # deterministic payloads ------------------------------------------------------------
    def sse_events(self, body: dict) -> list[bytes]:
        n = int(body.get("max_tokens") or self.chunks)
        out = []
        for i in range(n):
            ev = {"id": "cmpl-fake", "object": "text_completion", "model": self.name,
                  "choices": [{"index": 0, "text": f" tok{i}", "finish_reason": None if i < n - 1 else "length"}]}
            out.append(b"data: " + json.dumps(ev).encode() + b"\n\n")
        out.append(b"data: [DONE]\n\n")
        return out

    def json_answer(self, body: dict) -> bytes:
        n = int(body.get("max_tokens") or self.chunks)
        return json.dumps({"id": "cmpl-fake", "object": "text_completion", "model": self.name,
                           "choices": [{"index": 0, "text": "".join(f" tok{i}" for i in range(n)),
                                        "finish_reason": "length"}],
                           "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}}).encode()

    def metrics_text(self) -> bytes:
        if self.metric_style == "sglang":
            return (f"# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{{model_name=\"m\"}} {self.running}\n"
                    f"sglang:num_queue_reqs{{model_name=\"m\"}} {self.waiting}\n"
                    f"sglang:token_usage{{model_name=\"m\"}} {self.kv}\n").encode()
        return (f"# HELP vllm:num_requests_running running\n# TYPE vllm:num_requests_running gauge\n"
                f"vllm:num_requests_running{{model_name=\"m\"}} {float(self.running)}\n"
                f"vllm:num_requests_waiting{{model_name=\"m\"}} {float(self.waiting)}\n"
                f"vllm:kv_cache_usage_perc{{model_name=\"m\"}} {self.kv}\n").encode()

    # ASGI ---------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                m = await receive()
                if m["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif m["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health":
            if self.mode == "health_slow":          # a busy replica: /health answers, but late
                await asyncio.sleep(1.0)
            st = 500 if self.mode == "health_fail" else 200
            cap = [] if self.body_cap is None else [(BODY_CAP_HEADER.encode(), str(self.body_cap).encode())]
            return await self._json(send, st, {"status": "ok" if st == 200 else "bad"}, headers=cap)
        if path == "/metrics":
            data = self.metrics_text()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain; version=0.0.4")]})
            return await send({"type": "http.response.body", "body": data})
        if path == "/v1/models":
            return await self._json(send, 200, {"object": "list",
                                                "data": [{"id": self.name, "object": "model"}]})
        if path not in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            return await self._json(send, 404, {"error": {"message": "nope"}})
        raw = b""
        while True:
            m = await receive()
            raw += m.get("body", b"")
            if not m.get("more_body"):
                break
        body = json.loads(raw)
        if path == "/tokenize":     # a fake tokenizer: one token per character (chat: role:content lines)
            text = body.get("prompt") or "".join(f"{m['role']}:{m['content']}\n" for m in body.get("messages") or [])
            self.tokenized += 1
            return await self._json(send, 200, {"tokens": [ord(c) for c in text], "count": len(text)})
        with self._lock:
            self.requests += 1
            self.active += 1
            self.bodies.append(body)
            self.auth += [v.decode() for k, v in scope["headers"] if k.lower() == b"authorization"]
        try:
            await self._answer(body, receive, send)
        finally:
            with self._lock:
                self.active -= 1

    async def _answer(self, body, receive, send):
        mode = self.mode
        if mode in ("fail500", "health_fail"):
            return await self._json(send, 500, {"error": {"message": "boom", "type": "internal"}})
        if mode == "overload503":
            return await self._json(send, 503, {"error": {"message": "busy", "type": "overloaded"}})
        if mode == "full429":
            return await self._json(send, 429, {"error": {"message": "full", "type": "rate_limit_error"}},
                                    headers=[(b"retry-after", b"30")])
        if mode == "close_after_read":
            raise RuntimeError("fake backend dies after reading the request, before answering")
        if mode == "bad400":
            return await self._json(send, 400, {"error": {"message": "bad prompt", "type": "invalid_request_error"}})
        if mode == "hang":
            await asyncio.sleep(3600)
        if not body.get("stream"):
            return await self._json(send, 200, raw=self.json_answer(body))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        if mode == "die_before_first":
            raise RuntimeError("fake backend dies before the first chunk")
        gone = asyncio.Event()

        async def watch():
            while True:
                m = await receive()
                if m["type"] == "http.disconnect":
                    gone.set()
                    return
        w = asyncio.ensure_future(watch())
        try:
            for i, ev in enumerate(self.sse_events(body)):
                if gone.is_set():
                    with self._lock:
                        self.aborted += 1
                    return
                await send({"type": "http.response.body", "body": ev, "more_body": True})
                if mode == "die_after_first":
                    raise RuntimeError("fake backend dies after the first chunk")
                if self.chunk_delay:
                    await asyncio.sleep(self.chunk_delay)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            w.cancel()

    async def _json(self, send, status, obj=None, raw: Optional[bytes] = None, headers=()):
        data = raw if raw is not None else json.dumps(obj).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode())] + list(headers)})
        await send({"type": "http.response.body", "body": data})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving an ASGI app in a background thread: `.start()` / `.stop()`, or `with`."""

    def __init__(self, app, port: Optional[int] = None, lifespan: str = "on", http="auto") -> None:
        self.app = app
        self.port = port or free_port()
        self.lifespan = lifespan
        self.http = http        # uvicorn's HTTP protocol: a name or a class (server/http_head.py)
        self.server: Optional[uvicorn.Server] = None
        self.thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerThread":
        cfg = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="critical",
                             access_log=False, lifespan=self.lifespan, timeout_graceful_shutdown=1, http=self.http)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + START_DEADLINE
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("server thread died before it started")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start in {START_DEADLINE:.0f} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.server.force_exit = True
        if self.thread is not None:
            self.thread.join(timeout=30)
        self.server = None
        self.thread = None

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class EngineServer(ServerThread):
    """The real OpenAI API (`build_app`) over an in-process Engine; `.engine` for the tests that
    look inside it."""

    def __init__(self, engine, server_cfg=None) -> None:
        from shepherd.config import ServerConfig
        from shepherd.server.openai_api import build_app
        self.engine = engine
        super().__init__(build_app(engine, server_cfg or ServerConfig()))
