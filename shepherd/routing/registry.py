"""The one registry: policy names, aliases, knobs and the knob parser."""
from __future__ import annotations

import inspect
from typing import Any, Sequence

from shepherd.routing.adapters import AdapterAffinityPolicy
from shepherd.routing.base import RoutingPolicy
from shepherd.routing.cache_aware import CacheAwarePolicy
from shepherd.routing.fairness import VTCBasicPolicy
from shepherd.routing.load import (LeastKVPolicy, LeastRequestPolicy, PowerOfTwoPolicy, RandomPolicy,
                                   RoundRobinPolicy, ShortestQueuePolicy)
from shepherd.routing.precise_prefix import PrecisePrefixPolicy
from shepherd.routing.prefix_aware import PrefixAwarePolicy
from shepherd.routing.session import SessionAffinityPolicy
from shepherd.routing.weighted import WeightedPolicy

POLICIES: dict = {
    "random": RandomPolicy,
    "round-robin": RoundRobinPolicy,
    "least-request": LeastRequestPolicy,
    "shortest-queue": ShortestQueuePolicy,
    "power-of-two": PowerOfTwoPolicy,
    "least-kv": LeastKVPolicy,
    "prefix-aware": PrefixAwarePolicy,
    "cache-aware": CacheAwarePolicy,
    "vtc-basic": VTCBasicPolicy,
    "session-affinity": SessionAffinityPolicy,
    "weighted": WeightedPolicy,
    "precise-prefix": PrecisePrefixPolicy,
    "adapter-affinity": AdapterAffinityPolicy,
}
ALIASES = {"rr": "round-robin", "roundrobin": "round-robin", "least-loaded": "least-request",
           "p2c": "power-of-two", "prefix-cache": "prefix-aware", "prefix": "prefix-aware",
           "cache_aware": "cache-aware", "vtc": "vtc-basic", "session": "session-affinity",
           "llm-d": "weighted", "precise": "precise-prefix", "kv-events": "precise-prefix",
           "lora": "adapter-affinity", "lora-affinity": "adapter-affinity"}
POLICY_NAMES = tuple(POLICIES)


def policy_knobs(name: str) -> dict:
    """{knob: default} of a policy."""
    cls = POLICIES[ALIASES.get(name, name)]
    sig = inspect.signature(cls.__init__)
    return {k: p.default for k, p in sig.parameters.items() if k != "self"}


def _convert(value: Any, default: Any) -> Any:
    if not isinstance(value, str) or isinstance(default, str) or default is None:
        return value
    if isinstance(default, bool):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a boolean, got {value!r}")
    if isinstance(default, int):
        try:
            return int(value)
        except ValueError:
            f = float(value)
            if f != int(f):
                raise ValueError(f"expected an integer, got {value!r}") from None
            return int(f)
    if isinstance(default, float):
        return float(value)
    return value


def make_policy(name: str, **knobs: Any) -> RoutingPolicy:
    """Build a policy by name. Knob names may use '-' or '_'; string values
    (from a command line) are converted to the type of the knob's default.
    Unknown names or knobs raise ValueError."""
    canon = ALIASES.get(name, name)
    if canon not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    defaults = policy_knobs(canon)
    kwargs = {}
    for k, v in knobs.items():
        k2 = k.replace("-", "_")
        if k2 == "scorer_weights" and "weights" in defaults:
            k2 = "weights"
        if k2 not in defaults:
            raise ValueError(f"policy {canon!r} has no knob {k!r}; knobs: {', '.join(defaults) or 'none'}")
        if k2 == "fallback" and isinstance(v, str):   # a policy delegating to one named here
            kwargs[k2] = make_policy(v)
            continue
        try:
            kwargs[k2] = _convert(v, defaults[k2])
        except ValueError as e:
            raise ValueError(f"policy {canon!r} knob {k!r}: {e}") from None
    return POLICIES[canon](**kwargs)


def parse_knobs(items: "Sequence[str] | None") -> dict:
    """['block_size=64', 'imbalance_abs_count=16'] -> dict (values stay strings;
    make_policy converts them)."""
    out = {}
    for item in items or ():
        part = str(item).strip()
        if "=" not in part:
            raise ValueError(f"policy knob {part!r}: expected NAME=VALUE")
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return out
