"""Requests as the scheduler sees them: token ids, sampling parameters, state.

The scheduler owns `state`, `num_computed`, `slots` and the counters; the
engine (or simulator) owns `output_ids` appends through Scheduler.on_step.
Nothing here touches tensors or reads a clock: times are passed in.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


class RequestState(enum.Enum):
    WAITING = "waiting"      # queued, holds no KV (or only locked prefix-cache nodes)
    RUNNING = "running"      # admitted: holds KV slots, scheduled every step
    SWAPPED = "swapped"      # preempted by swap: KV lives in the host pool
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"            # EOS, a stop token id or a stop string
    LENGTH = "length"        # max_tokens reached, or the context is full
    ABORT = "abort"          # client went away or asked to cancel
    ERROR = "error"          # the request can never be served (e.g. never fits)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None    # None = off; N = also return the top-N alternatives
    # None = off; N = each prompt token's logprob given the tokens before it, with the top-N
    # alternatives (vLLM's prompt_logprobs; completions' echo + logprobs). Such a request does not
    # read the prefix cache: every prompt position must run through the model.
    prompt_logprobs: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None   # token id -> added to its logit
    min_tokens: int = 0               # stop tokens are masked until this many tokens are out
    include_stop_str_in_output: bool = False
    # a grammar as its spec, (kind, text): kind json_schema | json_object | regex | choice | ebnf;
    # the compiled matcher lives beside the sampler (a spec pickles, a matcher does not)
    grammar: Optional[tuple[str, str]] = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Request:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival: float = 0.0
    client: str = "default"           # OpenAI `user` or X-Client-Id: the unit of fairness
    priority: int = 0                 # higher runs first under --policy priority
    eos_token_ids: tuple[int, ...] = ()
    # leading tokens whose KV arrives with the request, computed elsewhere (a prefill replica of
    # a disaggregated fleet): its first admission allocates their KV without computing it
    kv_ready: int = 0
    adapter: Optional[str] = None     # the LoRA adapter it runs with (OpenAI `model`); None: the base model

    # --- owned by the scheduler ---
    state: RequestState = RequestState.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0             # tokens of all_ids whose KV is in the device pool
    num_cached: int = 0               # of the prompt, tokens served by the prefix cache (last admission)
    slots: list[int] = field(default_factory=list)  # device KV slot of position i, for i < len(slots)
    preemptions: int = 0
    admitted_at: Optional[float] = None
    first_token_at: Optional[float] = None
    finished_at: Optional[float] = None
    finish_reason: Optional[FinishReason] = None
    error: Optional[str] = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining_output(self) -> int:
        return max(0, self.params.max_tokens - len(self.output_ids))

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def stop_id_set(self) -> frozenset[int]:
        return stop_ids(self.params, self.eos_token_ids)


def stop_ids(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
    """Token ids that end a request: its stop ids, plus EOS unless ignore_eos."""
    stop = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        stop.update(eos_token_ids)
    return frozenset(stop)


def context_error(prompt_len: int, max_model_len: int) -> Optional[str]:
    """The one context-length check: a prompt must leave room for one output token."""
    if prompt_len + 1 > max_model_len:
        return (f"prompt has {prompt_len} tokens; with one output token it exceeds "
                f"max_model_len={max_model_len}")
    return None


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first
    rank: Optional[int] = None        # 1 = the most likely token; set for prompt logprobs


@dataclass
class RequestOutput:
    """What one step produced for one request: the engine streams this out."""
    req_id: str
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: Optional[FinishReason] = None
    error: Optional[str] = None
    # with the first token, once, when params.prompt_logprobs is set: one per prompt token, None
    # for the first (nothing comes before it)
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
