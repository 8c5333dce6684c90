"""Adapter affinity: a LoRA adapter's requests go where the adapter is loaded already.

A replica serves at most --max-loras adapters in a step and loads an adapter into a slot before
running it (docs/SERVING.md "LoRA adapters"), so sending an adapter where it is resident saves
the load and keeps the adapters of one replica few. One replica per adapter would pile a hot
adapter's requests on one replica, so a hot adapter spreads: when the least-loaded replica that
holds it has more than `max_imbalance` requests more than the least-loaded replica of all, the
request goes to that one, which then holds the adapter too (S-LoRA's and dLoRA's placement,
reduced to what a router sees: loads and who holds what).

Who holds an adapter: the replicas say so (`ReplicaState.adapters`: the gateway reads
vllm:lora_requests_info's running and waiting adapters, the simulator its replicas' adapter
slots), and the policy remembers where it sent each adapter, at most `max_loras` per replica,
least recently sent out first (a replica that holds more evicts too). Base-model requests go
to the least-loaded replica.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from shepherd.routing.base import RoutingPolicy


class AdapterAffinityPolicy(RoutingPolicy):
    """Knobs: max_imbalance (8) requests of extra load a holder may have over the least-loaded
    replica before a hot adapter spreads to it; max_loras (8) adapters remembered per replica."""
    name = "adapter-affinity"

    def __init__(self, max_imbalance: int = 8, max_loras: int = 8) -> None:
        super().__init__()
        if max_imbalance < 0 or max_loras < 1:
            raise ValueError("adapter-affinity: max_imbalance >= 0 and max_loras >= 1")
        self.max_imbalance = max_imbalance
        self.max_loras = max_loras
        self.sent: dict[Hashable, OrderedDict] = {}      # replica key -> adapters, least recent first

    def holds(self, replica, adapter: str) -> bool:
        return adapter in replica.adapters or adapter in self.sent.get(replica.key, ())

    def _choose(self, request, cands):
        a = request.adapter
        if a is None or any(a in r.base_models for r in cands):
            self.last_reason = "base"
            return self._least_loaded(cands)
        least = min(r.load for r in cands)
        holders = [r for r in cands if self.holds(r, a)]
        if not holders:
            self.last_reason = "miss"
            return self._least_loaded(cands)
        best = self._least_loaded(holders)
        if best.load - least > self.max_imbalance:
            self.last_reason = "spread"
            return self._least_loaded(cands)
        self.last_reason = "hit"
        return best

    def on_dispatch(self, request, replica) -> None:
        if request.adapter is None:
            return
        held = self.sent.setdefault(replica.key, OrderedDict())
        held.pop(request.adapter, None)
        held[request.adapter] = True
        while len(held) > self.max_loras:
            held.popitem(last=False)

    def forget(self, key) -> None:
        self.sent.pop(key, None)
