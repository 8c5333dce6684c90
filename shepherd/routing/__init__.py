"""Routing policies: which replica serves a request.

Pure, synchronous, deterministic objects: no I/O, no sleeping, no clock of
their own (the time is passed in as `RouteRequest.now`), so the same policy
object runs inside the HTTP gateway (shepherd/gateway/app.py) and inside the
discrete-event simulator (shepherd/sim). The contract is in base.py.

Shaped as llm-d's plugins: a filter (base.healthy, scorers.saturation_filter),
scorers (scorers.py, reused by the weighted policy and prefix-aware), a
picker (RoutingPolicy._pick_min). One file per family:

    load.py          random, round-robin, least-request, shortest-queue, power-of-two, least-kv
    prefix_aware.py  AIBrix prefix-cache routing (prefix_index.py: block hashes, LRU index)
    cache_aware.py   SGLang router cache_aware (radix_tree.py: the approximate tree)
    fairness.py      AIBrix vtc-basic
    session.py       session affinity (rendezvous hashing)
    weighted.py      llm-d: filters, weighted normalised scorers, picker
    precise_prefix.py  precise prefix routing from the replicas' KV events (an index any owner feeds)
    registry.py      names, aliases, knobs, make_policy

docs/ROUTING.md explains each policy, its knobs and the defaults chosen.
"""
from shepherd.routing.base import NoReplicaAvailable, ReplicaState, RouteRequest, RoutingPolicy
from shepherd.routing.cache_aware import CacheAwarePolicy
from shepherd.routing.fairness import VTCBasicPolicy
from shepherd.routing.load import (LeastKVPolicy, LeastRequestPolicy, PowerOfTwoPolicy, RandomPolicy,
                                   RoundRobinPolicy, ShortestQueuePolicy)
from shepherd.routing.precise_prefix import PrecisePrefixPolicy, PrecisePrefixScorer
from shepherd.routing.prefix_aware import PrefixAwarePolicy
from shepherd.routing.prefix_index import TOKENIZER_TYPES, BlockPrefixIndex, block_hashes
from shepherd.routing.radix_tree import ApproxRadixTree
from shepherd.routing.registry import (ALIASES, POLICIES, POLICY_NAMES, make_policy, parse_knobs,
                                       policy_knobs)
from shepherd.routing.session import SessionAffinityPolicy
from shepherd.routing.weighted import DEFAULT_SCORER_WEIGHTS, SCORERS, WeightedPolicy, parse_weights

__all__ = [
    "ALIASES", "ApproxRadixTree", "BlockPrefixIndex", "CacheAwarePolicy", "DEFAULT_SCORER_WEIGHTS",
    "LeastKVPolicy", "LeastRequestPolicy", "NoReplicaAvailable", "POLICIES", "POLICY_NAMES",
    "PowerOfTwoPolicy", "PrecisePrefixPolicy", "PrecisePrefixScorer", "PrefixAwarePolicy", "RandomPolicy",
    "ReplicaState", "RoundRobinPolicy", "RouteRequest", "RoutingPolicy", "SCORERS", "SessionAffinityPolicy",
    "ShortestQueuePolicy", "TOKENIZER_TYPES", "VTCBasicPolicy", "WeightedPolicy", "block_hashes",
    "make_policy", "parse_knobs", "parse_weights", "policy_knobs"
]
