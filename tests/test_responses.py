"""Issue 31's API additions through the official `openai` client, on a scripted executor whose
text holds a Hermes tool call (no model weights): tool calls streamed as they are generated,
GET /v1/models/{id}, and /v1/responses (text, tool calls, a tool round trip, structured
output, streaming, what is refused)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from shepherd.config import EngineConfig
from shepherd.engine.engine import Engine

try:
    from gateway_fakes import EngineServer
    from test_engine import ScriptedExecutor
    from test_server_api import wait_idle
except ImportError:  # pragma: no cover - when tests/ is a package
    from tests.gateway_fakes import EngineServer
    from tests.test_engine import ScriptedExecutor
    from tests.test_server_api import wait_idle

CALL_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
             '\n</tool_call>')
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}
R_WEATHER = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def tok():
    from shepherd.model.loader import load_tokenizer
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def srv(tok):
    ex = ScriptedExecutor(tok, tok.encode(CALL_TEXT), delay=0.002)
    engine = Engine(EngineConfig(executor="sim", watchdog_timeout=60), executor=ex, tokenizer=tok)
    with EngineServer(engine) as s:
        s.oc = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        s.model = s.oc.models.list().data[0].id
        yield s
        wait_idle(engine)


def test_models_retrieve(srv):
    m = srv.oc.models.retrieve(srv.model)
    assert m.id == srv.model
    with pytest.raises(openai.NotFoundError):
        srv.oc.models.retrieve("no-such-model")


def test_auto_tool_calls_stream_as_they_are_generated(srv):
    kw = dict(model=srv.model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
              max_tokens=100, temperature=0)
    whole = srv.oc.chat.completions.create(**kw)
    call = whole.choices[0].message.tool_calls[0]
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content == "Let me check."
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}
    chunks = list(srv.oc.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    arg_pieces = [tc.function.arguments for d in deltas for tc in d.tool_calls or () if tc.function.arguments]
    assert deltas[first_call].tool_calls[0].function.name == "get_weather" and deltas[first_call].tool_calls[0].id
    assert len(arg_pieces) >= 3                      # the arguments came in pieces, not at the end
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(arg_pieces) == call.function.arguments
    assert "".join(d.content or "" for d in deltas) == "Let me check."


def test_responses_text_and_usage(srv, tok):
    r = srv.oc.responses.create(model=srv.model, input="Say hi.", instructions="Be brief.", max_output_tokens=5)
    assert r.object == "response" and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == tok.decode(tok.encode(CALL_TEXT)[:5])
    assert r.usage.output_tokens == 5 and r.usage.input_tokens > 5
    full = srv.oc.responses.create(model=srv.model, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Say hi."}]}], max_output_tokens=200)
    assert full.status == "completed" and full.output_text == CALL_TEXT       # no tools: all text


def test_responses_tool_call_and_round_trip(srv):
    r = srv.oc.responses.create(model=srv.model, input="Weather in Paris?", tools=[R_WEATHER], max_output_tokens=200)
    kinds = [o.type for o in r.output]
    assert kinds == ["message", "function_call"], kinds
    fc = r.output[1]
    assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris", "unit": "c"} and fc.call_id
    # the call and its result go back as input items
    again = srv.oc.responses.create(model=srv.model, tools=[R_WEATHER], tool_choice="none", max_output_tokens=20,
                                    input=[{"role": "user", "content": "Weather in Paris?"},
                                           {"type": "function_call", "call_id": fc.call_id, "name": fc.name,
                                            "arguments": fc.arguments},
                                           {"type": "function_call_output", "call_id": fc.call_id,
                                            "output": "18 C"}])
    assert again.status in ("completed", "incomplete") and again.output_text


def test_responses_stream_events(srv):
    events = list(srv.oc.responses.create(model=srv.model, input="Weather?", tools=[R_WEATHER],
                                          max_output_tokens=200, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert text == "Let me check." and len(args) >= 3
    done = events[-1].response
    assert done.output[1].arguments == "".join(args) and done.output_text == "Let me check."
    assert types.index("response.output_item.added") < types.index("response.output_text.delta")


def test_responses_structured_output_is_compiled_and_refusals_are_400(srv):
    fmt = {"format": {"type": "json_schema", "name": "p", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}
    with pytest.raises(openai.BadRequestError, match="'not'"):
        srv.oc.responses.create(model=srv.model, input="x", text=fmt)
    ok = {"format": {"type": "json_schema", "name": "p", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}
    assert srv.oc.responses.create(model=srv.model, input="x", text=ok, max_output_tokens=3).id.startswith("resp_")
    for kw, needle in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                       ({"tools": [{"type": "web_search"}]}, "function tools"),
                       ({"store": True}, "store")):
        with pytest.raises(openai.BadRequestError, match=needle):
            srv.oc.responses.create(model=srv.model, input="x", **kw)
    r = httpx.post(srv.url + "/v1/responses", json={"input": [{"type": "input_image", "image_url": "x"}]})
    assert r.status_code == 400 and "not supported" in r.json()["error"]["message"]


@pytest.mark.parametrize("extra,param,needle", [
    ({"text": {"format": "json"}}, "text", "text.format must be an object"),        # was a 500
    ({"text": {"format": ["a"]}, "stream": True}, "text", "text.format must be an object"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools", "tools.0.name"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice", "'g', which is not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_responses_refusals_name_the_field(srv, extra, param, needle):
    """Schema-valid bodies the Responses route cannot serve are 400s that say which field and
    why (they were a 500, or 'cannot serve this input' with pydantic's link and param 'input')."""
    r = httpx.post(srv.url + "/v1/responses", json={"input": "x", "max_output_tokens": 2, **extra})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and needle in err["message"], r.text
    assert "pydantic" not in err["message"]


def test_many_input_items_are_converted_in_the_work_thread(srv, monkeypatch):
    """The input items become chat messages and a validated chat request, work that grows with
    their count: with many items it runs in the work thread (as the chat route's template), not
    on the event loop; the answer is the same either way."""
    import threading

    from shepherd.server import responses_api
    where, real = [], responses_api.to_chat
    monkeypatch.setattr(responses_api, "to_chat", lambda body: where.append(threading.current_thread().name)
                        or real(body))
    items = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
    for n in (1, 160):          # 320 items: past the work pool's inline cost, within the 2,048 context
        r = httpx.post(srv.url + "/v1/responses", json={"input": items * n, "max_output_tokens": 2})
        assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text[:300]
    assert not where[0].startswith("shepherd-work") and where[1].startswith("shepherd-work"), where


def test_agents_sdk_runs_a_tool_round_trip(srv):
    """A third party: the OpenAI Agents SDK (its default is the Responses API) parses the call the
    scripted model makes and runs the tool with its arguments."""
    agents = pytest.importorskip("agents")
    calls = []

    @agents.function_tool
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city."""
        calls.append((city, unit))
        return "18 C"

    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    model = agents.OpenAIResponsesModel(model=srv.model, openai_client=client)
    agent = agents.Agent(name="w", instructions="Answer.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(max_tokens=200),
                         tool_use_behavior="stop_on_first_tool")     # the scripted model always calls
    agents.set_tracing_disabled(True)
    result = agents.Runner.run_sync(agent, "Weather in Paris?", max_turns=2)
    assert calls == [("Paris", "c")] and result.final_output == "18 C"
