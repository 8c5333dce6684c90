"""shepherd's routing policies as Ray Serve's request router.

    RequestRouterConfig(request_router_class=ShepherdRouter,
                        request_router_kwargs={"policy": "cache-aware", "knobs": {"cache_threshold": 0.5}})

The policy is the same object the gateway and the simulator build
(`shepherd.routing.make_policy`); this module only translates:

- Ray's `RunningReplica` -> shepherd's `ReplicaState`, keyed by the replica's
  unique id (the policies remember replicas by `key`, which is the `url`
  field, so a replica keeps its prefix history for its whole life).
  `running`, `waiting` and `kv_usage` come from the replica's
  `record_routing_stats()` (ray_replica.py), read by Ray every
  `request_routing_stats_period_s`; `in_flight` is counted here, exact and
  immediate, as the gateway counts it.
- the handle call's argument (`HttpCall`, built by the ingress) -> the
  `RouteRequest` the policy reads (the gateway's own `route_request_from`).
- a policy that reads KV events (precise-prefix, or weighted with a precise
  weight: `policy.kv_index`): each replica publishes its engine's KV events
  (ray_replica.py) and names the endpoints in its routing stats; this router
  subscribes (the gateway's KVEventSubscriber, feeding the policy's index) as
  it first sees them and unsubscribes when the replica leaves. The ingress
  gives each request its prompt token ids.
- the policy's one choice -> ranked tiers `[[chosen], [every other replica]]`:
  Ray takes the first tier whose replica has a free slot
  (`max_ongoing_requests`), so a full chosen replica falls back to the least
  loaded of the rest, and the fallback is defined.

Counting: +1 when the policy decides (as the gateway counts, so that the
next decision sees it), moved in `on_request_routed` when Ray had to use a
lower tier, -1 when the ingress ends its attempt (`finished`, in a
`finally`, with the output tokens vtc-basic charges). A request Ray re-routes
inside its router (the replica was full) keeps the first decision, so the
policy sees one decision per attempt, as in the gateway.

Ray pickles this module by value into every process that holds a handle:
keep module-level state out of it (ray_call.py holds the registry and the
call type, which must stay one class).

One router lives in each process that holds a handle to the replicas (each
ingress replica): several ingress replicas each keep their own policy state,
as several gateways would (docs/DEPLOY.md).
"""
from __future__ import annotations

import threading
from typing import Any, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from shepherd.deploy.ray_call import HttpCall, call_of, register_router
from shepherd.kv_events.subscriber import KVEventSubscriber, Source
from shepherd.routing import NoReplicaAvailable, ReplicaState, make_policy


class ShepherdRouter(RequestRouter):
    """A Ray Serve request router that asks a shepherd routing policy (see the module doc)."""

    def initialize_state(self, policy: str = "least-request", knobs: Optional[dict] = None) -> None:
        self.policy_name = policy
        self.policy = make_policy(policy, **(knobs or {}))
        self.states: dict[str, ReplicaState] = {}
        self._next_index = 0
        index = self.policy.kv_index
        self.kv = KVEventSubscriber(index) if index is not None else None
        self.kv_streams: dict[str, str] = {}         # replica key -> the KV-event endpoint subscribed to
        # choose runs on Ray's router loop, `finished` on the ingress's loop, /metrics on either
        self.lock = threading.Lock()
        register_router(self._deployment_id.name, self)

    # ------------------------------------------------------------------ state
    def _state(self, replica: RunningReplica) -> ReplicaState:
        key = replica.replica_id.unique_id
        st = self.states.get(key)
        if st is None:
            st = self.states[key] = ReplicaState(index=self._next_index, url=key,
                                                 name=replica.replica_id.to_full_id_str())
            self._next_index += 1
        stats = replica.routing_stats or {}
        st.running = int(stats.get("running", 0))
        st.waiting = int(stats.get("waiting", 0))
        st.kv_usage = float(stats.get("kv_usage", 0.0))
        st.healthy = bool(stats.get("alive", True))
        st.metrics_at = stats.get("at")
        if self.kv is not None and key not in self.kv_streams and stats.get("kv_events"):
            self.kv_streams[key] = stats["kv_events"]
            self.kv.add(Source(key, stats["kv_events"], stats.get("kv_replay"), stats.get("kv_topic") or ""))
            self.kv.start()
        return st

    def snapshot(self) -> tuple[list[tuple[ReplicaState, dict]], dict, dict]:
        """(each replica's state with its last routing stats, decisions by reason, each KV-event
        stream's {state, blocks} by replica key), for /metrics."""
        with self.lock:
            reps = []
            for r in list(self.curr_replicas.values()):
                st = self._state(r)
                reps.append((ReplicaState(**vars(st)), dict(r.routing_stats or {})))
            kv = {}
            if self.kv is not None:
                kv = {key: {"state": got["state"], "blocks": self.policy.kv_index.blocks(key)}
                      for key, got in self.kv.status().items()}
            return reps, dict(self.policy.reasons), kv

    # ------------------------------------------------------------------ Ray's hooks
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        call = call_of(pending_request)
        if not candidate_replicas:
            return []
        if call is None or call.route is None:
            return [list(candidate_replicas)]
        cands = [r for r in candidate_replicas if r.replica_id.unique_id not in call.exclude]
        cands = cands or list(candidate_replicas)
        by_key = {r.replica_id.unique_id: r for r in cands}
        with self.lock:
            key = call.decided if call.decided in by_key else None
            if key is None:
                states = [self._state(r) for r in cands]
                try:
                    st = self.policy.choose(call.route, states)
                except NoReplicaAvailable:
                    # every engine reports dead: health checks are replacing them; let Ray pick
                    return [cands]
                key = call.decided = st.key
                if not call.ended:
                    # counted at the decision, as the gateway counts: the next decision sees it
                    st.in_flight += 1
                    call.routed_to = key
                    self.policy.on_dispatch(call.route, st)
        chosen = by_key[key]
        return [[chosen], [r for r in cands if r is not chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Ray sent it to a replica of a lower tier (the chosen one was full): move the count there."""
        call = call_of(pending_request)
        if call is None or call.route is None:
            return
        with self.lock:
            new = self.states.get(replica_id.unique_id)
            if call.ended or call.routed_to is None or new is None or new.key == call.routed_to:
                return
            old = self.states.get(call.routed_to)
            if old is not None:
                old.in_flight = max(0, old.in_flight - 1)
            new.in_flight += 1
            call.routed_to = new.key

    def finished(self, call: HttpCall, output_tokens: int = 0) -> None:
        """The ingress ended this attempt (any way): the -1 of in-flight, the policy's on_finish."""
        with self.lock:
            call.ended = True
            key, call.routed_to = call.routed_to, None
            st = self.states.get(key) if key is not None else None
            if st is None:
                return
            st.in_flight = max(0, st.in_flight - 1)
            self.policy.on_finish(call.route, st, output_tokens)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._forget_except({r.replica_id.unique_id for r in replicas})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget_except({r.unique_id for r in self.curr_replicas})

    def _forget_except(self, live: set) -> None:
        with self.lock:
            for key in [k for k in self.states if k not in live]:
                del self.states[key]
                self.policy.forget(key)
                if self.kv_streams.pop(key, None) is not None:
                    self.kv.remove(key)
