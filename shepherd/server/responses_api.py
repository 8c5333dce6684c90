"""POST /v1/responses: OpenAI's Responses API, a documented subset, over the chat machinery.

What is served (docs/SERVING.md "Responses API"):
  input            a string, or a list of items: messages (role user / system / developer /
                   assistant; content a string or input_text / output_text parts),
                   function_call and function_call_output items (a tool round trip)
  instructions     a system message in front
  tools            function tools ({"type": "function", "name", "description", "parameters"})
  tool_choice      auto | none | required | {"type": "function", "name": N}
  text.format      text | json_object | json_schema ({"name", "schema", "strict"})
  max_output_tokens, temperature, top_p, parallel_tool_calls, user, stream
The answer's `output` holds a message item (output_text) and/or function_call
items; `status` is completed, or incomplete with reason max_output_tokens.
Streamed, the events are the Responses ones: response.created,
response.in_progress, output_item.added, content_part.added,
output_text.delta / .done, function_call_arguments.delta / .done,
content_part.done, output_item.done, response.completed.

Not served (400 naming the field): previous_response_id and store=true
(nothing is stored), built-in tools (web search, file search, computer use),
non-text inputs, reasoning, background. Unknown fields are ignored.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Optional, Union

from fastapi import Request
from fastapi.responses import Response
from pydantic import ConfigDict, Field, ValidationError, field_validator

from shepherd.server import tools
from shepherd.server.common import APIError, AbortingStreamingResponse, validation_message
from shepherd.server.engine_io import collect, release, sse_events, until_disconnect
from shepherd.server.guard import request_id_of
from shepherd.server.protocol import MAX_CHAT_MESSAGES, ChatCompletionRequest, RequestModel, at_most_messages
from shepherd.server.workpool import MESSAGE_COST

TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(RequestModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    model: Optional[str] = None
    input: Union[str, Annotated[list[dict[str, Any]], Field(max_length=MAX_CHAT_MESSAGES)]]   # items: chat messages
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    tools: Optional[list[dict[str, Any]]] = Field(None, max_length=128)
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: bool = True
    text: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    seed: Optional[int] = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v):
        return at_most_messages(v, "input items")


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of text parts", "input")
    out = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _bad(f"{where}.content: only text parts ({', '.join(TEXT_PARTS)}) are supported", "input")
        out.append(part["text"])
    return "".join(out)


def _messages(body: ResponsesRequest) -> list[dict]:
    """The input items as chat messages: a function_call joins the assistant message before it."""
    msgs: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if not items:
        raise _bad("input must not be empty", "input")
    for i, it in enumerate(items):
        kind, where = it.get("type", "message"), f"input[{i}]"
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role must be user, system, developer or assistant", "input")
            msgs.append({"role": role, "content": _text_of(it.get("content"), where)})
        elif kind == "function_call":
            call = {"id": str(it.get("call_id") or it.get("id") or tools.new_call_id()), "type": "function",
                    "function": {"name": str(it.get("name", "")), "arguments": str(it.get("arguments", "{}"))}}
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out = it.get("output")
            msgs.append({"role": "tool", "tool_call_id": str(it.get("call_id", "")),
                         "content": out if isinstance(out, str) else json.dumps(out)})
        else:
            raise _bad(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                       "function_call_output)", "input")
    return msgs


def _tools(body: ResponsesRequest) -> dict:
    out: dict = {}
    if body.tools:
        fns = []
        for i, t in enumerate(body.tools):
            if t.get("type") != "function":
                raise _bad(f"tools[{i}]: only function tools are supported, not {t.get('type')!r}", "tools")
            fns.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                         if t.get(k) is not None}})
        out["tools"] = fns
    tc = body.tool_choice
    if isinstance(tc, dict):
        if tc.get("type") != "function" or not isinstance(tc.get("name"), str):
            raise _bad("tool_choice must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                       "tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
    elif tc is not None:
        out["tool_choice"] = tc
    return out


def _format(body: ResponsesRequest) -> dict:
    fmt = (body.text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise _bad("text.format must be an object: {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}",
                   "text")
    if not fmt or fmt.get("type") == "text":
        return {}
    if fmt.get("type") == "json_object":
        return {"response_format": {"type": "json_object"}}
    if fmt.get("type") == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}}
    raise _bad("text.format.type must be text, json_object or json_schema", "text")


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request this Responses request is served as (400 for what is not served)."""
    if body.previous_response_id is not None:
        raise _bad("previous_response_id is not supported: nothing is stored; send the whole input", "previous_response_id")
    if body.store:
        raise _bad("store=true is not supported: responses are not stored", "store")
    chat = {"model": body.model, "messages": _messages(body), "stream": body.stream, "user": body.user,
            "parallel_tool_calls": body.parallel_tool_calls, "max_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
            **_tools(body), **_format(body)}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as e:
        # named as the Responses body names it: tools[0].function.name is tools[0].name there
        msg, param = validation_message(e.errors())
        for chat_name, ours in _CHAT_NAMES.items():
            msg = msg.replace(chat_name, ours)
        if param is None:       # a check across fields (chat's _checks) names the one it is about first
            param = next((f for f in ("tool_choice", "tools") if msg.startswith(f)), "input")
        param = _CHAT_NAMES.get(param, param)
        raise _bad(msg, param) from None


# the chat request's field -> the Responses field it was made from (to_chat)
_CHAT_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
               ".function.": "."}


class ResponsesRoutes:
    """/v1/responses on top of ChatRoutes.submit: the same checks, template, grammar and tools."""

    def __init__(self, ctx, chat):
        self.ctx, self.chat = ctx, chat

    async def handle(self, request: Request, body: ResponsesRequest):
        # the input items become chat messages, then a validated chat request: work that grows with
        # their count, done in the work thread once there are many (as the chat route's template)
        items = 1 if isinstance(body.input, str) else len(body.input)
        chat = await self.ctx.work.run(to_chat, body, cost=MESSAGE_COST * items)
        rid = f"resp_{request_id_of(request)}"
        streams, meta = await self.chat.submit(request, chat, rid)
        shell = Shell(self.ctx, body, chat, rid, meta)
        if body.stream:
            return AbortingStreamingResponse(self.stream(chat, streams, shell), lambda: release(streams),
                                             media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        res = await until_disconnect(request, collect(streams))
        if res is None:
            return Response(status_code=499)
        texts, _, final, _ = res
        content, calls = tools.parse_output(texts[0], chat, self.ctx.cfg.tool_call_parser)
        output = ([shell.message(content)] if content else []) + [
            shell.call(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        return shell.response(output, final[0])

    def stream(self, chat: ChatCompletionRequest, streams, shell: "Shell"):
        mode = tools.choice_mode(chat)
        named = mode == "named"
        scan = tools.scanner(chat, self.ctx.cfg.tool_call_parser) if mode in ("auto", "required") else None

        def on_output(_i: int, out):
            if named:
                events = ([("call", 0, chat.tool_choice.function.name)] if not shell.items else []) + (
                    [("args", 0, out.text)] if out.text else [])
            elif scan is not None:
                events = scan.feed(out.text) + (scan.finish() if out.finished else [])
            else:
                events = [("content", out.text)] if out.text else []
            for ev in events:
                yield from shell.event(ev)
            if out.finished:
                yield from shell.close_all(out)

        prelude = [shell.sse("response.created", response=shell.response([], None)),
                   shell.sse("response.in_progress", response=shell.response([], None))]
        return sse_events(streams, on_output, lambda *_: None, prelude, on_error=shell.error)


class Shell:
    """The Response object and its stream events for one request."""

    def __init__(self, ctx, body: ResponsesRequest, chat: ChatCompletionRequest, rid: str, meta: dict):
        self.ctx, self.body, self.chat, self.rid, self.meta = ctx, body, chat, rid, meta
        self.created = int(time.time())
        self.seq = 0
        self.items: list[dict] = []          # output items, in order (streaming)
        self.open: Optional[dict] = None     # the message item text is going into
        self.calls: dict[int, dict] = {}     # scanner call index -> its item

    def response(self, output: list, final) -> dict:
        b = self.body
        status, incomplete = "in_progress", None
        if final is not None:
            status = "incomplete" if final.finish_reason == "length" else "completed"
            incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        usage = None
        if final is not None:
            usage = {"input_tokens": self.meta["prompt_tokens"], "output_tokens": final.completion_tokens,
                     "total_tokens": self.meta["prompt_tokens"] + final.completion_tokens,
                     "input_tokens_details": {"cached_tokens": final.cached_tokens},
                     "output_tokens_details": {"reasoning_tokens": 0}}
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.ctx.served_name, "output": output, "error": None, "incomplete_details": incomplete,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "temperature": b.temperature, "top_p": b.top_p, "parallel_tool_calls": b.parallel_tool_calls,
                "tool_choice": b.tool_choice if b.tool_choice is not None else "auto", "tools": b.tools or [],
                "text": b.text or {"format": {"type": "text"}}, "metadata": b.metadata or {}, "store": False,
                "user": b.user, "usage": usage}

    @staticmethod
    def message(text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    @staticmethod
    def call(name: str, arguments: str, status: str = "completed") -> dict:
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": tools.new_call_id(),
                "name": name, "arguments": arguments, "status": status}

    def sse(self, kind: str, **fields) -> str:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(ev)}\n\n"

    def event(self, ev):
        """Stream events of one scanner event: text into the open message, or a call's pieces."""
        if ev[0] == "content":
            if self.open is None:
                self.open = self.message("", "in_progress")
                self.open["content"] = []
                self.items.append(self.open)
                idx = len(self.items) - 1
                yield self.sse("response.output_item.added", output_index=idx, item=self.open)
                yield self.sse("response.content_part.added", item_id=self.open["id"], output_index=idx,
                               content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                self.open["content"] = [{"type": "output_text", "text": "", "annotations": []}]
            self.open["content"][0]["text"] += ev[1]
            yield self.sse("response.output_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1,
                           content_index=0, delta=ev[1])
        elif ev[0] == "call":
            yield from self.close_message()
            item = self.call(ev[2], "", "in_progress")
            self.calls[ev[1]] = item
            self.items.append(item)
            yield self.sse("response.output_item.added", output_index=len(self.items) - 1, item=item)
        else:
            item = self.calls[ev[1]]
            item["arguments"] += ev[2]
            yield self.sse("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=self.items.index(item), delta=ev[2])

    def close_message(self):
        m, self.open = self.open, None
        if m is None:
            return
        idx, text = self.items.index(m), m["content"][0]["text"]
        yield self.sse("response.output_text.done", item_id=m["id"], output_index=idx, content_index=0, text=text)
        yield self.sse("response.content_part.done", item_id=m["id"], output_index=idx, content_index=0,
                       part=m["content"][0])
        m["status"] = "completed"
        yield self.sse("response.output_item.done", output_index=idx, item=m)

    def error(self, out) -> str:
        return self.sse("error", code="engine_error" if out.error_kind == "engine" else "request_failed",
                        message=out.error or "request failed", param=None)

    def close_all(self, final):
        yield from self.close_message()
        for item in self.calls.values():
            idx = self.items.index(item)
            yield self.sse("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                           arguments=item["arguments"])
            item["status"] = "completed"
            yield self.sse("response.output_item.done", output_index=idx, item=item)
        resp = self.response(self.items, final)
        yield self.sse("response.completed" if resp["status"] == "completed" else "response.incomplete",
                       response=resp)
