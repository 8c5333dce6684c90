"""The step contract: what the Scheduler hands an Executor and what comes back.

The scheduler emits a ScheduledBatch; an Executor runs it and returns a
StepResult. The torch executor runs the real model on the wall clock; the
simulated executor returns tokens and a step time from a cost model. Both
see the same batches, which is what lets the simulator and the engine share
one scheduler. It sits at the bottom of the layers (beside request.py) so
that scheduler/, engine/ and sim/ all import it from below.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from shepherd.request import Request, TokenLogprob


@dataclass
class ScheduledSeq:
    """One request's work in one step: feed `token_ids` at positions
    start_pos .. start_pos+len-1, writing their K/V into `req.slots` at those
    positions, attending over req.slots[: start_pos + len(token_ids)]."""
    req: Request
    token_ids: list[int]
    start_pos: int
    sample: bool          # this chunk ends at the last known token: sample the next one
    fresh: bool = False   # req.slots was (re)built since the executor last saw this request

    @property
    def req_id(self) -> str:
        return self.req.req_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_prefill(self) -> bool:
        return not (self.num_tokens == 1 and self.start_pos == self.req.num_tokens - 1)


@dataclass
class SwapOp:
    """Move a request's KV between device slots and the host pool.
    swap_out: copy K/V at `slots` to host under req_id (the slots are then freed).
    swap_in: copy the host copy of req_id back into `slots` (same length, same order)."""
    req_id: str
    slots: list[int]


@dataclass
class ScheduledBatch:
    step: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[SwapOp] = field(default_factory=list)   # done before the forward
    swap_in: list[SwapOp] = field(default_factory=list)    # done before the forward, after swap_out
    released: list[str] = field(default_factory=list)      # req ids the executor may forget (finished, aborted, preempted)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def empty(self) -> bool:
        return not self.seqs and not self.swap_out and not self.swap_in


@dataclass
class StepResult:
    tokens: dict[str, int] = field(default_factory=dict)              # req_id -> sampled token, for seqs with sample=True
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)   # only for requests that asked
    step_time: float = 0.0                                            # seconds: measured (torch) or modelled (sim)
    errors: dict[str, str] = field(default_factory=dict)              # req_id -> why no token was sampled


class Executor(Protocol):
    """What the Engine needs from whatever runs batches (torch or simulated)."""
    kv_capacity: int                    # device KV slots, in tokens
    host_kv_capacity: int               # host (swap) pool size in tokens; 0 = no swap
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    model_name: Optional[str]           # None: the engine names the model after its path
    tokenizer: Any                      # None: the engine loads one for the model
    paced: bool                         # True: the engine waits out step_time on the wall clock

    def execute(self, batch: ScheduledBatch) -> StepResult: ...
