"""End to end: a real `shepherd serve` process on the default model (SmolLM2-135M),
driven by the official `openai` client.

SHEPHERD_E2E_EXECUTOR=sim runs the same tests against `--executor sim`
(no model weights; used while developing)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from shepherd.bench import loadgen

sys.path.insert(0, os.path.dirname(__file__))
from gateway_fakes import free_port  # noqa: E402

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.e2e, pytest.mark.model]

EXECUTOR = os.environ.get("SHEPHERD_E2E_EXECUTOR", "torch")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    log = open(log_path, "w")
    cmd = [sys.executable, "-m", "shepherd", "serve", "--port", str(port), "--max-total-tokens", "4096",
           "--executor", EXECUTOR, "--log-every-steps", "20", "--batch-invariant"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            loadgen.wait_healthy(url, proc, timeout=240)
        except RuntimeError as e:
            raise AssertionError(f"{e}:\n{log_path.read_text()[-4000:]}") from None
        yield url, proc, log_path
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=20)
        log.close()


@pytest.fixture(scope="module")
def oc(server):
    url, _, _ = server
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(oc):
    return oc.models.list().data[0].id


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


MSG = [{"role": "user", "content": "Write one sentence about the sea."}]


def test_models_and_health(server, oc, model):
    url, _, log_path = server
    assert model
    assert httpx.get(url + "/health").status_code == 200
    assert "KV cache" in log_path.read_text()  # capacity logged at start


def greedy_chat(oc, model, **kw):
    return oc.chat.completions.create(model=model, messages=MSG, max_tokens=24, temperature=0, **kw)


def test_greedy_same_with_and_without_prefix_cache_hit(oc, model):
    """docs/DESIGN.md: under greedy sampling in batch-invariant mode a request's tokens are the same
    whether or not its prompt was served from the prefix cache."""
    cold = greedy_chat(oc, model)     # first use of MSG in this server: no cache hit
    warm = greedy_chat(oc, model)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0 or EXECUTOR == "sim"
    assert warm.choices[0].message.content == cold.choices[0].message.content


def test_chat_non_stream_and_stream_agree(oc, model):
    greedy_chat(oc, model)        # warm the prefix cache: the requests compared below both hit it
    r = greedy_chat(oc, model)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 5 and 1 <= r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(oc.chat.completions.create(model=model, messages=MSG, max_tokens=24, temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [c.finish_reason]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    if EXECUTOR == "torch":
        assert text == c.message.content   # greedy, batch-invariant: same tokens either way


def test_completions_non_stream_and_stream(oc, model):
    oc.completions.create(model=model, prompt="The capital of France is", max_tokens=12, temperature=0)
    r = oc.completions.create(model=model, prompt="The capital of France is", max_tokens=12, temperature=0)
    assert r.choices[0].text and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12
    chunks = list(oc.completions.create(model=model, prompt="The capital of France is", max_tokens=12,
                                        temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    if EXECUTOR == "torch":
        assert text == r.choices[0].text
        assert "Paris" in text


def test_n2(oc, model):
    r = oc.chat.completions.create(model=model, messages=MSG, max_tokens=16, temperature=0.9, n=2, seed=1234)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert 2 <= r.usage.completion_tokens <= 32
    r = oc.completions.create(model=model, prompt="Once upon a time", max_tokens=8, n=2, stream=False, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1]


def test_stop_string(oc, model):
    oc.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=24, temperature=0,
                          extra_body={"ignore_eos": True})   # warm the prefix cache
    base = oc.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=24, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) > 8
    stop = base[3:9]          # most likely spans token boundaries
    cut = base[:base.index(stop)]
    r = oc.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=24, temperature=0, stop=[stop],
                              extra_body={"ignore_eos": True})
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"
    chunks = list(oc.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=24, temperature=0,
                                        stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == cut


def test_logprobs(oc, model):
    if EXECUTOR == "sim":
        pytest.skip("the simulated executor returns no logprobs")
    r = oc.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    r = oc.chat.completions.create(model=model, messages=MSG, max_tokens=5, temperature=0, logprobs=True,
                                   top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob <= 0 for t in content)


def test_bad_input(oc, model):
    with pytest.raises(openai.BadRequestError):
        oc.completions.create(model=model, prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        oc.chat.completions.create(model="no-such-model", messages=MSG)
    with pytest.raises(openai.BadRequestError):
        oc.completions.create(model=model, prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError):
        oc.completions.create(model=model, prompt=[1] * 5000, max_tokens=1)
    r = oc.completions.create(model=model, prompt="still serving", max_tokens=2)
    assert r.choices[0].text is not None


@pytest.mark.skipif(EXECUTOR == "sim", reason="the simulated executor applies no grammar")
def test_structured_output_and_tool_call_through_a_real_server(oc, model):
    import json
    schema = {"type": "object", "additionalProperties": False, "required": ["colour"],
              "properties": {"colour": {"enum": ["red", "green", "blue"]}}}
    r = oc.chat.completions.create(model=model, messages=[{"role": "user", "content": "Pick a colour."}],
                                   max_tokens=20, temperature=0,
                                   response_format={"type": "json_schema",
                                                    "json_schema": {"name": "c", "schema": schema}})
    assert json.loads(r.choices[0].message.content)["colour"] in ("red", "green", "blue")
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["a", "b"],
        "properties": {"a": {"type": "integer", "maximum": 999}, "b": {"type": "integer", "maximum": 999}}}}}
    r = oc.chat.completions.create(model=model, messages=[{"role": "user", "content": "Add 2 and 3."}],
                                   tools=[tool], tool_choice="required", max_tokens=40, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
    assert set(json.loads(call.function.arguments)) == {"a", "b"}


def test_disconnect_mid_stream_frees_everything(server, oc, model):
    url, proc, _ = server
    idle_kv = metric(url, "vllm:kv_cache_usage_perc")
    stream = oc.completions.create(model=model, prompt="Tell me a very long story.", max_tokens=2000,
                                   stream=True, extra_body={"ignore_eos": True})
    got = 0
    for _ in stream:
        got += 1
        if got >= 3:
            break
    assert metric(url, "vllm:num_requests_running") == 1
    stream.close()   # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while True:
        running = metric(url, "vllm:num_requests_running")
        kv = metric(url, "vllm:kv_cache_usage_perc")
        if running == 0 and kv == idle_kv:
            break
        assert time.monotonic() < deadline, f"still running={running} kv={kv} (idle {idle_kv})"
        time.sleep(0.1)
    # it was aborted, not run to its 2000 tokens
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} ([0-9.]+)$', text, re.M)
    assert m and float(m.group(1)) >= 1
    assert proc.poll() is None
