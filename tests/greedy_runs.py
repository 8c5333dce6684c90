"""Serve prompts greedily on a real executor through run_offline, for the tests that compare
one run's tokens with another's (preemption, prefix cache, speculation)."""
from __future__ import annotations

from shepherd.config import SchedulerConfig
from shepherd.engine.offline import run_offline
from shepherd.request import Request, SamplingParams
from shepherd.scheduler.scheduler import Scheduler

_runs = [0]


def serve_greedy(ex, prompts, cfg: SchedulerConfig, new: int, arrivals=None):
    """Each prompt as one request of `new` tokens (EOS ignored); returns (outputs, stats).
    Request ids are unique across calls, so a shared executor never mixes two runs' state."""
    s = Scheduler(cfg, host_kv_capacity=ex.host_kv_capacity, max_model_len=ex.max_model_len)
    _runs[0] += 1
    reqs = [Request(f"g{_runs[0]}-{i}", list(p), SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True),
                    arrival=(arrivals or [0.0] * len(prompts))[i], eos_token_ids=ex.eos_token_ids)
            for i, p in enumerate(prompts)]
    run_offline(s, ex, reqs)
    s.check_integrity()
    return [r.output_ids for r in reqs], s.stats()
