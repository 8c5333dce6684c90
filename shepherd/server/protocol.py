"""Request models of the OpenAI-compatible API (pydantic v2).

Field names, defaults and ranges follow the OpenAI API; vLLM's sampling
extras (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids,
include_stop_str_in_output, min_tokens, priority, structured_outputs and
the older guided_* names) are accepted too. Unknown fields are
ignored, as OpenAI and vLLM do. Range checks that need the model (context
length, model name) are done by the server, not here.
"""
from __future__ import annotations

import functools
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_LOGPROBS = 20
MAX_STOP = 16
# OpenAI's (and Azure OpenAI's) own limit on a chat's messages. Checked before the messages are
# validated: a 1.2 MB chat of 43,000 empty messages took ~190 ms of validation alone, holding the
# GIL (in process); now it costs its count.
MAX_CHAT_MESSAGES = 2048


def at_most_messages(v, what: str = "messages"):
    """A field validator's body (mode="before"): a list longer than MAX_CHAT_MESSAGES is refused
    before one item is validated, with a message that names the limit (pydantic's own check
    validates the first 2,049 first, and its words name the union's every branch)."""
    if isinstance(v, list) and len(v) > MAX_CHAT_MESSAGES:
        raise ValueError(f"at most {MAX_CHAT_MESSAGES} {what}, got {len(v)}")
    return v
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


@functools.cache
def _defaulted(cls) -> dict[str, Any]:
    """Body key -> default, for the optional fields whose default is not None."""
    out = {}
    for name, f in cls.model_fields.items():
        if not f.is_required() and f.default is not None:
            out[f.alias or name] = f.default
            out[name] = f.default
    return out


@functools.cache
def _int_keys(cls) -> frozenset[str]:
    """Body keys of the scalar integer fields (int, Optional[int])."""
    return frozenset(k for name, f in cls.model_fields.items()
                     if f.annotation is int or f.annotation == Optional[int] for k in (name, f.alias or name))


def _nullable_in_schema(schema: dict, cls) -> None:
    props = schema.get("properties", {})
    for key in _defaulted(cls):
        p = props.get(key)
        if p is not None and "anyOf" not in p:
            props[key] = {"anyOf": [{k: v for k, v in p.items() if k not in ("title", "default")},
                                    {"type": "null"}], **{k: p[k] for k in ("title", "default") if k in p}}


class RequestModel(BaseModel):
    """A request body's model, strict ("n": "3" and "stream": "yes" are 400) but for two readings
    of JSON that its schema and vLLM share. An optional field sent as null takes its default, as
    in OpenAI's API, which declares them "or null": the official client sends `"n": null` for
    n=None, and apps pass their own None through (400 on `presence_penalty: null` broke them); the
    OpenAPI schema says so too. And a number with no fraction is an integer, as JSON Schema has
    it: `"max_tokens": 2.0` is 2 (a schema-driven client sent such numbers, and 2.5 stays a 400)."""
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=_nullable_in_schema)

    @model_validator(mode="before")
    @classmethod
    def _json_readings(cls, data):
        # runs for every object of a body (a chat's every message): kept to lookups where the
        # model has nothing to read so (a 43,000-message chat spent a third of its validation here)
        nulls, ints = _defaulted(cls), _int_keys(cls)
        if not (nulls or ints) or not isinstance(data, dict):
            return data
        if nulls and None in data.values():
            data = {k: v for k, v in data.items() if v is not None or k not in nulls}
        whole = [k for k in ints if type(data.get(k)) is float and data[k].is_integer()]
        if whole:
            data = {**data, **{k: int(data[k]) for k in whole}}
        return data


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(RequestModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)
    name: str = "response"
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _needs_schema(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("response_format json_schema needs json_schema.schema")
        return self


class StructuredOutputs(RequestModel):
    """vLLM's structured_outputs: exactly one of json / regex / choice / grammar (or json_object)."""
    json_: Optional[Union[str, dict[str, Any]]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = Field(None, min_length=1)
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


class _Sampling(RequestModel):
    # strict: "n": "3" or "stream": "yes" is a 400, as in OpenAI's API (ints still pass as floats)
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    model: Optional[str] = None          # optional like vLLM: defaults to the served model
    n: int = Field(1, ge=1, le=128)
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0)       # None = 1.0
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)     # None = 1.0
    stop: Optional[Union[str, Annotated[list[str], Field(max_length=MAX_STOP)]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    seed: Optional[int] = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: Optional[str] = None
    # vLLM extras
    top_k: Optional[int] = Field(None, ge=-1)                # None / 0 / -1 = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    # vLLM asks > 0; a penalty that divides logits by 1e-300 only makes them infinite
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    priority: int = 0
    # token id (as a string, OpenAI's shape) -> bias; ids and size are checked by the server
    logit_bias: Optional[dict[str, float]] = None
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and the older guided_*
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = Field(None, min_length=1)
    guided_grammar: Optional[str] = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        # before the union's own check, whose message would name both of its branches
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return v

    def logprob_entries(self, prompt_tokens: int, out_tokens: int) -> int:
        """Logprob entries (each token's own plus its alternatives) one choice of the answer
        carries, given its prompt's and its output's lengths."""
        return 0

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats (read with include_usage, as vLLM reads it): every chunk
        carries its choice's usage so far (guidellm asks for it)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)    # vLLM's
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    # vLLM's: each choice also carries prompt_token_ids and token_ids (a streamed chunk: its delta's,
    # the prompt's in the first only), for a client that sends the next turn as token ids
    return_token_ids: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _checks(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must equal n)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def logprob_entries(self, prompt_tokens: int, out_tokens: int) -> int:
        n = 0
        if self.logprobs is not None:
            n += (out_tokens + (prompt_tokens if self.echo else 0)) * (self.logprobs + 1)
        if self.prompt_logprobs is not None:
            n += prompt_tokens * (self.prompt_logprobs + 1)
        return n

    @property
    def prompt_logprobs_n(self) -> Optional[int]:
        """The top-N of the prompt's logprobs the engine computes: for prompt_logprobs, and for
        echo with logprobs (the echoed prompt's tokens carry theirs); None = not computed."""
        wanted = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        return max(wanted) if wanted else None

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts of a (possibly batched) completion request, each a str or a token-id list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCall(RequestModel):
    name: str
    arguments: str = "{}"


class ToolCall(RequestModel):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(RequestModel):
    name: str = Field(..., min_length=1, max_length=64)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        # an image or audio part would otherwise get pydantic's three-way union message, which
        # never says that the part's type is what is refused
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"part {i} of type {kind!r} is not supported: this server reads "
                                     "text parts only (type 'text')")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_CHAT_MESSAGES)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    add_generation_prompt: bool = True
    tools: Optional[list[Tool]] = Field(None, max_length=128)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, v):
        return at_most_messages(v)

    def logprob_entries(self, prompt_tokens: int, out_tokens: int) -> int:
        return out_tokens * ((self.top_logprobs or 0) + 1) if self.logprobs else 0

    @model_validator(mode="after")
    def _checks(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required":
            names = {t.function.name for t in self.tools or ()}
            if not names:
                raise ValueError("tool_choice required / named needs tools")
            if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        return self

    @property
    def effective_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1, max_length=MAX_CHAT_MESSAGES)
    add_special_tokens: Optional[bool] = None    # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, v):
        return at_most_messages(v)

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(RequestModel):
    model: Optional[str] = None
    tokens: list[int] = Field(..., max_length=1 << 20)


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter: serve the PEFT folder lora_path as model lora_name."""
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(..., min_length=1, max_length=256)
    lora_path: str = Field(..., min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's POST /v1/unload_lora_adapter (its lora_int_id is accepted and ignored)."""
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(..., min_length=1, max_length=256)
