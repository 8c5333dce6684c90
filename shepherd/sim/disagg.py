"""Prefill/decode disaggregation in the simulator (a fleet with prefill replicas).

A request is routed to a replica that decodes first (the fleet's router). If the part of
its prompt that replica has not cached is at least `PDConfig.threshold` tokens (llm-d's
and Dynamo's conditional decider; 0 disaggregates everything, as DistServe does), its
prefill goes to a prefill replica (`PDConfig.prefill_router`, least-request by default) as
a request for one token: the prefill replica computes the prompt and samples the first
token, which is the request's first token (its TTFT). The KV then crosses the link,
`link_latency + prompt tokens x KV bytes per token / link_bw`, and the request joins the
decode replica with its prompt's KV in place (`Request.kv_ready`): the decode replica
allocates that KV at admission without computing it and runs the first output token as
a decode. Shorter uncached parts are prefilled where they decode, as an ordinary replica
does.

Events keep their order: before anything happens at time t, every prefill replica runs
the steps that start before t (they depend on nothing but their own arrivals), which puts
every handoff due before t in the heap; `due(t)` hands them out in time order.
"""
from __future__ import annotations

import heapq
import math
from typing import Iterator

from shepherd.bench.records import TraceRequest
from shepherd.request import Request, SamplingParams
from shepherd.sim.fleet import PDConfig
from shepherd.sim.pools import RoutePool
from shepherd.sim.replica import Track


class Disaggregation:
    def __init__(self, cfg: PDConfig, prefill: RoutePool):
        self.cfg = cfg
        self.pool = prefill
        self._heap: list = []          # (time, seq, decode replica, track)
        self._seq = 0
        self._pending: dict = {}       # req_id -> (decode replica, its SamplingParams, target output length)
        self.disaggregated = 0
        self.local = 0
        self.transfer_s = 0.0
        self.transfer_tokens = 0

    def wants(self, decode_rep, req: Request) -> bool:
        """The conditional decider: disaggregate when the decode replica would compute at
        least `threshold` prompt tokens itself (what its prefix cache does not hold)."""
        if self.cfg.threshold <= 0:
            return True
        tree = decode_rep.sched.kv.tree
        hit = tree.match_len(req.prompt_ids[:-1]) if tree is not None else 0
        return len(req.prompt_ids) - hit >= self.cfg.threshold

    def send(self, tr: TraceRequest, req: Request, target: int, decode_rep, track_rec, now: float):
        """(prefill replica, its track) for req's prefill; its decode continues on decode_rep."""
        rep = self.pool.choose(tr, req, now)
        self._pending[req.req_id] = (decode_rep, req.params, target)
        pre = Request(req_id=req.req_id, prompt_ids=req.prompt_ids,
                      params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                      arrival=now, client=req.client, priority=req.priority, eos_token_ids=req.eos_token_ids)
        _keep_stream(req, pre)
        self.disaggregated += 1
        return rep, Track(track_rec, pre, 1)

    def owns(self, req_id: str) -> bool:
        return req_id in self._pending

    def dropped(self, req_id: str):
        """A prefill replica refused req_id: forget it; returns the decode replica it was meant for."""
        return self._pending.pop(req_id)[0]

    def prefilled(self, rep, tr: Track):
        """A request's prefill ended on prefill replica `rep`: (decode replica, the track that
        carries it on) when it has tokens left to decode, else (decode replica, None) (its
        record is complete, or it failed)."""
        rec = tr.rec
        drep, params, target = self._pending.pop(rec.req_id)
        self.pool.finished(rep, rec.req_id, rec.finish, tr.ntok)
        if not rec.ok or tr.ntok >= target:
            return drep, None
        t = rec.finish
        pre = tr.req
        req = Request(req_id=pre.req_id, prompt_ids=pre.prompt_ids, params=params, arrival=t, client=pre.client,
                      priority=pre.priority, eos_token_ids=pre.eos_token_ids)
        _keep_stream(pre, req)
        req.output_ids = list(pre.output_ids)
        req.kv_ready = len(pre.prompt_ids)
        nxt = Track(rec, req, target)
        nxt.pieces, nxt.ntok = tr.pieces, tr.ntok
        nxt.state, nxt.since = "transfer", t
        rec.finish = None
        dt = self.cfg.transfer_time(len(pre.prompt_ids), drep.cost.kv_bytes_per_token)
        self.transfer_s += dt
        self.transfer_tokens += len(pre.prompt_ids)
        self._seq += 1
        heapq.heappush(self._heap, (t + dt, self._seq, drep, nxt))
        tr.req = None            # the prefill side's request is done with
        tr.pieces = []
        return drep, nxt

    def due(self, t: float) -> Iterator[tuple[float, object, Track]]:
        """Run the prefill replicas up to t, then hand out every transfer that lands by t, in
        time order: (landing time, decode replica, track)."""
        for rep in self.pool.replicas:
            rep.advance_to(t)
        heap = self._heap
        while heap and heap[0][0] <= t:
            when, _, drep, track = heapq.heappop(heap)
            yield when, drep, track

    def next_landing(self) -> float:
        """When the first KV transfer in flight lands (inf: none)."""
        return self._heap[0][0] if self._heap else math.inf

    def summary(self) -> dict:
        n = self.disaggregated
        return {"threshold": self.cfg.threshold, "link_gb_s": self.cfg.link_bw / 1e9,
                "link_latency_s": self.cfg.link_latency, "disaggregated": n, "prefilled_locally": self.local,
                "transfer_s_mean": self.transfer_s / n if n else None, "transfer_tokens": self.transfer_tokens,
                "prefill_routing": self.pool.reasons}


def _keep_stream(src: Request, dst: Request) -> None:
    """A session's turn answers with its session's tokens (Simulator.make_request): on both sides."""
    stream = getattr(src, "sim_stream", None)
    if stream is not None:
        dst.sim_stream = stream


__all__ = ["Disaggregation"]
