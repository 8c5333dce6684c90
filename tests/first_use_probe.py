"""Run `shepherd serve ARGS` (or `shepherd gateway ARGS`) in this process and print (JSON) the modules
that the first request of each kind imported in the server's process: work that would otherwise be
done under the event loop of a fresh server, holding every stream and /health
(tests/test_first_use.py).

    python tests/first_use_probe.py serve --executor sim
    python tests/first_use_probe.py gateway --backend http://127.0.0.1:8000

The server runs in the main thread, as the command does (uvicorn's signal handlers); a client
thread waits for /health, sends one request of each kind, prints what it found, then stops the
server with SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from shepherd.bench.loadgen import free_port, wait_healthy  # noqa: E402
from shepherd.cli import main  # noqa: E402

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
MSG = [{"role": "user", "content": "Say hi."}]


def requests(model: str) -> list[tuple[str, str, dict]]:
    """(label, path, body): one of each kind a client sends."""
    chat = {"model": model, "max_tokens": 4, "messages": MSG}
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(80)]
    return [
        ("completion", "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 4}),
        ("completion logprobs echo", "/v1/completions",
         {"model": model, "prompt": "Hello there", "max_tokens": 2, "logprobs": 2, "echo": True}),
        ("chat", "/v1/chat/completions", chat),
        ("chat stream", "/v1/chat/completions", {**chat, "stream": True}),
        ("chat logprobs", "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2}),
        ("chat, 80 messages (deep enough for the depth scan)", "/v1/chat/completions", {**chat, "messages": many}),
        ("chat tools auto", "/v1/chat/completions", {**chat, "tools": [TOOL], "tool_choice": "auto"}),
        ("chat tools required, streamed", "/v1/chat/completions",
         {**chat, "tools": [TOOL], "tool_choice": "required", "stream": True}),
        ("json_schema", "/v1/chat/completions",
         {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
             "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}}),
        ("guided_choice", "/v1/chat/completions", {**chat, "guided_choice": ["yes", "no"]}),
        ("logit_bias", "/v1/chat/completions", {**chat, "logit_bias": {"10": 5, "11": -5}}),
        ("responses", "/v1/responses", {"model": model, "input": "Say hi.", "max_output_tokens": 4}),
        ("tokenize", "/tokenize", {"model": model, "prompt": "Hello world"}),
        ("detokenize", "/detokenize", {"model": model, "tokens": [1, 2, 3]}),
        ("bad body", "/v1/chat/completions", {"model": model, "messages": "not a list"}),
    ]


def client(url: str, out: dict) -> None:
    try:
        wait_healthy(url, timeout=300)
        c = httpx.Client(base_url=url, timeout=60)
        model = c.get("/v1/models").json()["data"][0]["id"]
        c.post("/v1/completions", json={"model": model, "prompt": "warm", "max_tokens": 1})  # the client's own imports
        for label, path, body in requests(model):
            before = set(sys.modules)
            r = c.post(path, json=body)
            out["statuses"][label] = r.status_code
            new = sorted(m for m in set(sys.modules) - before if not m.startswith(("httpx", "h11", "anyio")))
            if new:
                out["imports"][label] = new
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = repr(e)
    finally:
        print("FIRST-USE " + json.dumps(out), flush=True)
        os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    port = free_port()
    result: dict = {"statuses": {}, "imports": {}}
    threading.Thread(target=client, args=(f"http://127.0.0.1:{port}", result), daemon=True).start()
    main([sys.argv[1], "--port", str(port), "--log-level", "warning", *sys.argv[2:]])
