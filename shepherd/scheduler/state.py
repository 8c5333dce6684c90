"""The scheduler's records: per-request bookkeeping, counters, the public
snapshot, and the two ways an add() can be refused."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from shepherd.request import Request


class QueueFull(Exception):
    """max_queue / max_concurrency reached: answer 429 with Retry-After. `kind` names the
    limit ("queue_full": max_queue, "concurrency_full": max_concurrency) for reports."""

    def __init__(self, message: str, retry_after: float = 1.0, kind: str = "queue_full"):
        super().__init__(message)
        self.retry_after = retry_after
        self.kind = kind


class RequestRejected(ValueError):
    """The request can never be served under this configuration (e.g. prompt + 1 > capacity).
    `kind` says why, for reports: "context_length" (beyond max_model_len), "kv_capacity"
    (more KV than the pool holds), "invalid" (anything else)."""

    def __init__(self, message: str, kind: str = "invalid"):
        super().__init__(message)
        self.kind = kind


@dataclass
class SchedulerStats:
    step: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_capacity: int = 0
    kv_used: int = 0          # slots held by requests (running, or locked cache nodes they use)
    kv_evictable: int = 0     # slots held only by the prefix cache, reclaimable
    kv_free: int = 0          # never-used or released slots; free + evictable + used == capacity
    preemptions: int = 0
    preempted_tokens: int = 0         # KV tokens thrown away (recompute) or moved (swap) by preemption
    prefix_query_tokens: int = 0      # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0        # of those, served from the cache
    # last step's prefill, for SGLang-style log lines
    last_prefill_seqs: int = 0
    last_prefill_tokens: int = 0
    last_cached_tokens: int = 0
    last_decode_seqs: int = 0
    prefill_budget: int = 0           # Scheduler.prefill_budget: the time budget's prompt tokens (0 = none)
    num_prefilling: int = 0           # running requests whose prompt is not fully computed
    kv_peak_used: int = 0             # max kv_used seen at the end of any schedule()
    kv_host_capacity: int = 0
    kv_host_used: int = 0             # swap pool tokens in use
    new_token_ratio: float = 0.0      # optimistic admission's current growth estimate
    generated_tokens: int = 0         # total tokens sampled
    prefill_tokens: int = 0           # total prompt tokens computed (cache hits excluded)
    finished: int = 0                 # requests ended with stop/length
    aborted: int = 0
    errors: int = 0
    swap_out_tokens: int = 0          # totals of the swap ops emitted
    swap_in_tokens: int = 0
    last_swap_out: int = 0
    last_swap_in: int = 0
    last_preemptions: int = 0         # preemptions made by the last schedule()
    # speculative decoding (vLLM's spec_decode counters): verify runs, drafts fed, drafts accepted
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    last_draft_tokens: int = 0        # drafts fed in the last step
    # LoRA adapters (scheduler/adapters.py): vLLM's lora_requests_info labels, and slot loads
    max_lora: int = 0
    running_lora_adapters: str = ""   # comma-separated names
    waiting_lora_adapters: str = ""
    lora_loads: int = 0

    def begin_step(self) -> None:
        """Zero the per-step figures (the last_* fields)."""
        self.last_prefill_seqs = self.last_prefill_tokens = self.last_cached_tokens = 0
        self.last_decode_seqs = 0
        self.last_swap_in = self.last_swap_out = self.last_preemptions = 0
        self.last_draft_tokens = 0


class SchedulerSnapshot(NamedTuple):
    """A cheap O(1) view for the simulator's time series and for metrics
    (stats() copies every counter and walks the running set)."""
    step: int
    kv_used: int
    num_running: int
    num_waiting: int
    num_swapped: int
    preemptions: int


class Entry:
    """Scheduler-private bookkeeping for one request."""
    __slots__ = ("req", "seq", "enq_step", "admit_seq", "node", "cached_len", "limit", "final",
                 "rand_key", "synced", "announced", "host_tokens", "admitted_once", "stop_ids", "out_at_admit",
                 "prefix_memo", "drafts")

    def __init__(self, req: Request, seq: int, step: int, limit: int, rand_key: float):
        self.req = req
        self.seq = seq
        self.enq_step = step
        self.admit_seq = 0
        self.node = None                             # locked prefix-cache node, if any
        self.cached_len = 0                          # leading slots owned by the prefix cache
        self.limit = limit                           # effective max output tokens
        self.final = len(req.prompt_ids) + limit - 1  # positions that may ever need KV
        self.rand_key = rand_key
        self.synced = 0                              # leading slots the executor holds (0: rebuilt)
        self.announced = False                       # the executor has had its NewRequest
        self.host_tokens = 0                         # tokens held in the host (swap) pool
        self.admitted_once = False
        self.out_at_admit = 0
        self.stop_ids = req.stop_id_set()
        self.prefix_memo = None                      # RadixCache.match_memo's answer for it, while waiting
        self.drafts: list[int] = []                  # the executor's proposed next tokens (speculation)

    def in_prefill(self) -> bool:
        r = self.req
        return r.num_computed < r.num_tokens - 1
