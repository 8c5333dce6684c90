"""Structured outputs, tool calls and the new fields with the official openai client, in
process (httpx.ASGITransport) over the real SmolLM2-135M engine."""
from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from shepherd.config import EngineConfig, SchedulerConfig, ServerConfig
from shepherd.engine.engine import Engine
from shepherd.server.openai_api import build_app

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 24}}}
# Room for any of these schemas to close: the grammar bounds the text, but a sampled path through
# non-Latin text spends up to 4 byte-tokens a character (CI once cut a PERSON at 80 tokens inside
# Japanese), and sampled paths differ between CPUs, so a seed alone does not keep it short.
ROOM = 320
ITEMS = {"type": "object", "additionalProperties": False, "required": ["items"],
         "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                  "items": {"type": "string", "maxLength": 16}}}}
VERDICT = {"type": "object", "additionalProperties": False, "required": ["verdict", "score"],
           "properties": {"verdict": {"enum": ["good", "bad", "unsure"]}, "score": {"type": "integer", "minimum": 1, "maximum": 5}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["tz"],
                   "properties": {"tz": {"type": "string", "maxLength": 30}}}}}
PROMPTS = ["Describe a person.", "Invent a character for a novel.", "Who is your best friend?",
           "Give me a shopping list.", "List some fruits.", "What should I pack for a trip?",
           "Review this movie: it was long.", "Is pineapple on pizza good?", "Rate the weather today.",
           "Tell me about a painter.", "Name three colours.", "A customer says the soup was cold.",
           "Tell me about a scientist.", "List tools in a garage.", "Was the concert loud?",
           "Introduce a teacher.", "What do cats like?", "Judge this poem: roses are red.",
           "Describe a sailor.", "List planets."]


@pytest.fixture(scope="module")
def served():
    loop = asyncio.new_event_loop()
    cfg = EngineConfig(executor="torch", max_total_tokens=8192, batch_invariant=False)
    engine = Engine(cfg)
    app = build_app(engine, ServerConfig())
    loop.run_until_complete(engine.start())
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shepherd", timeout=300)
    oc = openai.AsyncOpenAI(base_url="http://shepherd/v1", api_key="x", http_client=http, max_retries=0)
    yield loop, oc, http, engine
    loop.run_until_complete(http.aclose())
    loop.run_until_complete(engine.stop())
    loop.close()


def run(served, coro):
    return served[0].run_until_complete(coro)


def test_json_schema_outputs_validate_for_20_prompts_batched_with_free_requests(served):
    _, oc, _, engine = served
    schemas = [PERSON, ITEMS, VERDICT]

    async def one(i, p):
        fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schemas[i % 3], "strict": True}}
        return await oc.chat.completions.create(model=engine.model_name, messages=[{"role": "user", "content": p}],
                                                max_tokens=ROOM, temperature=0.7, seed=i, response_format=fmt)

    async def free():
        return await oc.chat.completions.create(model=engine.model_name, max_tokens=20, temperature=0,
                                                messages=[{"role": "user", "content": "Say hi."}])

    async def all_():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)), free())

    *outs, plain = run(served, all_())
    for i, r in enumerate(outs):
        jsonschema.validate(json.loads(r.choices[0].message.content), schemas[i % 3])
        assert r.choices[0].finish_reason == "stop"
    assert not plain.choices[0].message.content.lstrip().startswith("{")


def test_structured_outputs_in_stream_with_n_2_and_vllm_spellings(served):
    _, oc, http, engine = served

    async def go():
        stream = await oc.chat.completions.create(
            model=engine.model_name, messages=[{"role": "user", "content": "Describe a person."}], n=2,
            max_tokens=ROOM, temperature=0.8, seed=5, stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
        texts, ends = ["", ""], [None, None]
        async for ch in stream:
            for c in ch.choices:
                texts[c.index] += c.delta.content or ""
                ends[c.index] = c.finish_reason or ends[c.index]
        regex = await http.post("/v1/completions", json={"prompt": "Phone:", "max_tokens": 20, "temperature": 0,
                                                         "structured_outputs": {"regex": r"\d{3}-\d{4}"}})
        choice = await http.post("/v1/completions", json={"prompt": "Is the sky blue?", "max_tokens": 5,
                                                          "guided_choice": ["yes", "no"]})
        obj = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Give me JSON."}], "max_tokens": 60,
            "response_format": {"type": "json_object"}})
        return texts, ends, regex.json(), choice.json(), obj.json()

    texts, ends, regex, choice, obj = run(served, go())
    assert ends == ["stop", "stop"], texts
    for t in texts:
        jsonschema.validate(json.loads(t), PERSON)
    import re
    assert re.fullmatch(r"\d{3}-\d{4}", regex["choices"][0]["text"])
    assert choice["choices"][0]["text"] in ("yes", "no")
    if obj["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(obj["choices"][0]["message"]["content"]), dict)


def test_a_5000_value_enum_is_accepted_and_the_model_writes_a_member(served):
    """Issue 31's enum row: compiled as xgrammar's flat alternation this schema took 3.3-6.5 s, at the
    server's 5 s --grammar-timeout (200 or 400 from run to run); as a trie it compiles in well under
    a second. Greedy output through the real model is JSON with one of the values."""
    _, _, http, _ = served
    values = ["caf\u00e9 \"q\"", "back\\slash", "\U0001F600"] + [f"value-{i}-of-the-list" for i in range(5000)]
    schema = {"type": "object", "additionalProperties": False, "required": ["v"], "properties": {"v": {"enum": values}}}
    r = run(served, http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Pick a value."}], "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}}))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert json.loads(choice["message"]["content"])["v"] in values


def test_named_and_required_tool_calls_validate_and_stream_the_same_call(served):
    _, oc, _, engine = served
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]

    async def go():
        named = await oc.chat.completions.create(
            model=engine.model_name, messages=msgs, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        required = await oc.chat.completions.create(model=engine.model_name, messages=msgs, tools=[WEATHER, TIME],
                                                     tool_choice="required", max_tokens=80, temperature=0)
        stream = await oc.chat.completions.create(model=engine.model_name, messages=msgs, tools=[WEATHER, TIME],
                                                  tool_choice="required", max_tokens=80, temperature=0,
                                                  stream=True)
        parts, reasons = await reassemble(stream)
        named_stream = await oc.chat.completions.create(
            model=engine.model_name, messages=msgs, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True)
        named_parts, named_reasons = await reassemble(named_stream)
        assert named_reasons[-1] == "tool_calls"
        assert [(p["name"], json.loads(p["arguments"])) for p in named_parts.values()] == \
            [("get_weather", json.loads(named.choices[0].message.tool_calls[0].function.arguments))]
        return named, required, parts, reasons

    async def reassemble(stream):
        parts, reasons = {}, []
        async for ch in stream:
            for c in ch.choices:
                reasons.append(c.finish_reason)
                for tc in c.delta.tool_calls or ():
                    p = parts.setdefault(tc.index, {"name": "", "arguments": ""})
                    p["name"] += (tc.function.name or "") if tc.function else ""
                    p["arguments"] += (tc.function.arguments or "") if tc.function else ""
        return parts, reasons

    named, required, parts, reasons = run(served, go())
    params = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
    call = named.choices[0].message.tool_calls[0]
    assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), params["get_weather"])
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and calls
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), params[c.function.name])
    assert [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    assert "tool_calls" in reasons


def test_tool_result_round_trip_then_answer(served):
    _, oc, _, engine = served
    msgs = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    r = run(served, oc.chat.completions.create(model=engine.model_name, messages=msgs, tools=[WEATHER],
                                               tool_choice="none", max_tokens=30, temperature=0))
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_logit_bias_echo_stop_reason_min_tokens_and_tokenize(served):
    _, oc, http, engine = served
    tok = engine.tokenizer
    target = tok.encode(" banana")[0]

    async def go():
        biased = await oc.completions.create(model=engine.model_name, prompt="The capital of France is",
                                             max_tokens=3, temperature=0, logit_bias={str(target): 100})
        echo = await oc.completions.create(model=engine.model_name, prompt="Once upon a time", max_tokens=4,
                                           temperature=0, echo=True)
        stop = await http.post("/v1/completions", json={"prompt": "1, 2, 3, 4,", "max_tokens": 20,
                                                        "temperature": 0, "stop": [" 6"],
                                                        "include_stop_str_in_output": True})
        mint = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 12, "min_tokens": 12,
                                                        "temperature": 0})
        t = await http.post("/tokenize", json={"prompt": "Round trip ✓ text"})
        d = await http.post("/detokenize", json={"tokens": t.json()["tokens"]})
        ct = await http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        v = await http.get("/version")
        return biased, echo, stop.json(), mint.json(), t.json(), d.json(), ct.json(), v.json()

    biased, echo, stop, mint, t, d, ct, v = run(served, go())
    assert tok.encode(biased.choices[0].text)[:3] == [target] * 3
    assert echo.choices[0].text.startswith("Once upon a time") and len(echo.choices[0].text) > 16
    c = stop["choices"][0]
    assert c["stop_reason"] == " 6" and c["text"].endswith(" 6") and c["finish_reason"] == "stop"
    assert mint["usage"]["completion_tokens"] == 12
    assert d["prompt"] == "Round trip ✓ text" and t["count"] == len(t["tokens"])
    assert ct["count"] > 3 and v["version"]


def test_structured_output_survives_recompute_preemption():
    """A small KV pool and optimistic admission force recompute preemptions mid-grammar."""
    cfg = EngineConfig(executor="torch", max_total_tokens=448, batch_invariant=False,
                       scheduler=SchedulerConfig(admission="optimistic", preemption="recompute",
                                                 max_total_tokens=448, prefix_cache=False,
                                                 new_token_ratio_init=0.0, new_token_ratio_min=0.0))
    engine = Engine(cfg)
    app = build_app(engine, ServerConfig())

    async def go():
        await engine.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s",
                                         timeout=300) as h:
                reqs = [h.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": p}], "max_tokens": ROOM, "temperature": 0.9,
                    "seed": i, "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "x", "schema": PERSON}}})
                    for i, p in enumerate(PROMPTS[:8])]
                return [r.json() for r in await asyncio.gather(*reqs)], engine.stats()
        finally:
            await engine.stop()

    outs, stats = asyncio.run(go())
    assert stats.preemptions > 0, "the test did not preempt; shrink the pool"
    for o in outs:
        jsonschema.validate(json.loads(o["choices"][0]["message"]["content"]), PERSON)


def test_distinct_grammars_past_the_memory_bound_get_429_until_one_is_given_back():
    """--max-grammar-memory (here 1 byte: only the first grammar fits) through the HTTP app: while
    a grammar request runs, a request with another grammar gets 429 with Retry-After, one with
    the same grammar shares it (200), and once the first has ended the other gets 200 with
    nothing else run in between (the grammar is given back as its request ends)."""
    engine = Engine(EngineConfig(executor="torch", max_total_tokens=4096, batch_invariant=False,
                                 max_grammar_memory=1))
    app = build_app(engine, ServerConfig())
    held, other = "[a-z]+( [a-z]+)*", "[0-9]+(-[0-9]+)*"

    def body(regex, n):
        return {"prompt": "Write words:", "max_tokens": n, "ignore_eos": True, "guided_regex": regex}

    def held_bytes(metrics: str) -> float:
        return next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("shepherd:grammar_held_bytes{"))

    async def go():
        await engine.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s",
                                         timeout=300) as h:
                long = asyncio.ensure_future(h.post("/v1/completions", json=body(held, 400)))
                deadline = asyncio.get_running_loop().time() + 60
                while engine.stats().num_running < 1:    # the long one holds its grammar
                    assert asyncio.get_running_loop().time() < deadline and not long.done()
                    await asyncio.sleep(0.01)
                refused = await h.post("/v1/completions", json=body(other, 4))
                shared = await h.post("/v1/completions", json=body(held, 4))
                held_during = held_bytes((await h.get("/metrics")).text)
                assert not long.done(), "the long request ended before the check; make it longer"
                first = await long
                after = await h.post("/v1/completions", json=body(other, 4))
                assert held_during > 0 and held_bytes((await h.get("/metrics")).text) == 0   # all given back
                return refused, shared, first, after
        finally:
            await engine.stop()

    refused, shared, first, after = asyncio.run(go())
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    err = refused.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and "--max-grammar-memory" in err["message"]
    assert shared.status_code == 200 and first.status_code == 200
    assert after.status_code == 200 and after.json()["choices"][0]["text"].replace("-", "").isdigit()
