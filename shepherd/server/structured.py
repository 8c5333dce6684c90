"""Which grammar a request asks for, as a spec the engine carries (see model/grammar.py).

Accepted spellings, first match wins:
    response_format {"type": "json_object"} | {"type": "json_schema", "json_schema": {"schema": ...}}
    structured_outputs {json | regex | choice | grammar | json_object}     (vLLM)
    guided_json | guided_regex | guided_choice | guided_grammar            (vLLM, older)
"""
from __future__ import annotations

import json
from typing import Any, Optional

Spec = tuple[str, str]


class SpecError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise SpecError(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise SpecError(f"{param} must be a JSON schema object", param)
    return json.dumps(schema)


def requested_spec(body) -> Optional[Spec]:
    """The grammar spec of a request body (a _Sampling model), or None."""
    specs: list[tuple[Spec, str]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        specs.append((("json_object", ""), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        specs.append((("json_schema", _schema_text(rf.json_schema.json_schema, "response_format")),
                      "response_format"))
    so = body.structured_outputs
    if so is not None:
        if so.json_ is not None:
            specs.append((("json_schema", _schema_text(so.json_, "structured_outputs.json")),
                          "structured_outputs"))
        if so.regex is not None:
            specs.append((("regex", so.regex), "structured_outputs"))
        if so.choice is not None:
            specs.append((("choice", _choices(so.choice, "structured_outputs.choice")), "structured_outputs"))
        if so.grammar is not None:
            specs.append((("ebnf", so.grammar), "structured_outputs"))
        if so.json_object:
            specs.append((("json_object", ""), "structured_outputs"))
    if body.guided_json is not None:
        specs.append((("json_schema", _schema_text(body.guided_json, "guided_json")), "guided_json"))
    if body.guided_regex is not None:
        specs.append((("regex", body.guided_regex), "guided_regex"))
    if body.guided_choice is not None:
        specs.append((("choice", _choices(body.guided_choice, "guided_choice")), "guided_choice"))
    if body.guided_grammar is not None:
        specs.append((("ebnf", body.guided_grammar), "guided_grammar"))
    if len(specs) > 1:
        raise SpecError("ask for one structured output at a time (got "
                        + ", ".join(sorted({p for _, p in specs})) + ")", specs[1][1])
    return specs[0][0] if specs else None


def _choices(choices: list[str], param: str) -> str:
    if not choices:
        raise SpecError(f"{param} must list at least one choice", param)
    return json.dumps(list(choices))
