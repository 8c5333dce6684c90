"""Routing policies: which replica serves a request.

Pure, synchronous, deterministic objects: no I/O, no sleeping, no clock of
their own (the time is passed in as `RouteRequest.now`), so the same policy
object runs inside the HTTP gateway (shepherd/gateway/app.py) and inside the
discrete-event simulator (shepherd/sim).

Contract for the owner of a policy (gateway or simulator):

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

Policies (POLICY_NAMES): random, round-robin, least-request, shortest-queue,
power-of-two, least-kv, prefix-aware (AIBrix), cache-aware (SGLang router),
vtc-basic (AIBrix), session-affinity (rendezvous hashing), weighted (llm-d:
filters, normalised scorers, weights, picker). docs/ROUTING.md explains each
one, its knobs and the defaults chosen.
"""
from __future__ import annotations

import hashlib
import heapq
import inspect
import math
import random as _random
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Sequence


class NoReplicaAvailable(RuntimeError):
    """No healthy replica to route to."""


# ---------------------------------------------------------------------------
# state the owner passes in
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def _healthy(replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    out = [r for r in replicas if r.healthy]
    if not out:
        raise NoReplicaAvailable("no healthy replica")
    return out


def _stable_hash(*parts: Any) -> int:
    """64-bit hash that is the same in every process (Python's str hash is salted)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(str(p).encode("utf-8", "surrogatepass"))
        h.update(b"\x1f")
    return int.from_bytes(h.digest(), "little")


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / n      # population std, as AIBrix
    return mean, math.sqrt(var)


class RoutingPolicy:
    """Base class. Subclasses implement `_choose(request, candidates)` over the
    healthy replicas (never empty)."""

    name = "base"

    def __init__(self) -> None:
        self.last_reason = ""
        self.reasons: Counter = Counter()      # decisions so far, by reason
        self._rr = 0

    # -- public API --------------------------------------------------------
    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        cands = _healthy(replicas)
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
        """The replica with the smallest key; round robin among ties (so that
        equal replicas share the work instead of the first taking it all)."""
        best = min(key(r) for r in cands)
        ties = [r for r in cands if key(r) == best]
        if len(ties) == 1:
            return ties[0]
        r = ties[self._rr % len(ties)]
        self._rr += 1
        return r

    def _least_loaded(self, cands: Sequence[ReplicaState]) -> ReplicaState:
        return self._pick_min(cands, lambda r: r.load)


# ---------------------------------------------------------------------------
# load-only policies
# ---------------------------------------------------------------------------

class RandomPolicy(RoutingPolicy):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.rng = _random.Random(seed)

    def _choose(self, request, cands):
        self.last_reason = "random"
        return cands[self.rng.randrange(len(cands))]


class RoundRobinPolicy(RoutingPolicy):
    name = "round-robin"

    def _choose(self, request, cands):
        self.last_reason = "rr"
        r = cands[self._rr % len(cands)]
        self._rr += 1
        return r


class LeastRequestPolicy(RoutingPolicy):
    """Fewest requests on the replica (`ReplicaState.load`); round robin among ties."""
    name = "least-request"

    def _choose(self, request, cands):
        self.last_reason = "least"
        return self._least_loaded(cands)


class ShortestQueuePolicy(RoutingPolicy):
    """SGLang's data-parallel controller `shortest_queue`: the worker with the
    fewest requests the controller has sent and not seen finish (the owner's
    `in_flight`), round robin among ties. Unlike least-request it ignores
    the replicas' own metrics, as SGLang's controller does."""
    name = "shortest-queue"

    def _choose(self, request, cands):
        self.last_reason = "shortest"
        return self._pick_min(cands, lambda r: r.in_flight)


class PowerOfTwoPolicy(RoutingPolicy):
    """Two distinct replicas drawn at random, the less loaded of the two."""
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
    """Lowest KV-cache use; then fewest requests; then round robin."""
    name = "least-kv"

    def _choose(self, request, cands):
        self.last_reason = "least-kv"
        return self._pick_min(cands, lambda r: (round(r.kv_usage, 6), r.load))


# ---------------------------------------------------------------------------
# prefix hashing (AIBrix) and the block-hash LRU index
# ---------------------------------------------------------------------------

TOKENIZER_TYPES = ("character", "tokens")


def block_hashes(request: RouteRequest, tokenizer_type: str, block_size: int) -> list[int]:
    """Chain-hashed full blocks of the prompt: h_i = H(h_{i-1}, block_i), so
    equal hashes mean equal prefixes. A partial last block is not hashed.
    Precomputed `hash_ids` (Mooncake traces: already prefix-chained) win;
    `tokens` uses token ids when the request has them, else characters."""
    if request.hash_ids is not None:
        return list(request.hash_ids)
    if tokenizer_type == "tokens" and request.token_ids:
        ids = request.token_ids
        out: list[int] = []
        prev = 0
        for i in range(0, len(ids) - block_size + 1, block_size):
            prev = hash((prev, *ids[i:i + block_size]))    # int tuples hash the same in every process
            out.append(prev)
        return out
    text = request.text
    out = []
    prev_b = b""
    for i in range(0, len(text) - block_size + 1, block_size):
        h = hashlib.blake2b(prev_b + text[i:i + block_size].encode("utf-8", "surrogatepass"),
                            digest_size=8).digest()
        prev_b = h
        out.append(int.from_bytes(h, "little"))
    return out


class BlockPrefixIndex:
    """LRU map block hash -> {replica key: last time it was routed there}.
    At most `capacity` block hashes; the least recently used go first."""

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._map: "OrderedDict[int, dict]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, h: int) -> bool:
        return h in self._map

    def match(self, hashes: Sequence[int], keys: Sequence[Hashable]) -> dict:
        """Number of leading blocks of `hashes` each replica key holds (only
        keys with at least one block appear)."""
        alive = set(keys)
        matched: dict = {}
        for i, h in enumerate(hashes):
            holders = self._map.get(h)
            if not holders:
                break
            alive = {k for k in alive if k in holders}
            if not alive:
                break
            for k in alive:
                matched[k] = i + 1
        return matched

    def record(self, hashes: Sequence[int], key: Hashable, now: float) -> None:
        m = self._map
        for h in hashes:
            holders = m.get(h)
            if holders is None:
                m[h] = {key: now}
            else:
                holders[key] = now
                m.move_to_end(h)
        while len(m) > self.capacity:
            m.popitem(last=False)

    def forget(self, key: Hashable) -> None:
        for h in [h for h, holders in self._map.items() if key in holders]:
            holders = self._map[h]
            del holders[key]
            if not holders:
                del self._map[h]


class PrefixAwarePolicy(RoutingPolicy):
    """AIBrix prefix-cache routing (seed 002).

    1. If max - min running requests across replicas > imbalance_abs_count:
       least-request (reason "imbalance").
    2. Else hash the prompt into chained blocks; among replicas that served
       the longest matching prefix (sorted by match length desc, then load
       asc), take the first whose load <= mean + standard_deviation_factor *
       std over all replicas (reason "hit").
    3. Else least-request (reason "miss", or "hot" when matches existed but
       all were above the guard).
    The chosen replica is recorded for every block of the prompt.

    Defaults: AIBrix's README and code disagree (block 128 vs 4, threshold 16
    vs 8, k 2 vs 1). We take block_size 128 for characters (16 for token
    ids, the README's tiktoken value), imbalance_abs_count 8 (the code) and
    standard_deviation_factor 2 (the README): with one request on the home
    replica and none elsewhere, home sits sqrt(n - 1) standard deviations
    above the mean, so k = 1 breaks affinity on a 4-replica cluster at the
    first concurrent request. docs/ROUTING.md gives the simulator results. The guard is `<=` (the README), not the
    pseudo-code's `<`, which rejects every replica when all loads are equal
    (std = 0) and so throws affinity away exactly when the cluster is idle.
    """
    name = "prefix-aware"

    def __init__(self, tokenizer_type: str = "character", block_size: int = 0,
                 block_number: int = 200_000, imbalance_abs_count: int = 8,
                 standard_deviation_factor: float = 2.0) -> None:
        super().__init__()
        if tokenizer_type not in TOKENIZER_TYPES:
            raise ValueError(f"tokenizer_type must be one of {TOKENIZER_TYPES}, got {tokenizer_type!r}")
        self.tokenizer_type = tokenizer_type
        self.block_size = int(block_size) or (128 if tokenizer_type == "character" else 16)
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.imbalance_abs_count = imbalance_abs_count
        self.standard_deviation_factor = standard_deviation_factor
        self.index = BlockPrefixIndex(block_number)
        self.last_match = 0.0          # matched fraction of the chosen replica (for stats)

    def _choose(self, request, cands):
        hashes = block_hashes(request, self.tokenizer_type, self.block_size)
        chosen = self._select(hashes, cands)
        if hashes:
            self.index.record(hashes, chosen.key, request.now)
        return chosen

    def _select(self, hashes, cands):
        self.last_match = 0.0
        loads = [r.load for r in cands]
        if max(loads) - min(loads) > self.imbalance_abs_count:
            self.last_reason = "imbalance"
            return self._least_loaded(cands)
        if hashes:
            matched = self.index.match(hashes, [r.key for r in cands])
            if matched:
                mean, std = _mean_std(loads)
                limit = mean + self.standard_deviation_factor * std
                order = sorted((r for r in cands if r.key in matched),
                               key=lambda r: (-matched[r.key], r.load, r.index))
                for r in order:
                    if r.load <= limit:
                        self.last_reason = "hit"
                        self.last_match = matched[r.key] / len(hashes)
                        return r
                self.last_reason = "hot"
                return self._least_loaded(cands)
        self.last_reason = "miss"
        return self._least_loaded(cands)

    def forget(self, key):
        self.index.forget(key)


# ---------------------------------------------------------------------------
# SGLang router cache_aware: approximate radix tree per replica
# ---------------------------------------------------------------------------

def _common_prefix(a: Sequence, b: Sequence, off: int) -> int:
    """Length of the common prefix of a and b[off:] (str or tuple)."""
    n = min(len(a), len(b) - off)
    if a[:n] == b[off:off + n]:
        return n
    lo, hi = 0, n - 1                   # a[:lo] matches, a[:hi+1] does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[off:off + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Node:
    __slots__ = ("key", "children", "parent", "tenants")

    def __init__(self, key, parent):
        self.key = key
        self.children: dict = {}
        self.parent = parent
        self.tenants: dict = {}          # tenant -> last access tick


class ApproxRadixTree:
    """One radix tree over request keys (text or id tuples) shared by all
    replicas ("tenants"); every node records which tenants were sent a request
    through it and when (a logical tick: no clock). Per-tenant size is the
    number of key elements (characters) it holds; eviction removes the
    tenant's least recently used leaves until it is under the limit."""

    def __init__(self) -> None:
        self.root = _Node(key="", parent=None)
        self.size: dict = {}
        self.tick = 0

    def insert(self, seq: Sequence, tenant: Hashable) -> None:
        self.tick += 1
        tick = self.tick
        node = self.root
        node.tenants[tenant] = tick
        size = self.size.get(tenant, 0)
        i, n = 0, len(seq)
        while i < n:
            child = node.children.get(seq[i])
            if child is None:
                new = _Node(seq[i:], node)
                new.tenants[tenant] = tick
                node.children[seq[i]] = new
                size += n - i
                break
            k = _common_prefix(child.key, seq, i)
            if k < len(child.key):                      # split the edge
                mid = _Node(child.key[:k], node)
                mid.tenants = dict(child.tenants)
                child.key = child.key[k:]
                child.parent = mid
                mid.children[child.key[0]] = child
                node.children[seq[i]] = mid
                child = mid
            if tenant not in child.tenants:
                size += len(child.key)
            child.tenants[tenant] = tick
            node = child
            i += k
        self.size[tenant] = size

    def match(self, seq: Sequence, allowed) -> tuple[int, Optional[Hashable]]:
        """(matched length, tenant) for the allowed tenant with the longest
        prefix match (most recently used among equals); (0, None) if none."""
        node = self.root
        i, n = 0, len(seq)
        best: tuple[int, Optional[Hashable]] = (0, None)
        while i < n:
            child = node.children.get(seq[i])
            if child is None:
                break
            cands = [(t, tick) for t, tick in child.tenants.items() if t in allowed]
            if not cands:
                break
            k = _common_prefix(child.key, seq, i)
            i += k
            best = (i, max(cands, key=lambda c: c[1])[0])
            if k < len(child.key):
                break
            node = child
        return best

    def _nodes_of(self, tenant) -> list:
        out, stack = [], [self.root]
        while stack:
            nd = stack.pop()
            for c in nd.children.values():
                if tenant in c.tenants:
                    out.append(c)
                    stack.append(c)
        return out

    def _drop(self, node: _Node, tenant) -> None:
        del node.tenants[tenant]
        self.size[tenant] -= len(node.key)
        if not node.tenants and not node.children and node.parent is not None:
            del node.parent.children[node.key[0]]

    def evict(self, tenant, max_size: int) -> int:
        """Drop the tenant's least recently used leaves until size <= max_size.
        Returns the number of elements removed."""
        before = self.size.get(tenant, 0)
        if before <= max_size:
            return 0
        nodes = self._nodes_of(tenant)
        heap = [(nd.tenants[tenant], id(nd), nd) for nd in nodes
                if not any(tenant in c.tenants for c in nd.children.values())]
        heapq.heapify(heap)
        while heap and self.size[tenant] > max_size:
            _, _, nd = heapq.heappop(heap)
            parent = nd.parent
            self._drop(nd, tenant)
            if (parent is not None and parent is not self.root and tenant in parent.tenants
                    and not any(tenant in c.tenants for c in parent.children.values())):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))
        return before - self.size[tenant]

    def remove_tenant(self, tenant) -> None:
        for nd in sorted(self._nodes_of(tenant), key=lambda x: -self._depth(x)):
            self._drop(nd, tenant)
        self.root.tenants.pop(tenant, None)
        self.size.pop(tenant, None)

    @staticmethod
    def _depth(nd) -> int:
        d = 0
        while nd.parent is not None:
            nd, d = nd.parent, d + 1
        return d


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
    """
    name = "cache-aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 1 << 24,
                 tokenizer_type: str = "character") -> None:
        super().__init__()
        if tokenizer_type not in TOKENIZER_TYPES:
            raise ValueError(f"tokenizer_type must be one of {TOKENIZER_TYPES}, got {tokenizer_type!r}")
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


# ---------------------------------------------------------------------------
# AIBrix vtc-basic
# ---------------------------------------------------------------------------

class VTCBasicPolicy(RoutingPolicy):
    """AIBrix `vtc-basic`: fairness score from the user's weighted token count
    in a sliding window, utilization score from the replica's load; the
    lowest weighted sum wins.

    user_tokens = sum over the window of input_token_weight * input tokens
    (charged at dispatch) + output_token_weight * output tokens (charged at
    finish). It is normalised to [0, 1] between the smallest and largest
    counts of the users in the window, widened to at least
    [min_tokens, max_tokens] (AIBrix's adaptive bounds), and mapped to a
    target replica position t = norm * (n - 1): light users go to the low
    positions, heavy users to the high ones, so a heavy user's load piles up
    on its own replicas. fairness = |i - t| / (n - 1); utilization =
    min(load / max_pod_load, 1); score = fairness_weight * fairness +
    utilization_weight * utilization. Ties: fewer requests, then round robin.
    Requests without a user go to the least loaded replica (AIBrix: random).
    """
    name = "vtc-basic"

    def __init__(self, window_size: float = 300.0, min_tokens: float = 1000.0,
                 max_tokens: float = 8000.0, input_token_weight: float = 1.0,
                 output_token_weight: float = 2.0, max_pod_load: float = 100.0,
                 fairness_weight: float = 1.0, utilization_weight: float = 1.0) -> None:
        super().__init__()
        self.window_size = window_size
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self.input_token_weight = input_token_weight
        self.output_token_weight = output_token_weight
        self.max_pod_load = max_pod_load
        self.fairness_weight = fairness_weight
        self.utilization_weight = utilization_weight
        self._events: dict = {}        # user -> deque[(time, tokens)]
        self._totals: dict = {}
        self._now = 0.0

    def _expire(self, now: float) -> None:
        self._now = max(self._now, now)
        cutoff = self._now - self.window_size
        for user in list(self._events):
            ev = self._events[user]
            while ev and ev[0][0] < cutoff:
                _, tok = ev.popleft()
                self._totals[user] -= tok
            if not ev:
                del self._events[user]
                del self._totals[user]

    def _charge(self, user: str, tokens: float, now: float) -> None:
        if tokens <= 0:
            return
        self._events.setdefault(user, deque()).append((now, tokens))
        self._totals[user] = self._totals.get(user, 0.0) + tokens

    def token_count(self, user: str, now: Optional[float] = None) -> float:
        if now is not None:
            self._expire(now)
        return self._totals.get(user, 0.0)

    def _choose(self, request, cands):
        self._expire(request.now)
        if not request.user:
            self.last_reason = "no-user"
            return self._least_loaded(cands)
        u = self._totals.get(request.user, 0.0)
        counts = list(self._totals.values()) or [0.0]
        lo = min(min(counts), self.min_tokens)
        hi = max(max(counts), self.max_tokens)
        norm = min(max((u - lo) / (hi - lo), 0.0), 1.0) if hi > lo else 0.0
        n = len(cands)
        target = norm * (n - 1)
        ordered = sorted(cands, key=lambda r: r.index)
        scores = {}
        for pos, r in enumerate(ordered):
            fairness = abs(pos - target) / (n - 1) if n > 1 else 0.0
            util = min(r.load / self.max_pod_load, 1.0) if self.max_pod_load > 0 else 0.0
            scores[r.key] = round(self.fairness_weight * fairness + self.utilization_weight * util, 9)
        self.last_reason = "vtc"
        return self._pick_min(ordered, lambda r: (scores[r.key], r.load))

    def on_dispatch(self, request, replica):
        if request.user:
            self._charge(request.user, self.input_token_weight * request.input_tokens, request.now)

    def on_finish(self, request, replica, output_tokens):
        if request.user:
            self._charge(request.user, self.output_token_weight * output_tokens,
                         max(request.now, self._now))


# ---------------------------------------------------------------------------
# session affinity: rendezvous (highest random weight) hashing
# ---------------------------------------------------------------------------

class SessionAffinityPolicy(RoutingPolicy):
    """Requests of one session go to one replica: the replica with the
    highest H(session, replica key) among the healthy ones (rendezvous
    hashing): removing a replica moves only the sessions that were on it,
    adding one moves only ~1/n of them. The session comes from the header
    `header` (default x-session-id), else RouteRequest.session, else the
    user. Without any, or when the chosen replica's load exceeds the least
    loaded by more than `max_imbalance` (0 = never spill), the `fallback`
    policy decides."""
    name = "session-affinity"

    def __init__(self, header: str = "x-session-id", fallback: str = "least-request",
                 max_imbalance: int = 0, use_user: bool = True) -> None:
        super().__init__()
        self.header = header.lower()
        self.max_imbalance = max_imbalance
        self.use_user = use_user
        self.fallback = make_policy(fallback)

    def session_of(self, request: RouteRequest) -> Optional[str]:
        s = request.headers.get(self.header) if request.headers else None
        if not s:
            s = request.session
        if not s and self.use_user:
            s = request.user
        return s or None

    def _choose(self, request, cands):
        s = self.session_of(request)
        if s is None:
            r = self.fallback.choose(request, cands)
            self.last_reason = "no-session"
            return r
        best = max(cands, key=lambda r: (_stable_hash(s, r.key), str(r.key)))
        if self.max_imbalance > 0 and best.load - min(r.load for r in cands) > self.max_imbalance:
            self.last_reason = "spill"
            return self.fallback.choose(request, cands)
        self.last_reason = "affinity"
        return best

    def on_dispatch(self, request, replica):
        self.fallback.on_dispatch(request, replica)

    def on_finish(self, request, replica, output_tokens):
        self.fallback.on_finish(request, replica, output_tokens)

    def forget(self, key):
        self.fallback.forget(key)


# ---------------------------------------------------------------------------
# llm-d style: filters -> weighted normalised scorers -> picker
# ---------------------------------------------------------------------------

SCORERS = ("prefix", "queue", "kv", "load")
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
        w = float(v)
        if w < 0:
            raise ValueError(f"scorer weight {k}={w} must be >= 0")
        out[k] = w
    if not any(out.values()):
        raise ValueError("at least one scorer weight must be > 0")
    return out


def _inverse_minmax(values: dict) -> dict:
    """Lower is better -> score in [0, 1]: (max - v) / (max - min); all 1 when equal."""
    lo, hi = min(values.values()), max(values.values())
    if hi == lo:
        return {k: 1.0 for k in values}
    return {k: (hi - v) / (hi - lo) for k, v in values.items()}


class WeightedPolicy(RoutingPolicy):
    """llm-d's scheduler shape. Filters: healthy; replicas with kv_usage >=
    kv_filter or waiting >= queue_filter are dropped unless that drops all.
    Scorers, each in [0, 1], higher better:
      prefix  fraction of the prompt's blocks last routed to the replica
              (the same chained block hashes and LRU index as prefix-aware)
      queue   (max waiting - waiting) / (max - min) over the candidates
      kv      1 - kv_usage
      load    (max load - load) / (max - min)
    score = sum(w_s * s) / sum(w_s); the picker takes the maximum, round
    robin among ties."""
    name = "weighted"

    def __init__(self, weights: "str | dict | None" = None, tokenizer_type: str = "character",
                 block_size: int = 0, block_number: int = 200_000,
                 kv_filter: float = 1.0, queue_filter: int = 0) -> None:
        super().__init__()
        self.weights = parse_weights(weights)
        if tokenizer_type not in TOKENIZER_TYPES:
            raise ValueError(f"tokenizer_type must be one of {TOKENIZER_TYPES}, got {tokenizer_type!r}")
        self.tokenizer_type = tokenizer_type
        self.block_size = int(block_size) or (128 if tokenizer_type == "character" else 16)
        self.kv_filter = kv_filter
        self.queue_filter = queue_filter
        self.index = BlockPrefixIndex(block_number)
        self.last_scores: dict = {}

    def _filter(self, cands):
        out = [r for r in cands
               if r.kv_usage < self.kv_filter and (self.queue_filter <= 0 or r.waiting < self.queue_filter)]
        return out or list(cands)

    def _choose(self, request, cands):
        cands = self._filter(cands)
        w = self.weights
        hashes = block_hashes(request, self.tokenizer_type, self.block_size) if w.get("prefix") else []
        parts: dict = {}
        if w.get("prefix"):
            matched = self.index.match(hashes, [r.key for r in cands]) if hashes else {}
            parts["prefix"] = {r.key: (matched.get(r.key, 0) / len(hashes) if hashes else 0.0) for r in cands}
        if w.get("queue"):
            parts["queue"] = _inverse_minmax({r.key: r.waiting for r in cands})
        if w.get("kv"):
            parts["kv"] = {r.key: 1.0 - min(max(r.kv_usage, 0.0), 1.0) for r in cands}
        if w.get("load"):
            parts["load"] = _inverse_minmax({r.key: r.load for r in cands})
        total_w = sum(w[s] for s in parts)
        scores = {r.key: round(sum(w[s] * parts[s][r.key] for s in parts) / total_w, 9) for r in cands}
        self.last_scores = scores
        chosen = self._pick_min(cands, lambda r: -scores[r.key])
        self.last_reason = "hit" if parts.get("prefix", {}).get(chosen.key, 0) > 0 else "score"
        if hashes:
            self.index.record(hashes, chosen.key, request.now)
        return chosen

    def forget(self, key):
        self.index.forget(key)


# ---------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------

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
}
ALIASES = {"rr": "round-robin", "roundrobin": "round-robin", "least-loaded": "least-request",
           "p2c": "power-of-two", "prefix-cache": "prefix-aware", "prefix": "prefix-aware",
           "cache_aware": "cache-aware", "vtc": "vtc-basic", "session": "session-affinity",
           "llm-d": "weighted"}
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
