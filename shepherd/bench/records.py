"""One record per request, the common currency of `simulate` and `bench`.

The simulator fills it on its virtual clock, the load generator on the wall
clock; bench/report.py turns a list of them into summary.json and plots.
Times are seconds since the start of the run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RequestRecord:
    req_id: str
    client: str = "default"
    arrival: float = 0.0                    # when the request was issued / arrived
    prompt_tokens: int = 0
    output_tokens: int = 0
    first_token: Optional[float] = None     # time of the first output token
    token_times: list[float] = field(default_factory=list)  # time of every output token (first included)
    finish: Optional[float] = None
    ok: bool = True
    error_kind: Optional[str] = None        # "http_429", "http_500", "timeout", "disconnect", "error", ...
    preemptions: int = 0
    cached_tokens: int = 0                  # prompt tokens served by the prefix cache
    replica: Optional[int] = None
    # state intervals for timeline plots: (state, start, end), state in queued|prefill|decode|preempted
    intervals: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> Optional[float]:
        return None if self.finish is None else self.finish - self.arrival


@dataclass
class TraceRequest:
    """One request of a workload, as read from a trace or drawn synthetically
    (bench/traces.py). `arrival` is seconds from the start of the trace."""
    arrival: float
    prompt_tokens: int
    output_tokens: int
    client: str = "default"
    hash_ids: Optional[list[int]] = None      # Mooncake: one id per block; equal ids = equal prefix blocks
    prefix_group: Optional[str] = None        # synthetic shared system prompt / session id
    prompt_ids: Optional[list[int]] = None    # explicit token ids, when the workload builds them
    priority: int = 0
    index: Optional[int] = None               # position in the workload (set by the readers); seeds unique tokens
    prefix_tokens: int = 0                    # with prefix_group: how many leading tokens the group shares
    session: Optional[str] = None             # synthetic multi-turn session id
    turn: int = 0                             # turn number within the session
    adapter: Optional[str] = None             # the LoRA adapter it names (None: the base model)
    chunks: Optional[list[tuple[int, int]]] = None  # RAGPulse: (chunk id, tokens) in prompt order; equal ids = equal tokens
