"""SGLang router `cache_aware`: longest prefix match in an approximate tree."""
from __future__ import annotations

from typing import Sequence

from shepherd.routing.base import RouteRequest, RoutingPolicy
from shepherd.routing.prefix_index import check_tokenizer_type
from shepherd.routing.radix_tree import ApproxRadixTree


class CacheAwarePolicy(RoutingPolicy):
    """SGLang router `cache_aware`.

    If the load gap is over both thresholds (max - min > balance_abs_threshold
    and max > min * balance_rel_threshold): least loaded ("imbalance").
    Else match the request against the approximate tree: if the matched
    fraction > cache_threshold, the replica that matched ("hit"); else the
    least loaded ("miss": the older "smallest tree" rule sent every miss to
    the emptiest cache and caused a death spiral). The request is then
    inserted under the chosen replica. Each replica's share of the tree is
    kept under max_tree_size elements by LRU eviction (checked at insert;
    SGLang runs it on a timer).
    Keys: `hash_ids` if given, else token ids (tokenizer_type="tokens"),
    else the text's characters.

    Knobs: cache_threshold, balance_abs_threshold, balance_rel_threshold,
    max_tree_size (elements per replica), tokenizer_type.
    """
    name = "cache-aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 1 << 24,
                 tokenizer_type: str = "character") -> None:
        super().__init__()
        check_tokenizer_type(tokenizer_type)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.tokenizer_type = tokenizer_type
        self.tree = ApproxRadixTree()
        self.last_match = 0.0

    def _key(self, request: RouteRequest) -> Sequence:
        if request.hash_ids is not None:
            return tuple(request.hash_ids)
        if self.tokenizer_type == "tokens" and request.token_ids:
            return tuple(request.token_ids)
        return request.text

    def _choose(self, request, cands):
        seq = self._key(request)
        loads = [r.load for r in cands]
        lo, hi = min(loads), max(loads)
        self.last_match = 0.0
        chosen = None
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            self.last_reason = "imbalance"
            chosen = self._least_loaded(cands)
        else:
            by_key = {r.key: r for r in cands}
            matched, tenant = self.tree.match(seq, by_key) if seq else (0, None)
            rate = matched / len(seq) if seq else 0.0
            if tenant is not None and rate > self.cache_threshold:
                self.last_reason = "hit"
                self.last_match = rate
                chosen = by_key[tenant]
            else:
                self.last_reason = "miss"
                chosen = self._least_loaded(cands)
        if seq:
            self.tree.insert(seq, chosen.key)
            if self.tree.size.get(chosen.key, 0) > self.max_tree_size:
                self.tree.evict(chosen.key, int(self.max_tree_size * 0.9))
        return chosen

    def forget(self, key):
        self.tree.remove_tenant(key)
