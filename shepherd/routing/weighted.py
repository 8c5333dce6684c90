"""llm-d's scheduler shape: filters -> weighted, normalised scorers -> picker."""
from __future__ import annotations

from shepherd.routing.base import RoutingPolicy
from shepherd.routing.precise_prefix import PrecisePrefixScorer
from shepherd.routing.scorers import KVScorer, LoadScorer, PrefixScorer, QueueScorer, saturation_filter

SCORERS = ("prefix", "queue", "kv", "load", "precise")
DEFAULT_SCORER_WEIGHTS = {"prefix": 2.0, "queue": 1.0, "kv": 1.0, "load": 1.0}


def parse_weights(spec: "str | dict | None") -> dict:
    """'prefix=2,queue=1' -> {'prefix': 2.0, 'queue': 1.0}."""
    if spec is None or spec == "":
        return dict(DEFAULT_SCORER_WEIGHTS)
    if isinstance(spec, dict):
        items = spec.items()
    else:
        items = []
        for part in str(spec).split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise ValueError(f"scorer weight {part!r}: expected NAME=WEIGHT")
            k, v = part.split("=", 1)
            items.append((k.strip(), v.strip()))
    out = {}
    for k, v in items:
        if k not in SCORERS:
            raise ValueError(f"unknown scorer {k!r}; known: {', '.join(SCORERS)}")
        try:
            w = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"scorer weight {k}={v!r}: the weight must be a number") from None
        if not w >= 0:                 # nan too
            raise ValueError(f"scorer weight {k}={w} must be >= 0")
        out[k] = w
    if not any(out.values()):
        raise ValueError("at least one scorer weight must be > 0")
    return out


class WeightedPolicy(RoutingPolicy):
    """llm-d's scheduler shape. Filters: healthy; replicas with kv_usage >=
    kv_filter or waiting >= queue_filter are dropped unless that drops all.
    Scorers (scorers.py), each in [0, 1], higher better: prefix, queue, kv,
    load, and precise (the replicas' KV events, precise_prefix.py; weight 0
    unless given, e.g. precise=2,load=1). score = sum(w_s * s) / sum(w_s); the
    picker takes the maximum, round robin among ties.

    Knobs: weights ("prefix=2,queue=1,kv=1,load=1"; also scorer_weights),
    tokenizer_type, block_size, block_number (the prefix scorer's, as
    prefix-aware), kv_filter (1.0 = off), queue_filter (0 = off)."""
    name = "weighted"

    def __init__(self, weights: "str | dict | None" = None, tokenizer_type: str = "character",
                 block_size: int = 0, block_number: int = 200_000,
                 kv_filter: float = 1.0, queue_filter: int = 0) -> None:
        super().__init__()
        self.weights = parse_weights(weights)
        self.prefix = PrefixScorer(tokenizer_type, block_size, block_number)
        self.tokenizer_type = tokenizer_type
        self.block_size = self.prefix.block_size
        self.index = self.prefix.index
        self.kv_filter = kv_filter
        self.queue_filter = queue_filter
        every = {"prefix": self.prefix, "queue": QueueScorer(), "kv": KVScorer(), "load": LoadScorer(),
                 "precise": PrecisePrefixScorer() if self.weights.get("precise") else None}
        self.scorers = [every[name] for name in SCORERS if self.weights.get(name)]
        self.kv_index = every["precise"].index if every["precise"] is not None else None
        self.last_scores: dict = {}

    def _choose(self, request, cands):
        cands = saturation_filter(cands, self.kv_filter, self.queue_filter)
        w = self.weights
        parts = {s.name: s.score(request, cands) for s in self.scorers}
        total_w = sum(w[s] for s in parts)
        scores = {r.key: round(sum(w[s] * parts[s][r.key] for s in parts) / total_w, 9) for r in cands}
        self.last_scores = scores
        chosen = self._pick_min(cands, lambda r: -scores[r.key])
        hit = parts.get("prefix", {}).get(chosen.key, 0) > 0 or parts.get("precise", {}).get(chosen.key, 0) > 0
        self.last_reason = "hit" if hit else "score"
        for s in self.scorers:
            s.on_pick(request, chosen)
        return chosen

    def on_dispatch(self, request, replica):
        for s in self.scorers:
            s.on_dispatch(request, replica)

    def on_finish(self, request, replica, output_tokens):
        for s in self.scorers:
            s.on_finish(request, replica)

    def forget(self, key):
        for s in self.scorers:
            s.forget(key)
