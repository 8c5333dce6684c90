"""A routing domain of the simulator: the replicas one routing policy chooses among.

The policy is the gateway's own object (shepherd/routing/), told of each replica's
counts (a ReplicaState per replica, keyed by the replica's index in the whole fleet)
and of every dispatch and finish, as the gateway tells it. A plain run has one pool
over every replica; a disaggregated fleet has two (the replicas that decode, and the
prefill replicas: sim/disagg.py).

Policies that read no replica state (LAZY_POLICIES) only need the chosen replica
advanced to an arrival; those that read only counts (COUNT_POLICIES) need each
replica advanced only until its counts cannot change before it (Replica.advance_to
with settle).
"""
from __future__ import annotations

from shepherd.bench.records import TraceRequest
from shepherd.request import Request

# Policies whose choice reads no replica state, so routing can happen ahead of the
# replicas catching up to the arrival time. session-affinity is not among them:
# its fallback for requests without a session reads load.
LAZY_POLICIES = {"round-robin", "roundrobin", "rr", "random"}
# Policies that read replica counts (running, waiting, in flight) but not KV use: a
# replica is advanced only until its counts cannot change before an arrival
# (Replica.quiet_until); it catches up later with the same steps (the fast path's
# chunking does not change a token time).
COUNT_POLICIES = {"least-request", "least-loaded", "shortest-queue", "power-of-two", "p2c", "prefix-aware",
                  "prefix-cache", "prefix", "cache-aware", "cache_aware", "vtc-basic", "vtc", "session-affinity",
                  "session"}


class RoutePool:
    def __init__(self, replicas: list, name: str, knobs: dict, seed: int, skip_quiet: bool = True):
        from shepherd import routing as R
        self.R = R
        self.replicas = replicas
        self.name = name
        knobs = dict(knobs)
        try:
            if "seed" in R.policy_knobs(R.ALIASES.get(name, name)):
                knobs.setdefault("seed", seed)
        except Exception:   # a policy without a knob table: nothing to seed
            pass
        self.policy = R.make_policy(name, **knobs)
        self.states = [R.ReplicaState(index=rep.idx, name=f"replica-{rep.idx}") for rep in replicas]
        self._by_idx = {rep.idx: (rep, st) for rep, st in zip(replicas, self.states)}
        self.routes: dict = {}
        self.lazy = name in LAZY_POLICIES
        self.settle = skip_quiet and name in COUNT_POLICIES
        self.feed = None           # a SimKVFeed (sim/kv_feed.py) for a policy that reads KV events

    def advance(self, now: float) -> None:
        """Every replica the policy reads, as of `now` (nothing for a policy that reads none)."""
        if not self.lazy:
            for rep in self.replicas:
                rep.advance_to(now, settle=self.settle)

    def choose(self, tr: TraceRequest, req: Request, now: float):
        """The replica the policy picks for req (counted in flight there until finished())."""
        R = self.R
        if not self.lazy:
            for rep, st in zip(self.replicas, self.states):
                used, _cached, nrun, nwait, _ = rep.counts()
                st.running = nrun
                st.waiting = nwait
                st.kv_usage = used / max(1, rep.kv_capacity)
                st.metrics_at = now
                st.adapters = rep.adapters()
        if self.feed is not None:
            self.feed.sync()        # the replicas' caches as of now, exactly
        rr = R.RouteRequest(token_ids=req.prompt_ids, user=tr.client, session=tr.session,
                            input_tokens=tr.prompt_tokens, now=now, hash_ids=tr.hash_ids,
                            max_tokens=req.params.max_tokens, req_id=req.req_id, adapter=req.adapter)
        st = self.policy.choose(rr, self.states)
        st.in_flight += 1
        self.policy.on_dispatch(rr, st)
        rr.token_ids = None   # keep no prompt alive for on_finish
        rr.hash_ids = None
        self.routes[req.req_id] = rr
        return self._by_idx[st.index][0]

    def finished(self, rep, req_id: str, now: float, ntok: int) -> None:
        """req_id left `rep` (finished, or refused at add: ntok 0)."""
        st = self._by_idx[rep.idx][1]
        st.in_flight -= 1
        rr = self.routes.pop(req_id, None)
        if rr is not None:
            rr.now = now
            self.policy.on_finish(rr, st, ntok)

    @property
    def reasons(self) -> dict:
        return dict(self.policy.reasons)


__all__ = ["RoutePool", "LAZY_POLICIES", "COUNT_POLICIES"]
