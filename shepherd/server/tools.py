"""Tool calling: prompt rendering, grammar for required / named choices, output parsers.

Rendering. A chat template that mentions `tools` gets the tools and the
messages (assistant `tool_calls`, role "tool") as they are, as transformers
passes them. A template that does not (SmolLM2's) gets the tools described
in a system message, Hermes style, and tool calls / results written into the
message text, so the history still round-trips through the template.

tool_choice:
    none      tools are not shown to the model; plain content
    auto      the model decides; --tool-call-parser finds the calls in its text
    required  the output is constrained (grammar) to a JSON list of calls of the tools
    named     the output is constrained to the named tool's arguments
Parsers: "hermes" (<tool_call>{"name":..., "arguments":...}</tool_call>, text
outside the tags is content) and "json" (the whole output is one call object
or a list of them); both run incrementally (tool_stream.py), so calls stream
as deltas while they are generated.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Optional

from shepherd.server.tool_stream import ToolCallScanner

PARSERS = ("hermes", "json")


def template_takes_tools(chat_template: Optional[str]) -> bool:
    return bool(chat_template) and "tools" in chat_template


def choice_mode(body) -> str:
    tc = body.tool_choice
    if not body.tools or tc == "none":
        return "none"
    if tc is None or tc == "auto":
        return "auto"
    return "required" if tc == "required" else "named"


def _tool_dicts(body) -> list[dict]:
    return [t.model_dump(exclude_none=True) for t in body.tools or ()]


def _call_text(tc) -> str:
    try:
        args = json.loads(tc.function.arguments)
    except ValueError:
        args = tc.function.arguments
    return "<tool_call>\n" + json.dumps({"name": tc.function.name, "arguments": args}) + "\n</tool_call>"


def render_messages(body, takes_tools: bool) -> tuple[list[dict], dict]:
    """(messages, extra template kwargs) for tokenizer.apply_chat_template."""
    mode = choice_mode(body)
    if takes_tools:
        msgs = []
        for m in body.messages:
            d = {"role": m.role, "content": m.text()}
            if m.name:
                d["name"] = m.name
            if m.tool_calls:
                d["tool_calls"] = [tc.model_dump(exclude_none=True) for tc in m.tool_calls]
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            msgs.append(d)
        return msgs, ({"tools": _tool_dicts(body)} if mode != "none" else {})
    msgs = []
    for m in body.messages:
        text = m.text()
        if m.tool_calls:
            text = "\n".join([text] * bool(text) + [_call_text(tc) for tc in m.tool_calls])
        if m.role == "tool":
            text = f"<tool_response>\n{text}\n</tool_response>"
        d = {"role": m.role, "content": text}
        if m.name:
            d["name"] = m.name
        msgs.append(d)
    if mode != "none":
        system = _tools_system_prompt(body)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = dict(msgs[0], content=msgs[0]["content"] + "\n\n" + system)
        else:
            msgs.insert(0, {"role": "system", "content": system})
    return msgs, {}


def _tools_system_prompt(body) -> str:
    tools = "\n".join(json.dumps(t["function"]) for t in _tool_dicts(body))
    return ("You may call one or more functions to answer. The functions are:\n<tools>\n" + tools +
            "\n</tools>\nFor each call, answer with a JSON object with the function name and its "
            "arguments inside <tool_call></tool_call> tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _params(tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _has_local_ref(x) -> bool:
    if isinstance(x, dict):
        return any((k == "$ref" and isinstance(v, str) and v.startswith("#")) or _has_local_ref(v)
                   for k, v in x.items())
    return isinstance(x, list) and any(_has_local_ref(v) for v in x)


def _relocate(x, base: str):
    """A schema's local "$ref" pointers ("#", "#/...") made relative to `base` instead of its root."""
    if isinstance(x, dict):
        return {k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _relocate(v, base)
                for k, v in x.items()}
    if isinstance(x, list):
        return [_relocate(v, base) for v in x]
    return x


def tool_grammar(body) -> Optional[tuple[str, str]]:
    """The grammar spec that makes the output a valid call (required / named), else None."""
    mode = choice_mode(body)
    if mode == "named":
        name = body.tool_choice.function.name
        tool = next(t for t in body.tools if t.function.name == name)
        return ("json_schema", json.dumps(_params(tool)))
    if mode == "required":
        one, defs = [], {}
        for i, t in enumerate(body.tools):
            args = _params(t)
            if _has_local_ref(args):
                # the parameters' "#/..." pointers mean their own root, which is nested here: the
                # schema moves to $defs/toolI and its pointers with it ("#/$defs/node" was refused)
                defs[f"tool{i}"] = _relocate(args, f"#/$defs/tool{i}")
                args = {"$ref": f"#/$defs/tool{i}"}
            one.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                         "arguments": args},
                        "required": ["name", "arguments"]})
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": one[0] if len(one) == 1 else {"anyOf": one}}
        if defs:
            schema["$defs"] = defs
        # one call per tool at most: small models otherwise repeat a call until max_tokens
        schema["maxItems"] = len(one) if body.parallel_tool_calls else 1
        return ("json_schema", json.dumps(schema))
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, args: Any) -> dict:
    if not isinstance(args, str):
        args = json.dumps(args if args is not None else {})
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": args}}


def scanner(body, parser: str) -> ToolCallScanner:
    """The scanner that finds this request's tool calls in its text (auto / required)."""
    framing = "json" if choice_mode(body) == "required" else parser
    return ToolCallScanner({t.function.name for t in body.tools or ()}, framing, body.parallel_tool_calls)


def parse_output(text: str, body, parser: str) -> tuple[Optional[str], list[dict]]:
    """(content, tool_calls) of one choice's whole text; the same scanner the stream uses, so a
    streamed answer reassembles to this one."""
    mode = choice_mode(body)
    if mode == "named":
        return None, [_call(body.tool_choice.function.name, text.strip() or "{}")]
    if mode == "none":
        return text, []
    scan = scanner(body, parser)
    scan.feed(text)
    scan.finish()
    return scan.content, [_call(name, args) for name, args in scan.tool_calls()]
