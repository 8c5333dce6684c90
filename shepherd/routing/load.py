"""Load-only policies: they look at the replicas, never at the prompt."""
from __future__ import annotations

import random as _random

from shepherd.routing.base import RoutingPolicy


class RandomPolicy(RoutingPolicy):
    """A uniformly random healthy replica.

    Knobs: seed (0) for the policy's own random stream."""
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.rng = _random.Random(seed)

    def _choose(self, request, cands):
        self.last_reason = "random"
        return cands[self.rng.randrange(len(cands))]


class RoundRobinPolicy(RoutingPolicy):
    """Each healthy replica in turn. No knobs."""
    name = "round-robin"

    def _choose(self, request, cands):
        self.last_reason = "rr"
        r = cands[self._rr % len(cands)]
        self._rr += 1
        return r


class LeastRequestPolicy(RoutingPolicy):
    """Fewest requests on the replica (`ReplicaState.load`); round robin among ties. No knobs."""
    name = "least-request"

    def _choose(self, request, cands):
        self.last_reason = "least"
        return self._least_loaded(cands)


class ShortestQueuePolicy(RoutingPolicy):
    """SGLang's data-parallel controller `shortest_queue`: the worker with the
    fewest requests the controller has sent and not seen finish (the owner's
    `in_flight`), round robin among ties. Unlike least-request it ignores
    the replicas' own metrics, as SGLang's controller does. No knobs."""
    name = "shortest-queue"

    def _choose(self, request, cands):
        self.last_reason = "shortest"
        return self._pick_min(cands, lambda r: r.in_flight)


class PowerOfTwoPolicy(RoutingPolicy):
    """Two distinct replicas drawn at random, the less loaded of the two.

    Knobs: seed (0) for the draws."""
    name = "power-of-two"

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.rng = _random.Random(seed)

    def _choose(self, request, cands):
        self.last_reason = "p2c"
        if len(cands) == 1:
            return cands[0]
        a, b = self.rng.sample(range(len(cands)), 2)
        ra, rb = cands[a], cands[b]
        return rb if rb.load < ra.load else ra


class LeastKVPolicy(RoutingPolicy):
    """Lowest KV-cache use; then fewest requests; then round robin. No knobs."""
    name = "least-kv"

    def _choose(self, request, cands):
        self.last_reason = "least-kv"
        return self._pick_min(cands, lambda r: (round(r.kv_usage, 6), r.load))
