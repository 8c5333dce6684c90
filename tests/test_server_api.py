"""The OpenAI-compatible HTTP API, in process: a uvicorn server on a free port
in a thread, over an Engine with a scripted executor (deterministic text) or
the simulated executor, both with the real tokenizer. No model weights."""
from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
import pytest

from shepherd.config import EngineConfig, SchedulerConfig, ServerConfig
from shepherd.engine.engine import Engine
from shepherd.model.loader import load_tokenizer
from shepherd.server.openai_api import build_app

try:
    from gateway_fakes import EngineServer
    from test_engine import TEXT, ScriptedExecutor
except ImportError:  # pragma: no cover - when tests/ is a package
    from tests.gateway_fakes import EngineServer
    from tests.test_engine import TEXT, ScriptedExecutor


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def scripted(tok):
    ex = ScriptedExecutor(tok, tok.encode(TEXT), kv_capacity=4096, max_model_len=2048, delay=0.002)
    engine = Engine(EngineConfig(executor="sim", watchdog_timeout=60), executor=ex, tokenizer=tok)
    with EngineServer(engine) as srv:
        srv.executor = ex
        yield srv


@pytest.fixture(scope="module")
def client(scripted):
    with httpx.Client(base_url=scripted.url, timeout=30) as c:
        yield c


def sse_events(text: str) -> list:
    """Parse an SSE body strictly: only `data: ...` events separated by blank lines."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = text.split("\n\n")
    assert events[-1] == ""
    out = []
    for e in events[:-1]:
        assert e.startswith("data: "), e
        payload = e[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1]
    return out[:-1]


def wait_idle(engine, timeout=5.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = engine.stats()
        if st.num_running == 0 and st.num_waiting == 0 and st.kv_used == 0:
            return st
        time.sleep(0.01)
    raise AssertionError(f"not idle after {timeout}s: {engine.stats()}")


def model_id(client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


# ---------------------------------------------------------------- happy paths
def test_health_models_metrics(client, scripted):
    assert client.get("/health").status_code == 200
    m = client.get("/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == "scripted"
    assert m["data"][0]["max_model_len"] == 2048
    r = client.get("/metrics")
    assert r.status_code == 200
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "shepherd:kv_capacity_tokens"):
        assert name in r.text


def test_completion_non_stream(client, tok):
    r = client.post("/v1/completions", json={"model": "scripted", "prompt": "Say hi", "max_tokens": 200})
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["object"] == "text_completion" and b["id"].startswith("cmpl-")
    assert b["choices"][0]["text"] == TEXT
    assert b["choices"][0]["finish_reason"] == "stop"
    u = b["usage"]
    assert u["prompt_tokens"] == len(tok.encode("Say hi"))
    assert u["completion_tokens"] == len(tok.encode(TEXT)) + 1  # + EOS
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_completion_default_max_tokens_is_16(client):
    b = client.post("/v1/completions", json={"prompt": "x"}).json()
    assert b["usage"]["completion_tokens"] == 16 and b["choices"][0]["finish_reason"] == "length"


def test_completion_stream_format_and_usage(client):
    with client.stream("POST", "/v1/completions", json={
            "model": "scripted", "prompt": "Say hi", "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = sse_events(body)
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert all(c["usage"] is None for c in chunks)
    assert all(c["object"] == "text_completion" for c in events)
    assert len({c["id"] for c in events}) == 1
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert TEXT.startswith(text) and text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_stream_continuous_usage_stats(client, tok):
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it): every chunk carries its
    choice's usage so far, the chat's opening chunk none made yet; without include_usage, none."""
    prompt = len(tok.encode("Say hi"))
    with client.stream("POST", "/v1/completions", json={
            "prompt": "Say hi", "max_tokens": 5, "n": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        *chunks, last = sse_events(r.read().decode())
    made = {0: 0, 1: 0}
    for c in chunks:
        u, i = c["usage"], c["choices"][0]["index"]
        assert u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"]
        assert u["completion_tokens"] > made[i]         # one token a chunk here: it grows with each
        made[i] = u["completion_tokens"]
    assert made == {0: 5, 1: 5} and last["usage"]["completion_tokens"] == 10
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        *chunks, last = sse_events(r.read().decode())
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts[0] == 0 and counts[-1] == 4 and counts == sorted(counts)
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {last["usage"]["prompt_tokens"]}
    with client.stream("POST", "/v1/completions", json={
            "prompt": "Say hi", "max_tokens": 3, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}) as r:
        assert all("usage" not in e for e in sse_events(r.read().decode()))


def test_completion_return_token_ids(client, tok):
    """vLLM's return_token_ids: the prompt's ids and the answer's (EOS included, as vLLM's), whole
    or as each chunk's delta, so a client can send the next turn as prompt + answer ids."""
    prompt, script = tok.encode("Say hi"), tok.encode(TEXT)
    eos = tok.eos_token_ids[0]
    b = client.post("/v1/completions", json={"prompt": "Say hi", "max_tokens": 200, "return_token_ids": True}).json()
    c = b["choices"][0]
    assert c["prompt_token_ids"] == prompt and c["token_ids"] == script + [eos]
    assert "token_ids" not in client.post("/v1/completions", json={"prompt": "Say hi", "max_tokens": 2}).json()["choices"][0]
    with client.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 7, "stream": True,
                                                        "return_token_ids": True}) as r:
        chunks = sse_events(r.read().decode())
    cs = [k["choices"][0] for k in chunks]
    assert cs[0]["prompt_token_ids"] == prompt and all(k["prompt_token_ids"] is None for k in cs[1:])
    assert [t for k in cs for t in k["token_ids"]] == script[:7]
    assert tok.decode(script[:7]) == "".join(k["text"] for k in cs)


def test_chat_non_stream(client):
    r = client.post("/v1/chat/completions", json={
        "model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200})
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["object"] == "chat.completion" and b["id"].startswith("chatcmpl-")
    c = b["choices"][0]
    assert c["message"] == {"role": "assistant", "content": TEXT}
    assert c["finish_reason"] == "stop"
    assert b["usage"]["prompt_tokens"] > 5


def test_chat_stream_format(client):
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 200, "stream": True}) as r:
        assert r.status_code == 200
        body = r.read().decode()
    events = sse_events(body)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert all("usage" not in e for e in events)  # no include_usage: no usage key
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == TEXT
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_n2_distinct_choices(client):
    b = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "n": 2, "seed": 7}).json()
    assert sorted(c["index"] for c in b["choices"]) == [0, 1]
    assert b["usage"]["completion_tokens"] == 8
    b = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 3, "n": 2}).json()
    assert [c["index"] for c in b["choices"]] == [0, 1]
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r.read().decode())
    finished = [e["choices"][0]["index"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]
    assert events[-1]["usage"]["completion_tokens"] == 6


def test_n_seeds_are_distinct(scripted, client):
    """Each of the n requests gets its own seed derived from the request's seed."""
    seen = []
    orig = scripted.engine.submit

    def spy(prompt_ids, params, **kw):
        seen.append(params.seed)
        return orig(prompt_ids, params, **kw)

    scripted.engine.submit = spy
    try:
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": 3, "seed": 100})
    finally:
        scripted.engine.submit = orig
    assert seen == [100, 101, 102]


def test_stop_strings_spanning_tokens(client):
    b = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 100, "stop": ["world, th"]}).json()
    assert b["choices"][0]["text"] == "Hello " and b["choices"][0]["finish_reason"] == "stop"
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 100, "stop": "s a te",
            "stream": True}) as r:
        events = sse_events(r.read().decode())
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == "Hello world, this i"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_reason_include_stop_str_and_echo(client, tok):
    b = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 100, "stop": ["world, th"],
                                             "include_stop_str_in_output": True}).json()
    c = b["choices"][0]
    assert c["text"] == "Hello world, th" and c["stop_reason"] == "world, th" and c["finish_reason"] == "stop"
    stop_id = tok.encode(TEXT)[3]
    b = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 100, "stop_token_ids": [stop_id]}).json()
    assert b["choices"][0]["stop_reason"] == stop_id
    b = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4}).json()
    assert b["choices"][0]["stop_reason"] is None and b["choices"][0]["finish_reason"] == "length"
    b = client.post("/v1/completions", json={"prompt": "Echo me", "max_tokens": 2, "echo": True}).json()
    assert b["choices"][0]["text"].startswith("Echo me")
    with client.stream("POST", "/v1/completions", json={"prompt": "Echo me", "max_tokens": 2, "echo": True,
                                                        "stream": True}) as r:
        events = sse_events(r.read().decode())
    assert events[0]["choices"][0]["text"] == "Echo me"
    assert "".join(e["choices"][0]["text"] for e in events) == b["choices"][0]["text"]


def test_logprobs_formats(client):
    b = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "logprobs": 2}).json()
    lp = b["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert "".join(lp["tokens"]) == b["choices"][0]["text"]
    assert lp["text_offset"][0] == 0 and all(len(t) == 2 for t in lp["top_logprobs"])
    b = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 3, "logprobs": True, "top_logprobs": 1}).json()
    content = b["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert {"token", "logprob", "bytes", "top_logprobs"} <= set(content[0])
    assert len(content[0]["top_logprobs"]) == 1
    b = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 2}).json()
    assert b["choices"][0]["logprobs"] is None


def test_client_and_priority_reach_the_request(scripted, client):
    seen = []
    orig = scripted.engine.submit

    def spy(prompt_ids, params, **kw):
        seen.append((kw.get("client"), kw.get("priority")))
        return orig(prompt_ids, params, **kw)

    scripted.engine.submit = spy
    try:
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "user": "alice", "priority": 3})
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Client-Id": "bob"})
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    finally:
        scripted.engine.submit = orig
    assert seen == [("alice", 3), ("bob", 0), ("default", 0)]


def test_vllm_extras_accepted(client, tok):
    stop_id = tok.encode(TEXT)[3]
    b = client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 100, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
        "stop_token_ids": [stop_id], "seed": 1, "ignore_eos": False, "unknown_field": 1}).json()
    assert b["choices"][0]["text"] == "Hello world," and b["choices"][0]["finish_reason"] == "stop"
    b = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 30, "ignore_eos": True}).json()
    assert b["usage"]["completion_tokens"] == 30 and b["choices"][0]["finish_reason"] == "length"


def _null_fields(route: str, schema: dict) -> list[str]:
    """The body fields of `route` that are optional with a default other than null."""
    ref = schema["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    props = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]
    return [k for k, p in props.items() if p.get("default") is not None]


def test_large_bodies_are_validated_in_the_work_thread(client, monkeypatch):
    """Validating a body holds the GIL for as long as it takes, which grows with its items (a
    1.4 MB chat of 44,000 empty messages: 110-220 ms), so a body of 64 KiB or more is validated in
    the work thread, and answered as it would be on the loop: the same 200, the same 400s."""
    import threading

    from shepherd.server.protocol import ChatCompletionRequest, CompletionRequest
    threads = []
    for cls in (ChatCompletionRequest, CompletionRequest):
        real = cls.model_validate.__func__

        def spy(klass, obj, *a, _real=real, **k):
            threads.append(threading.current_thread().name)
            return _real(klass, obj, *a, **k)
        monkeypatch.setattr(cls, "model_validate", classmethod(spy))
    small = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "logit_bias": {"5": 1.0}}).json()
    assert threads == []                       # a small body: FastAPI's own validation, on the loop
    big = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3,
                                               "logit_bias": {str(i): 0.0 for i in range(10_000)}})
    assert big.status_code == 200 and big.json()["choices"][0]["text"] == small["choices"][0]["text"]
    assert len(threads) == 1 and threads[0].startswith("shepherd-work")
    msgs = [{"role": "user", "content": "hello there"}] * 2000 + [{"role": "wizard", "content": "x"}]  # 84 KB
    r = client.post("/v1/chat/completions", json={"messages": msgs})
    one = client.post("/v1/chat/completions", json={"messages": msgs[-1:]}).json()["error"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages" == one["param"]
    assert r.json()["error"]["message"] == one["message"].replace("messages.0.", "messages.2000."), r.text
    assert len(threads) == 2 and threads[1].startswith("shepherd-work")
    # and the template's work grows with the messages, not only their text: many empty ones are
    # rendered in the worker too (they were rendered inline, their cost counted as 0 characters)
    from shepherd.server import tools
    rendered, real_render = [], tools.render_messages
    monkeypatch.setattr(tools, "render_messages",
                        lambda *a: rendered.append(threading.current_thread().name) or real_render(*a))
    for n in (2, 1000):
        client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": ""}] * n,
                                                  "max_tokens": 1})
    assert not rendered[0].startswith("shepherd-work")       # two messages: inline
    assert rendered[1].startswith("shepherd-work"), rendered


def test_whole_numbers_are_integers(client):
    """JSON Schema, which /openapi.json is, and vLLM read 3.0 as the integer 3: a schema-driven
    client sent such numbers for every integer field and got 400s (a fraction still is one)."""
    b = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3.0, "n": 2.0, "priority": 0.0,
                                             "min_tokens": 0.0, "logprobs": 1.0}).json()
    assert len(b["choices"]) == 2 and b["usage"]["completion_tokens"] == 6, b
    assert all(len(c["logprobs"]["top_logprobs"][0]) == 1 for c in b["choices"])
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                  "max_completion_tokens": 2.0, "top_k": 5.0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_the_schema_states_the_stop_list_limit(client):
    """/openapi.json says what is served: a schema-driven client that keeps to it is not refused
    (stop had no maxItems, and 50 stop strings were a 400)."""
    props = client.get("/openapi.json").json()["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    limit = next(b["maxItems"] for b in props["stop"]["anyOf"] if b.get("type") == "array")
    msgs = [{"role": "user", "content": "x"}]
    assert client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2,
                                                     "stop": [f"s{i}" for i in range(limit)]}).status_code == 200
    r = client.post("/v1/chat/completions", json={"messages": msgs, "stop": [f"s{i}" for i in range(limit + 1)]})
    assert r.status_code == 400 and r.json()["error"]["message"] == f"stop: at most {limit} stop sequences"


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}),
    ("/v1/responses", {"input": "x", "max_output_tokens": 3}),
])
def test_null_means_the_default(client, route, body):
    """OpenAI declares its optional fields "or null", and the official client sends `"n": null` for
    n=None: every such field sent as null is served as its default, and the schema says null is
    accepted (a schema-driven client sends what the schema allows)."""
    schema = client.get("/openapi.json").json()
    fields = _null_fields(route, schema)
    assert ({"stream", "parallel_tool_calls"} if route == "/v1/responses"
            else {"n", "stream", "presence_penalty"}) <= set(fields)
    plain = client.post(route, json=body)
    assert plain.status_code == 200, plain.text
    for f in fields:
        r = client.post(route, json={**body, f: None})
        assert r.status_code == 200, (f, r.text)
        key = "output" if route == "/v1/responses" else "choices"
        assert len(r.json()[key]) == len(plain.json()[key]), f
    ref = schema["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    props = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]
    assert all({"type": "null"} in props[f]["anyOf"] for f in fields)
    # a required field stays required
    required = "prompt" if route == "/v1/completions" else "messages" if "chat" in route else "input"
    r = client.post(route, json={**body, required: None})
    assert r.status_code == 400 and r.json()["error"]["param"] == required


def test_token_id_prompts_and_batch(client):
    b = client.post("/v1/completions", json={"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2, "n": 2}).json()
    assert [c["index"] for c in b["choices"]] == [0, 1, 2, 3]
    assert b["usage"]["prompt_tokens"] == 5


# ---------------------------------------------------------------- bad input
BAD = [
    ("/v1/completions", {"model": "nope", "prompt": "x"}, "model"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {"prompt": list(range(100, 2200))}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {"prompt": "word " * 10000}, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": "3"}, "n"),                   # strict types, as OpenAI
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": True}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"prompt": "x", "echo": "true"}, "echo"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 5e-324}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(50000)}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {"prompt": [10 ** 9]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/chat/completions", {"max_tokens": 3}, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1},
     "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 3000}]}, "messages"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": "yes please"},
     "stream"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_400(client, scripted, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    # still serving
    assert client.get("/health").status_code == 200
    ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\xff\xfe", b'"just a string"'])
def test_malformed_json_400(client, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"]
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("raw,param", [('{"prompt": "x", "temperature": NaN}', "temperature"),
                                       ('{"prompt": "x", "min_p": Infinity}', "min_p"),
                                       ('{"prompt": "x", "presence_penalty": -Infinity}', "presence_penalty")])
def test_non_finite_numbers_400(client, raw, param):
    """Python's json accepts NaN/Infinity; they must not reach the sampler."""
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_tiny_temperature_is_greedy(client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "temperature": 1e-30})
    assert r.status_code == 200
    assert client.get("/health").status_code == 200


def test_unknown_route_has_error_body(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_an_unexpected_error_is_a_500_and_the_connection_goes_on(scripted, monkeypatch):
    """A bug in a handler is a 500 with an error body, and the client's connection stays usable:
    Starlette raises the error again after the 500, and uvicorn then closed the connection, so the
    next request a client sent on it (a pooled keep-alive one) failed with a reset."""
    from shepherd.server import openai_api

    def broken(*_a, **_k):
        raise RuntimeError("a bug")
    monkeypatch.setattr(openai_api.ApiContext, "client_of", staticmethod(broken))
    host, port = scripted.url.split("//")[1].split(":")
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    post = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    get = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        f = s.makefile("rb")

        def answer() -> tuple[int, bytes]:
            status = int(f.readline().split()[1])
            length = 0
            while (line := f.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            return status, f.read(length)
        s.sendall(post)
        status, text = answer()
        assert status == 500 and json.loads(text)["error"]["type"] == "server_error"
        s.sendall(get)                         # the same connection
        assert answer()[0] == 200


def test_logprob_answers_are_bounded(tok):
    """A non-streamed answer is held whole until sent: past --max-logprob-entries it is a 400 whose
    requests are aborted (before any work when the prompts' logprobs alone pass it); a streamed
    answer and a smaller one are served whole."""
    ex = ScriptedExecutor(tok, tok.encode(TEXT), delay=0.001)
    engine = Engine(EngineConfig(executor="sim"), executor=ex, tokenizer=tok)
    with EngineServer(engine, ServerConfig(max_logprob_entries=100)) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        chat = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "logprobs": True, "top_logprobs": 2,
                "ignore_eos": True}
        r = c.post("/v1/chat/completions", json={**chat, "max_tokens": 40})      # 2 x 40 x 3 = 240 entries
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "request_too_large", r.text
        assert "--max-logprob-entries" in err["message"] and "stream" in err["message"]
        wait_idle(engine)                                    # its two requests were aborted
        r = c.post("/v1/chat/completions", json={**chat, "max_tokens": 10})      # 60 entries
        assert r.status_code == 200, r.text
        for ch in r.json()["choices"]:
            content = ch["logprobs"]["content"]
            assert len(content) == 10 and all(len(t["top_logprobs"]) == 2 for t in content)
        r = c.post("/v1/chat/completions", json={**chat, "max_tokens": 40, "stream": True})
        chunks = [e for e in sse_events(r.text) if e["choices"] and e["choices"][0]["logprobs"]]
        assert r.status_code == 200 and sum(len(e["choices"][0]["logprobs"]["content"]) for e in chunks) == 80
        # echo: the prompt's logprobs alone are 40 x 3 entries, known before any work: nothing admitted
        def admitted_prompt_tokens() -> float:
            m = re.search(r"^vllm:prompt_tokens_total\{[^}]*\} (\S+)$", c.get("/metrics").text, re.M)
            return float(m.group(1))
        before = admitted_prompt_tokens()
        r = c.post("/v1/completions", json={"prompt": list(range(1, 41)), "echo": True, "logprobs": 2,
                                            "max_tokens": 1})
        assert r.status_code == 400 and "prompts' logprobs alone" in r.json()["error"]["message"], r.text
        assert engine.stats().num_waiting == engine.stats().num_running == 0
        assert admitted_prompt_tokens() == before


def test_a_stream_nobody_reads_is_cut(tok):
    """A streamed answer whose client stops reading is cut once what waits unsent passes
    --max-logprob-entries (tokens and logprob entries): its requests end with an error, long
    before all their tokens, without the client reading a byte. A client that reads gets the
    same kind of answer whole. (The cut stream's own tail, the error event and [DONE], is not
    read back: through the 4 KB window that takes minutes of delayed ACKs.)"""
    ex = ScriptedExecutor(tok, tok.encode(TEXT), delay=0.001)
    engine = Engine(EngineConfig(executor="sim"), executor=ex, tokenizer=tok)
    # ~16 MB of events: past what the sockets' buffers take, whatever the kernel's sizes
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 16, "logprobs": True, "top_logprobs": 2,
            "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with EngineServer(engine, ServerConfig(max_logprob_entries=5000)) as srv:
        raw = json.dumps(body).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)    # before connect: a small window
        s.connect(("127.0.0.1", srv.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
        deadline = time.monotonic() + 30
        while engine.stats().num_running < 16:           # admitted: all 16 choices run
            assert time.monotonic() < deadline, engine.stats()
            time.sleep(0.01)
        wait_idle(engine, timeout=60)                   # then cut while the client has read nothing
        m = httpx.get(srv.url + "/metrics").text
        s.close()
        ended = re.search(r'^vllm:request_success_total\{finished_reason="error"[^}]*\} (\S+)$', m, re.M)
        made = re.search(r'^vllm:generation_tokens_total\{[^}]*\} (\S+)$', m, re.M)
        assert ended and float(ended.group(1)) == 16, m
        assert made and float(made.group(1)) < 16 * 2000 / 2, made.group(0)
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            events = sse_events(c.post("/v1/chat/completions", json={**body, "max_tokens": 300}).text)
        assert not any("error" in e for e in events)
        assert sum(len(e["choices"][0]["logprobs"]["content"]) for e in events
                   if e["choices"] and e["choices"][0]["logprobs"]) == 16 * 300


def test_large_answer_arrives_whole(client, tok):
    """An answer of many chunks (logprobs) is sent with its Content-Length and parses whole."""
    from shepherd.server.common import ANSWER_CHUNK
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1500, "ignore_eos": True, "logprobs": 2,
                                             "n": 8})
    assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content) > 2 * ANSWER_CHUNK
    for ch in r.json()["choices"]:
        lp = ch["logprobs"]
        assert len(lp["tokens"]) == len(lp["top_logprobs"]) == 1500 and ch["text"].startswith("".join(lp["tokens"][:5]))
        assert all(len(t) == 2 for t in lp["top_logprobs"])


def test_answers_encode_as_starlette_does():
    """Answers are encoded a slice at a time (common.json_pieces, so the event loop is never held
    for a whole large answer); the bytes are exactly JSONResponse's, callables rendered in place."""
    import random

    from starlette.responses import JSONResponse

    from shepherd.server.common import JSON_SLICE, json_chunks
    rng = random.Random(7)

    def json_bytes(obj) -> bytes:
        return b"".join(json_chunks(obj))

    def value(depth):
        r = rng.random()
        if depth == 0 or r < 0.3:
            return rng.choice([1, -2.5, 'q"\u00e9\\', None, True, 1e-300, "\U0001d11e", ""])
        if r < 0.6:
            return {f"k{i}": value(depth - 1) for i in range(rng.randrange(4))}
        if r < 0.9:
            return [value(depth - 1) for _ in range(rng.randrange(4))]
        return [value(0) for _ in range(rng.choice([JSON_SLICE - 1, JSON_SLICE, JSON_SLICE + 1, 3 * JSON_SLICE]))]

    for _ in range(500):
        obj = value(7)
        assert json_bytes(obj) == JSONResponse(obj).body
    big = [{"t": i, "top": {str(j): -j / 3 for j in range(5)}} for i in range(2 * JSON_SLICE + 5)]
    assert json_bytes({"choices": [lambda: {"logprobs": big}]}) == JSONResponse({"choices": [{"logprobs": big}]}).body
    many = [{"index": i, "logprobs": big[:3]} for i in range(JSON_SLICE + 3)]
    lazy = [(lambda c=c: c) for c in many]     # an answer of 256 or more choices, each built in turn
    assert json_bytes({"choices": lazy}) == JSONResponse({"choices": many}).body


def test_an_answer_of_256_choices_is_served(client):
    """prompts x n of 256 or more (here 2 x 128), not streamed: one choice each, in order (the
    long-list slicing once met the choices' lazy builders, a 500 after all the work was done)."""
    r = client.post("/v1/completions", json={"prompt": [[1, 2], [3]], "n": 128, "max_tokens": 1})
    assert r.status_code == 200, r.text[:300]
    assert [c["index"] for c in r.json()["choices"]] == list(range(256))


# ---------------------------------------------------------------- disconnects
def test_stream_disconnect_aborts_and_frees_kv(scripted):
    engine = scripted.engine
    with httpx.Client(base_url=scripted.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 1500, "ignore_eos": True,
                                                       "stream": True}) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                    if got >= 3:
                        break
            assert engine.stats().num_running == 1
    st = wait_idle(engine, timeout=1.0)   # generating all 1500 tokens would take > 3 s
    assert st.kv_free + st.kv_evictable == st.kv_capacity
    m = httpx.get(scripted.url + "/metrics").text
    assert re.search(r'^vllm:num_requests_running\{[^}]*\} 0\.0$', m, re.M)


def test_non_stream_disconnect_aborts(scripted):
    engine = scripted.engine
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(scripted.url + "/v1/completions",
                   json={"prompt": "x", "max_tokens": 1500, "ignore_eos": True}, timeout=0.3)
    wait_idle(engine, timeout=1.0)   # generating all 1500 tokens would take > 3 s
    m = httpx.get(scripted.url + "/metrics").text
    assert re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} [1-9]', m, re.M), m


# ---------------------------------------------------------------- auth
def test_api_key_auth(tok):
    ex = ScriptedExecutor(tok, tok.encode(TEXT))
    engine = Engine(EngineConfig(executor="sim"), executor=ex, tokenizer=tok)
    with EngineServer(engine, ServerConfig(api_key="sekret")) as srv, httpx.Client(base_url=srv.url) as c:
        body = {"prompt": "x", "max_tokens": 2}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["message"]
        r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert c.get("/v1/models").status_code == 401
        r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        assert c.get("/version").status_code == 200
        # the key comes first: a malformed body, or one too deep, without the key is 401, not 400
        for raw in (b"{not json", b"[" * 100000, b'{"prompt": "a\\ud800"}'):
            r = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 401, (raw[:20], r.status_code)
        for path in ("/tokenize", "/detokenize", "/v1/responses", "/v1/models/x"):
            assert c.request("POST" if "model" not in path else "GET", path, json={}).status_code == 401
        # a large body without the key is refused before it is read: declared 100 MB, 13 bytes sent
        head = raw_post(srv.port, 100_000_000, b'{"prompt": "a')
        assert head.startswith(b"HTTP/1.1 401"), head[:60]
        head = raw_post(srv.port, 100_000_000, b'{"prompt": "a', b"Authorization: Bearer sekret\r\n")
        assert head.startswith(b"HTTP/1.1 413"), head[:60]          # with the key: over the size cap


def raw_post(port: int, declared: int, part: bytes, extra: bytes = b"") -> bytes:
    """POST that declares `declared` bytes and sends `part`; the server's answer head (it must
    answer without waiting for the rest)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra +
                  b"Content-Length: " + str(declared).encode() + b"\r\n\r\n" + part)
        return s.recv(4096)


# ---------------------------------------------------------------- limits, sim executor
def test_429_with_retry_after_and_nothing_lost(tok):
    ex = ScriptedExecutor(tok, tok.encode(TEXT), delay=0.01)
    cfg = EngineConfig(executor="sim", scheduler=SchedulerConfig(max_batch_size=1, max_queue=1, max_concurrency=2))
    engine = Engine(cfg, executor=ex, tokenizer=tok)

    async def fire(url, n):
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json={
                "prompt": f"p{i}", "max_tokens": 8, "ignore_eos": True}) for i in range(n)))

    with EngineServer(engine) as srv:
        rs = asyncio.run(fire(srv.url, 12))
        codes = [r.status_code for r in rs]
        assert 429 in codes and 200 in codes, codes
        assert set(codes) <= {200, 429}
        for r in rs:
            if r.status_code == 429:
                assert int(r.headers["Retry-After"]) >= 1
                assert r.json()["error"]["type"] == "rate_limit_error"
            else:
                b = r.json()
                assert b["choices"][0]["finish_reason"] == "length"
                assert b["usage"]["completion_tokens"] == 8
        wait_idle(engine)
        assert httpx.get(srv.url + "/health").status_code == 200


def test_sim_executor_server_with_openai_client(tok):
    import openai
    engine = Engine(EngineConfig(executor="sim", max_total_tokens=4096))
    with EngineServer(engine) as srv:
        oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        mid = oc.models.list().data[0].id
        r = oc.chat.completions.create(model=mid, messages=[{"role": "user", "content": "hello"}], max_tokens=8,
                                       n=2)
        assert len(r.choices) == 2 and r.usage.completion_tokens >= 2
        chunks = list(oc.completions.create(model=mid, prompt="hello", max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
        with pytest.raises(openai.BadRequestError):
            oc.completions.create(model=mid, prompt="hello", max_tokens=0)
        wait_idle(engine)


def test_engine_crash_gives_503_and_error(tok):
    ex = ScriptedExecutor(tok, tok.encode(TEXT), fail_at=2)
    engine = Engine(EngineConfig(executor="sim"), executor=ex, tokenizer=tok)
    with EngineServer(engine) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 50})
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
        assert r.status_code == 503 and r.json()["error"]["message"]


def test_http_side_responsive_while_engine_busy(tok):
    ex = ScriptedExecutor(tok, tok.encode(TEXT), delay=0.2)   # slow steps, like a big model
    engine = Engine(EngineConfig(executor="sim"), executor=ex, tokenizer=tok)
    with EngineServer(engine) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": True,
                                                       "ignore_eos": True}) as r:
            next(r.iter_lines())
            worst = 0.0
            for _ in range(5):
                t0 = time.monotonic()
                assert c.get("/health").status_code == 200
                assert c.get("/metrics").status_code == 200
                worst = max(worst, time.monotonic() - t0)
            assert worst < 0.15, worst


@pytest.mark.parametrize("args,needle", [
    (["--max-batch-size", "0"], "max_batch_size must be >= 1"),
    (["--kv-cache-memory-fraction", "1.5"], "--kv-cache-memory-fraction"),
    (["--max-total-tokens", "100", "--page-size", "16"], "multiple of page_size"),
    (["/no/such/model.gguf"], "does not exist"),
    (["--watchdog-timeout", "0"], "--watchdog-timeout"),
])
def test_serve_config_errors_exit_2(args, needle):
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "shepherd", "serve", "--executor", "sim", *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "shepherd serve: error:" in p.stderr and needle in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("args,needle", [
    (["--max-batch-size", "0"], "max_batch_size must be >= 1"),
    (["--max-num-tokens", "0"], "max_num_tokens must be >= 1"),
    (["--max-prefill-tokens-with-decodes", "-1"], "max_prefill_tokens_with_decodes must be >= 0"),
    (["--max-prefill-ms-with-decodes", "-1"], "max_prefill_ms_with_decodes must be a finite number >= 0"),
    (["--policy", "fcfs", "--max-queue", "0"], "max_queue must be >= 1"),
    (["--speculative-config", '{"method": "draft_model", "model": "/no/such/draft.gguf"}'],
     "draft model path '/no/such/draft.gguf' does not exist"),
    # NaN passed the `<= 0` comparisons these had
    (["--body-timeout", "nan"], "--body-timeout must be > 0 seconds, got nan"),
    (["--grammar-timeout", "nan"], "--grammar-timeout must be > 0 seconds, got nan"),
])
def test_scheduler_knobs_are_checked_before_anything_loads(args, needle):
    # build_configs runs before the engine is built; a scheduler knob it let through was reported
    # only once the model had loaded (seconds, for a large model)
    import argparse

    from shepherd.server import serve_cli
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    with pytest.raises(serve_cli.ConfigError, match=needle):
        serve_cli.build_configs(p.parse_args(args))
    serve_cli.build_configs(p.parse_args(["--page-size", "16"]))   # the stand-in capacity is whole pages


def test_serve_on_a_taken_port_exits_2_before_the_engine_starts():
    import subprocess
    import sys
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "shepherd", "serve", "--executor", "sim", "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert f"shepherd serve: error: cannot listen on 127.0.0.1 port {port}" in p.stderr, p.stderr[-2000:]
    assert "KV cache" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_mixed_load_with_disconnects_leaves_nothing_behind(tok):
    """Many concurrent requests, streaming and not, some clients vanishing mid-way:
    afterwards the scheduler is idle, all KV is back, and the engine tracks nothing."""
    ex = ScriptedExecutor(tok, tok.encode(TEXT * 4), delay=0.003)
    cfg = EngineConfig(executor="sim", scheduler=SchedulerConfig(max_batch_size=8, max_total_tokens=4096))
    engine = Engine(cfg, executor=ex, tokenizer=tok)

    async def one(c, i):
        body = {"prompt": f"request {i} " * (1 + i % 5), "max_tokens": 5 + (i * 7) % 60, "ignore_eos": i % 2 == 0,
                "stream": i % 3 != 0, "n": 1 + (i % 4 == 0), "stop": ["zzz"] if i % 5 == 0 else None}
        timeout = 0.05 + (i % 4) * 0.05 if i % 6 == 1 else 60
        try:
            if body["stream"]:
                async with c.stream("POST", "/v1/completions", json=body, timeout=timeout) as r:
                    assert r.status_code == 200
                    n = 0
                    async for line in r.aiter_lines():
                        n += 1
                        if i % 7 == 3 and n > 4:
                            return "left"
                    return "done"
            r = await c.post("/v1/completions", json=body, timeout=timeout)
            assert r.status_code == 200, r.text
            return "done"
        except httpx.TimeoutException:
            return "timeout"

    async def fire(url):
        async with httpx.AsyncClient(base_url=url) as c:
            return await asyncio.gather(*(one(c, i) for i in range(48)))

    with EngineServer(engine) as srv:
        results = asyncio.run(fire(srv.url))
        assert results.count("done") >= 20
        st = wait_idle(engine, timeout=10)
        assert st.kv_free + st.kv_evictable == st.kv_capacity
        t0 = time.monotonic()
        while engine.outputs.tracks and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert not engine.outputs.tracks
        engine.scheduler.check_integrity()


def test_never_admissible_is_400_naming_the_limit(tok):
    ex = ScriptedExecutor(tok, tok.encode(TEXT), delay=0.005)
    cfg = EngineConfig(executor="sim", scheduler=SchedulerConfig(max_concurrency=2, max_queue=8))
    engine = Engine(cfg, executor=ex, tokenizer=tok)
    with EngineServer(engine) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 500, "ignore_eos": True, "n": 3})
        assert r.status_code == 400 and "--max-concurrency 2" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": ["x"] * 9, "max_tokens": 2})
        assert r.status_code == 400 and "--max-concurrency" in r.json()["error"]["message"]
        wait_idle(engine, timeout=2)
        assert not engine.outputs.tracks
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "n": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2



def test_serve_answers_only_once_its_grammar_worker_is_up(tok):
    """`shepherd serve` starts the grammar worker with the server; its import takes a core for
    seconds, so the server waits for it before answering: the first requests do not share the
    CPU with it, and the first structured request does not wait for it."""
    ex = ScriptedExecutor(tok, tok.encode(TEXT), kv_capacity=4096, max_model_len=2048, delay=0.002)
    engine = Engine(EngineConfig(executor="sim", watchdog_timeout=60), executor=ex, tokenizer=tok)
    with EngineServer(engine, ServerConfig(warm_grammar_worker=True)) as srv:
        assert srv.app.state.grammars.ready, "the server answered before its grammar worker was up"
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
            r = c.post("/v1/chat/completions", json={
                "model": "scripted", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
            assert r.status_code == 200, r.text


def test_streamed_chunks_are_the_json_of_the_whole_event():
    """sse_chunker encodes a stream's head once; a client must still read exactly json.dumps of the event."""
    from shepherd.server.common import sse_chunker
    meta = {"rid": 'chatcmpl-"é\\n', "created": 1700000000}
    choices = [{"index": 0, "delta": {"content": 'a "quote", ünïcode \u2028 and \\'}, "finish_reason": None}]
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    for include_usage, u in ((False, None), (True, usage), (True, None)):
        event = {"id": meta["rid"], "object": "chat.completion.chunk", "created": meta["created"],
                 "model": "m/ß", "choices": choices}
        if include_usage:
            event["usage"] = u
        got = sse_chunker("chat.completion.chunk", meta, "m/ß", include_usage)(choices, u)
        assert got == f"data: {json.dumps(event)}\n\n"


def test_scheduler_stats_cross_the_pipe_whole_and_metrics_follow_them_back_and_forth():
    """The core sends SchedulerStats as a tuple; the front rebuilds every field, and /metrics shows
    the latest value even when a field returns to an earlier one (metrics are set only on change)."""
    import dataclasses
    import pickle

    from prometheus_client import generate_latest

    from shepherd.engine.core_loop import stats_from_wire, stats_to_wire
    from shepherd.engine.metrics import EngineMetrics
    from shepherd.scheduler.state import SchedulerStats
    st = SchedulerStats(step=7, num_waiting=3, kv_capacity=100, kv_used=40, new_token_ratio=0.25,
                        running_lora_adapters="a,b", generated_tokens=9)
    assert stats_from_wire(pickle.loads(pickle.dumps(stats_to_wire(st)))) == st
    m = EngineMetrics("stats-wire-test")

    def shown(name: str) -> float:
        for line in generate_latest(m.registry).decode().splitlines():
            if line.startswith(name + "{") and 'model_name="stats-wire-test"' in line:
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not exported")

    for waiting, used in ((3, 40), (0, 0), (0, 0), (5, 60), (3, 40)):
        m.update_from_stats(dataclasses.replace(st, num_waiting=waiting, kv_used=used))
        assert shown("vllm:num_requests_waiting") == waiting
        assert shown("vllm:kv_cache_usage_perc") == used / 100


def test_the_chat_template_is_compiled_at_start_not_by_the_first_chat_request(monkeypatch):
    """Importing jinja2 and compiling the template inside the first chat request held the server's
    event loop, every stream and /health with it (0.15-0.8 s through Ray Serve). With jinja2's
    environment broken after start, a first chat request still renders: it was built before."""
    import jinja2.sandbox
    tok = load_tokenizer(None)
    tok.set_chat_template(tok.chat_template)     # this instance's template not built yet
    ex = ScriptedExecutor(tok, tok.encode(TEXT), kv_capacity=4096, max_model_len=2048)
    engine = Engine(EngineConfig(executor="sim", watchdog_timeout=60), executor=ex, tokenizer=tok)
    with EngineServer(engine) as srv:
        def broken(*a, **kw):
            raise RuntimeError("jinja2 used after start")
        monkeypatch.setattr(jinja2.sandbox, "ImmutableSandboxedEnvironment", broken)
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                       json={"model": "scripted", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]


def test_a_chat_template_that_does_not_compile_starts_the_server_and_chat_gets_400(tok):
    ex = ScriptedExecutor(tok, tok.encode(TEXT), kv_capacity=4096, max_model_len=2048)
    t = load_tokenizer(None)
    engine = Engine(EngineConfig(executor="sim", watchdog_timeout=60), executor=ex, tokenizer=t)
    with EngineServer(engine, ServerConfig(chat_template="{% if %}")) as srv:
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                       json={"model": "scripted", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("route,body,what", [
    ("/v1/chat/completions", lambda items: {"messages": items, "max_tokens": 1}, "messages"),
    ("/tokenize", lambda items: {"messages": items}, "messages"),
    ("/v1/responses", lambda items: {"input": items, "max_output_tokens": 1}, "input items"),
])
def test_a_chat_has_at_most_openais_2048_messages(client, route, body, what):
    """OpenAI's limit, stated in the schema; past it the request is refused before its messages are
    validated (a 1.2 MB body of 43,000 empty messages took ~190 ms of validation, GIL held), with a
    message that names the limit. 2,048 are taken (here refused for this server's 2,048-token
    context, not for their count)."""
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    name = {"/v1/chat/completions": "ChatCompletionRequest", "/tokenize": "TokenizeRequest",
            "/v1/responses": "ResponsesRequest"}[route]
    prop = schema[name]["properties"]["messages" if what == "messages" else "input"]
    assert 2048 in [b.get("maxItems") for b in prop.get("anyOf", [prop])]
    one = {"role": "user", "content": "x"}
    r = client.post(route, json=body([one] * 2048))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = client.post(route, json=body([one] * 2049))
    assert r.status_code == 400 and r.json()["error"]["message"].endswith(f"at most 2048 {what}, got 2049"), r.text


def test_every_answer_names_its_request_id(client):
    """X-Request-Id on every answer, refusals and streams included: the client's own when it sent
    one (a gateway or a tracing client), else a fresh id, as vLLM's --enable-request-id-headers."""
    msgs = [{"role": "user", "content": "x"}]
    ok = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2},
                     headers={"X-Request-Id": "trace-42"})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "trace-42"
    assert ok.json()["id"] == "chatcmpl-trace-42"                # the answer's id follows it, as vLLM's
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True},
                       headers={"x-request-id": "s-1"}) as r:
        text = r.read().decode()
        assert r.headers["x-request-id"] == "s-1" and "[DONE]" in text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert chunks and {c["id"] for c in chunks} == {"cmpl-s-1"}
    plain = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert plain.json()["id"] == "cmpl-" + plain.headers["x-request-id"]
    bad = client.post("/v1/completions", content=b"{not json", headers={"X-Request-Id": "bad-1"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-1"
    a, b = (client.get("/health").headers["x-request-id"] for _ in range(2))
    assert a != b and len(a) == 32 and int(a, 16) >= 0          # fresh, uuid4 hex
    long = client.get("/health", headers={"X-Request-Id": "z" * 300}).headers["x-request-id"]
    assert len(long) == 32
    odd = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                      headers={"X-Request-Id": "caf\u00e9".encode()})       # not printable ASCII: replaced
    assert odd.status_code == 200 and len(odd.headers["x-request-id"]) == 32


def test_requests_that_reuse_an_x_request_id_both_get_their_own_answer(client):
    """A client may send one X-Request-Id twice (a retry, a fan-out): the engine's own ids stay
    unique, so neither request takes the other's tokens or is lost."""
    import concurrent.futures
    bodies = [{"prompt": "x", "max_tokens": n, "temperature": 0} for n in (3, 7)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda b: client.post("/v1/completions", json=b, headers={"X-Request-Id": "same"}),
                            bodies))
    alone = [client.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]
    assert [r.status_code for r in got] == [200, 200]
    assert [r.json()["id"] for r in got] == ["cmpl-same", "cmpl-same"]
    assert [r.json()["choices"][0]["text"] for r in got] == alone
    assert [r.json()["usage"]["completion_tokens"] for r in got] == [3, 7]
