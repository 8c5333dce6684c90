"""The scheduler: waiting queue, running set, one decision per step.

PUBLIC API (the engine, the simulator and the tests rely on exactly this; the
scheduler helper fills in the bodies). Pure logic: no tensors, no clock of its
own (`now` is passed in), no I/O except logging.

    sched = Scheduler(SchedulerConfig(...), host_kv_capacity=0, max_model_len=8192)
    sched.add(req, now)            # raises QueueFull (-> HTTP 429) or RequestRejected (-> HTTP 400)
    out = sched.abort(req_id, now) # -> RequestOutput (terminal, ABORT) or None if unknown/finished;
                                   #    frees its KV at once; the executor is told via the next batch.released
    out = sched.finish(req_id, reason, now)  # engine found a stop string: terminal output, KV freed
    batch = sched.schedule(now)    # -> ScheduledBatch (may be empty)
    outs = sched.on_step(batch, result, now)  # append sampled tokens, detect EOS/stop ids/max_tokens,
                                              # return one RequestOutput per request that produced a token
                                              # or finished (errors too)
    sched.has_work                 # anything waiting, running or swapped
    sched.stats()                  # -> SchedulerStats
"""
from __future__ import annotations

from dataclasses import dataclass


class QueueFull(Exception):
    """max_queue / max_concurrency reached: answer 429 with Retry-After."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class RequestRejected(ValueError):
    """The request can never be served under this configuration (e.g. prompt + 1 > capacity)."""


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
