"""The step contract: what the Scheduler hands an Executor each step, and what comes back.

Changes, not live objects (as vLLM v1's SchedulerOutput). The scheduler keeps
its Requests to itself; an executor builds its own per-request state from
these messages and never reads the scheduler's:

  - a request the executor has not seen arrives once, as a NewRequest (its
    prompt, sampling parameters and EOS ids);
  - every request that runs in the step is a ScheduledSeq: the tokens to feed
    (a prompt chunk, or a decode's last sampled token), their positions, the
    slots its slot table gained since the executor last saw it, and whether
    to sample;
  - requests that ended are listed by id in `finished`: the executor forgets
    them (a preempted request is not listed: its sampling state lives on, and
    its slot table is rebuilt when it runs again);
  - swaps move KV between the device pool and the host pool;
  - LoRA loads put an adapter's weights into one of the executor's adapter
    slots before the forward (the scheduler decides which adapters are
    resident, as it decides which KV slots are used).

Speculative decoding rides on the same messages: a StepResult may carry
drafts (proposed next tokens) per request; the scheduler feeds some of them
in a later step after the request's last token (`num_draft`), the executor
verifies them in that step's one forward and returns the tokens it accepted
(1 to num_draft + 1), and the scheduler frees the slots of the rejected ones.
A NewRequest is where per-request executor state such as an adapter id goes.

It sits at the bottom of the layers (beside request.py) so that scheduler/,
engine/ and sim/ all import it from below.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from shepherd.config import ConfigError
from shepherd.request import SamplingParams, TokenLogprob


@dataclass(slots=True)
class NewRequest:
    """A request the executor has not seen: what it keeps for the request's life. The lists
    are shared with the scheduler and never modified by either side."""
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    adapter: Optional[str] = None      # the LoRA adapter the request runs with (None: the base model)


@dataclass(slots=True)
class ScheduledSeq:
    """One request's work in one step. First the request's slot table (position -> KV slot)
    from index `slots_from` on becomes `new_slots` (slots_from is the length the executor
    holds when the table only grew, 0 when it was rebuilt); then `token_ids` are fed at
    positions start_pos .., their K/V written to those positions' slots, each attending over
    every position up to its own; `sample`: a token is sampled after the last one.

    Speculation: the last `num_draft` token_ids are drafts. The executor samples after the
    request's last known token and after each draft, and returns the sampled tokens up to and
    including the first that is not the next draft (1..num_draft+1 tokens; every sample keeps
    the request's distribution: rejection sampling). `propose` > 0: draft up to that many next
    tokens after this step's, returned in StepResult.drafts."""
    req_id: str
    token_ids: list[int]
    start_pos: int
    sample: bool
    slots_from: int = 0
    new_slots: list[int] = field(default_factory=list)
    num_draft: int = 0
    propose: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        """Positions known to the request after this step's tokens: its context length."""
        return self.start_pos + len(self.token_ids)

    @property
    def is_prefill(self) -> bool:
        """Not a decode (feeding exactly the last sampled token, and its drafts, to sample the next)."""
        return not (self.sample and len(self.token_ids) == 1 + self.num_draft)


@dataclass(slots=True)
class SwapOp:
    """Move a request's KV between device slots and the host pool.
    swap_out: copy K/V at `slots` to host under req_id (the slots are then freed).
    swap_in: copy the host copy of req_id back into `slots` (same length, same order)."""
    req_id: str
    slots: list[int]


@dataclass(slots=True)
class LoraLoad:
    """Load adapter `name` into adapter slot `slot` (replacing whatever was there) before the
    forward. The scheduler never replaces an adapter that a request of this step runs with."""
    slot: int
    name: str


@dataclass
class ScheduledBatch:
    step: int
    new: list[NewRequest] = field(default_factory=list)     # before anything else: requests seen first
    seqs: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[SwapOp] = field(default_factory=list)   # done before the forward
    swap_in: list[SwapOp] = field(default_factory=list)    # done before the forward, after swap_out
    finished: list[str] = field(default_factory=list)      # req ids that ended: forget them (first)
    lora_loads: list[LoraLoad] = field(default_factory=list)   # done before the forward

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def empty(self) -> bool:
        """Nothing to run: the executor is not called, and `finished` waits for a batch that runs."""
        return not self.seqs and not self.swap_out and not self.swap_in and not self.lora_loads


@dataclass
class StepResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)    # req_id -> tokens sampled (accepted), in order
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)   # one per token, if the request asked
    step_time: float = 0.0                                        # seconds: measured (torch) or modelled (sim)
    errors: dict[str, str] = field(default_factory=dict)          # req_id -> why no token was sampled
    drafts: dict[str, list[int]] = field(default_factory=dict)    # req_id -> proposed next tokens (seq.propose)
    # req_id -> its prompt's logprobs (RequestOutput.prompt_logprobs), in the step that samples its first token
    prompt_logprobs: dict[str, list[Optional[TokenLogprob]]] = field(default_factory=dict)


class ExecutorFull(Exception):
    """grammar_ready's answer where holding one more request's compiled grammar would pass the
    executor's bound on them: the core answers the request 429 with Retry-After, as a full queue."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class Executor(Protocol):
    """What the engine needs from whatever runs batches (torch or simulated). Every member is
    required (the core probes for none of them); an executor without grammars or adapters
    answers as PlainExecutor below does."""
    kv_capacity: int                    # device KV slots, in tokens
    host_kv_capacity: int               # host (swap) pool size in tokens; 0 = no swap
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    model_name: Optional[str]           # None: the engine names the model after its path
    tokenizer: Any                      # None: the engine loads one for the model
    paced: bool                         # True: on the wall clock, the engine waits out step_time

    def execute(self, batch: ScheduledBatch) -> StepResult: ...

    # Grammars compile off the step (issue 31): the core keeps a request whose grammar is not
    # compiled out of the scheduler (ServedCore parks it) and asks again each loop turn, so no
    # step waits for a compile. True once `spec` (kind, source) is compiled; else the compile
    # starts in the background and the answer is False; raises when it cannot be compiled.
    # Once True, the executor holds that compiled grammar for `req_id` until it forgets the
    # request (batch.finished), or until drop_grammar(req_id) where the scheduler refused it:
    # its compiler's cache may evict the spec in between, and no step may compile it again.
    # Raises ExecutorFull where the compiled grammars held for requests are at the executor's
    # bound (--max-grammar-memory): one client's distinct large grammars cannot fill the memory.
    def grammar_ready(self, req_id: str, spec: tuple[str, str]) -> bool: ...

    def drop_grammar(self, req_id: str) -> None: ...

    # Bytes of the compiled grammars it holds for requests, what that bound counts (/metrics:
    # shepherd:grammar_held_bytes).
    @property
    def grammar_bytes(self) -> int: ...

    # The served core calls this once it is ready: whatever a first grammar would build before
    # its compile (the compiler over the vocabulary) is built then, in the background, and not
    # beside the running streams of the first grammar request.
    def warm_grammar(self) -> None: ...

    # LoRA (issue 28). The scheduler decides which adapters sit in the executor's slots
    # (batch.lora_loads); the executor owns the adapters' weights, so the server asks it:
    # whether adapters can be served at all (--enable-lora / --lora-modules; False: the load and
    # unload endpoints answer that none are served) ...
    @property
    def lora_enabled(self) -> bool: ...

    # ... which adapter names a request may ask for (checked again at intake: an unload may
    # have raced the front's check) ...
    def lora_names(self) -> list[str]: ...

    # ... (name, folder) of each adapter served at start, for /v1/models ...
    def lora_adapters(self) -> list[tuple[str, str]]: ...

    # ... load and unload at run time (between steps; register raises model.lora.LoraError for a
    # bad folder; unregister is called only once the scheduler holds no request of the adapter) ...
    def register_lora(self, name: str, path: str) -> None: ...

    def unregister_lora(self, name: str) -> None: ...

    # ... and the seconds each adapter load took since the last call (the core calls it after
    # every step that ran): shepherd:lora_load_seconds.
    def take_lora_loads(self) -> list[float]: ...


class PlainExecutor:
    """The grammar and LoRA members of Executor for an executor that enforces no grammars and
    serves no adapters (the simulated one, the tests' scripted ones): every grammar is ready
    (it is not enforced), adapters are off. Subclass it and define the rest."""
    lora_enabled = False
    grammar_bytes = 0

    def grammar_ready(self, req_id: str, spec: tuple[str, str]) -> bool:
        return True

    def drop_grammar(self, req_id: str) -> None:
        pass

    def warm_grammar(self) -> None:
        pass

    def lora_names(self) -> list[str]:
        return []

    def lora_adapters(self) -> list[tuple[str, str]]:
        return []

    def register_lora(self, name: str, path: str) -> None:
        raise ConfigError("this engine serves no LoRA adapters (start it with --enable-lora)")

    def unregister_lora(self, name: str) -> None:
        raise ConfigError("this engine serves no LoRA adapters (start it with --enable-lora)")

    def take_lora_loads(self) -> list[float]:
        return []
