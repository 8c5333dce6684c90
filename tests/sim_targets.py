"""Scheduling tests give a simulated request its output length (where its EOS falls) on the
request itself, `r.sim_output_len = n`; the simulated executor, which never sees a Request,
learns it by id from run_offline here."""
from __future__ import annotations

from typing import Iterable

from shepherd.engine import offline
from shepherd.request import Request


def targets(reqs: Iterable[Request]) -> dict[str, int]:
    return {r.req_id: r.sim_output_len for r in reqs if getattr(r, "sim_output_len", None) is not None}


def run_offline(scheduler, executor, requests, **kw):
    """shepherd.engine.offline.run_offline, after telling the executor the requests' output lengths."""
    requests = list(requests)
    executor.output_lens.update(targets(requests))
    return offline.run_offline(scheduler, executor, requests, **kw)


def prefill_chunks(scheduler, executor, requests, rid: str, beside: str = "dec") -> list[tuple[int, bool]]:
    """Run `requests` offline; the prompt tokens `rid` computed in each step it prefilled, and
    whether `beside` had a sequence in that step."""
    chunks = []

    def obs(b, o, t0, t1):
        n = sum(sq.num_tokens for sq in b.seqs if sq.req_id == rid and sq.is_prefill)
        if n:
            chunks.append((n, any(sq.req_id == beside for sq in b.seqs)))
    run_offline(scheduler, executor, requests, observer=obs)
    return chunks
