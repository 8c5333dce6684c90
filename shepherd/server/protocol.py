"""Request models of the OpenAI-compatible API (pydantic v2).

Field names, defaults and ranges follow the OpenAI API; vLLM's sampling
extras (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids,
include_stop_str_in_output, priority) are accepted too. Unknown fields are
ignored, as OpenAI and vLLM do. Range checks that need the model (context
length, model name) are done by the server, not here.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: Optional[str] = None          # optional like vLLM: defaults to the served model
    n: int = Field(1, ge=1, le=128)
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None  # None = 1.0
    top_p: Optional[float] = None        # None = 1.0
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    seed: Optional[int] = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: Optional[str] = None
    # vLLM extras
    top_k: Optional[int] = None          # None / 0 / -1 = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    priority: int = 0

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v):
        if v is not None and v < 1:
            raise ValueError("max_tokens must be at least 1")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        if v is not None and v < 0:
            raise ValueError("temperature must be >= 0")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v):
        if v is not None and not (0.0 < v <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v is not None and v < -1:
            raise ValueError("top_k must be -1 (off), 0 (off) or a positive integer")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

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
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts of a (possibly batched) completion request, each a str or a token-id list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: Optional[int] = None
    add_generation_prompt: bool = True
    # accepted and ignored: the model does no tool calling / structured output
    tools: Optional[Any] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[Any] = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _mct(cls, v):
        if v is not None and v < 1:
            raise ValueError("max_completion_tokens must be at least 1")
        return v

    @model_validator(mode="after")
    def _checks(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @property
    def effective_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
