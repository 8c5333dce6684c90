"""What every routing policy shares: the state the owner passes in, the
filter (healthy replicas only) and the picker (smallest key, round robin
among ties).

Contract for the owner of a policy (the gateway or the simulator):

    policy = make_policy("prefix-aware", block_size=128)
    replica = policy.choose(request, replicas)     # replicas: list[ReplicaState]
    replica.in_flight += 1; policy.on_dispatch(request, replica)
    ...
    replica.in_flight -= 1; policy.on_finish(request, replica, output_tokens)

`choose` only considers replicas with `healthy=True`; it raises
`NoReplicaAvailable` when there is none. The owner keeps `in_flight` (it is
exact and immediate) and may refresh `running`, `waiting` and `kv_usage` from
the replicas' metrics; `ReplicaState.load` is what the load-aware policies
compare. Every policy sets `last_reason` after `choose` (for metrics and
debugging: "hit", "imbalance", "miss", ...).
"""
from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Sequence


class NoReplicaAvailable(RuntimeError):
    """No healthy replica to route to."""


@dataclass
class ReplicaState:
    index: int                      # position in the owner's list (stable for the simulator)
    url: str = ""                   # base URL (gateway); "" in the simulator
    healthy: bool = True
    in_flight: int = 0              # requests dispatched and not yet ended, counted by the owner
    running: int = 0                # from the replica's metrics (num_requests_running)
    waiting: int = 0                # from the replica's metrics (num_requests_waiting)
    kv_usage: float = 0.0           # fraction of KV capacity in use, in [0, 1]
    metrics_at: Optional[float] = None  # when running/waiting/kv_usage were last refreshed
    name: str = ""                  # free label (pod name, "replica-3")
    # LoRA adapters the replica says it holds (vllm:lora_requests_info's running and waiting
    # adapters; the simulator: its adapter slots); adapter-affinity reads it
    adapters: frozenset = frozenset()
    base_models: frozenset = frozenset()   # the names it serves its base model under (a request
                                           # naming one is a base-model request)

    @property
    def key(self) -> Hashable:
        """Identity used in the policies' maps: the URL when there is one
        (stable when backends are added or removed), else the index."""
        return self.url or self.index

    @property
    def id(self) -> Hashable:
        return self.key

    @property
    def load(self) -> int:
        """Requests on the replica as far as the router knows: the gateway's
        own in-flight count, or the replica's running + waiting when that is
        larger (other clients, or the owner does not count)."""
        return max(self.in_flight, self.running + self.waiting)


@dataclass
class RouteRequest:
    text: str = ""                          # prompt text (chat: the messages flattened)
    token_ids: Optional[list[int]] = None   # prompt token ids when the owner has them
    user: Optional[str] = None              # OpenAI `user` / X-Client-Id: the unit of fairness
    session: Optional[str] = None           # session id (session affinity)
    headers: dict = field(default_factory=dict)   # lower-cased request headers
    input_tokens: int = 0                   # prompt length in tokens (estimate is fine)
    now: float = 0.0                        # the owner's clock, seconds
    hash_ids: Optional[list[int]] = None    # precomputed prefix-chained block ids (Mooncake traces)
    max_tokens: int = 0                     # requested output length, when known
    req_id: str = ""
    adapter: Optional[str] = None           # the LoRA adapter the request names (None: the base model)


def healthy(replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    """The filter every policy starts from."""
    out = [r for r in replicas if r.healthy]
    if not out:
        raise NoReplicaAvailable("no healthy replica")
    return out


def stable_hash(*parts: Any) -> int:
    """64-bit hash that is the same in every process (Python's str hash is salted)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(str(p).encode("utf-8", "surrogatepass"))
        h.update(b"\x1f")
    return int.from_bytes(h.digest(), "little")


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / n      # population std, as AIBrix
    return mean, math.sqrt(var)


class RoutingPolicy:
    """Base class. Subclasses implement `_choose(request, candidates)` over the
    healthy replicas (never empty)."""

    name = "base"
    # a KVBlockIndex (shepherd/kv_events/index.py) for the owner to feed with the replicas'
    # KV events, on policies that read them (precise-prefix, weighted with precise > 0)
    kv_index = None

    def __init__(self) -> None:
        self.last_reason = ""
        self.reasons: Counter = Counter()      # decisions so far, by reason
        self._rr = 0

    # -- public API --------------------------------------------------------
    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        cands = healthy(replicas)
        self.last_reason = ""
        r = self._choose(request, cands)
        self.reasons[self.last_reason] += 1
        return r

    def on_dispatch(self, request: RouteRequest, replica: ReplicaState) -> None:
        """Called by the owner when the request was sent to `replica`."""

    def on_finish(self, request: RouteRequest, replica: ReplicaState, output_tokens: int) -> None:
        """Called by the owner when the request ended (any way)."""

    def forget(self, key: Hashable) -> None:
        """A replica was removed for good: drop what the policy remembers of it."""

    # -- for subclasses ----------------------------------------------------
    def _choose(self, request: RouteRequest, cands: list[ReplicaState]) -> ReplicaState:
        raise NotImplementedError

    def _pick_min(self, cands: Sequence[ReplicaState], key: Callable[[ReplicaState], Any]) -> ReplicaState:
        """The picker: the replica with the smallest key; round robin among ties
        (so that equal replicas share the work instead of the first taking it all)."""
        best = min(key(r) for r in cands)
        ties = [r for r in cands if key(r) == best]
        if len(ties) == 1:
            return ties[0]
        r = ties[self._rr % len(ties)]
        self._rr += 1
        return r

    def _least_loaded(self, cands: Sequence[ReplicaState]) -> ReplicaState:
        return self._pick_min(cands, lambda r: r.load)
