"""Prefix cache: a radix tree over token ids whose nodes own KV slots.

SGLang's RadixAttention, reduced to what the scheduler needs:

- every node holds a run of token ids (`key`) and the device slots that hold
  their K/V (`value`, same length); with page_size > 1 every key length is a
  multiple of the page size and matching is done page by page;
- `lock_ref` counts the running requests that use a node (locking a node locks
  its ancestors); locked tokens are "protected", unlocked ones "evictable";
- `evict(n)` frees least-recently-used unlocked leaves, moving up to parents
  that become leaves, until n tokens are freed; of the last leaf it frees
  only the tail it needs (at least EVICT_CHUNK_TOKENS), as vLLM frees a
  sequence's blocks tail first; `reset()` frees every unlocked
  node (vLLM's reset_prefix_cache);
- `last_access` is a logical counter (no clock), so eviction is deterministic;
- with an event log attached (`events`), every node added, split or evicted is
  appended to it as a plain record (scheduler/cache_events.py): what the KV-event
  publisher turns into vLLM's BlockStored / BlockRemoved.
- `match_memo` answers a waiting request's match from what it found last time
  while the tree around where that match ended has not changed (every node
  keeps a `version`, bumped when a child is added or removed, when it is split
  and when it is evicted): a deep queue of long prompts is not compared again
  every step.
"""
from __future__ import annotations

import heapq
from typing import Callable, Optional

from shepherd.scheduler.cache_events import CacheCleared, CacheEventLog, NodeAdded, NodeEvicted, NodeSplit
from shepherd.scheduler.kv_pool import KVPool


# The least a partial eviction frees. Whole leaves left a history's room empty after an
# allocation of one page (docs/ROUTING.md, "What eight caches lose against one, once more":
# precise-prefix 0.978 -> 0.996 of the causal bound on the sessions);
# splitting off exactly one page on every decode step that needs one copies the leaf's lists
# each time (the simulator ran 2.8x slower), and 256 tokens keep within 0.1 point of that.
EVICT_CHUNK_TOKENS = 256


class Node:
    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access", "id", "version")

    def __init__(self, key: list[int], value: list[int], parent: Optional["Node"], nid: int):
        self.key = key
        self.value = value
        self.children: dict = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.id = nid
        self.version = 0       # bumped when a match ending here or inside could change (see match_memo)

    def __lt__(self, other: "Node") -> bool:  # heap tie-break
        return (self.last_access, self.id) < (other.last_access, other.id)


def _common_len(key: list[int], ids: list[int], start: int) -> int:
    """Length of the common prefix of key and ids[start:], using C-speed slice compares."""
    n = min(len(key), len(ids) - start)
    if n <= 0:
        return 0
    # a slice is a copy: a key that ends inside ids is compared whole, uncopied
    if (key if n == len(key) else key[:n]) == ids[start:start + n]:
        return n
    lo, hi = 0, n  # key[:lo] matches, key[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if key[:mid] == ids[start:start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixMatch:
    """What match_memo found for one request's ids[:n]: `hit` tokens, ending at the end of
    `node` (the root: none) or, when `child` is set, `partial` tokens into node's child
    `child`; with the versions both had then."""
    __slots__ = ("n", "hit", "node", "node_version", "child", "child_version", "partial")

    def __init__(self, n: int, hit: int, node: Node, child: Optional[Node], partial: int):
        self.n = n
        self.hit = hit
        self.node = node
        self.node_version = node.version
        self.child = child
        self.child_version = child.version if child is not None else 0
        self.partial = partial

    def holds(self, n: int) -> bool:
        """Still the answer for ids[:n]: a match can only grow where it ended (a child added
        to `node`, or `child` split where it diverged) and only shrink by an eviction on its
        path, which reaches `node` or `child` first (eviction goes leaf-first); each of those
        bumps the version of `node` or `child`."""
        c = self.child
        return (n == self.n and self.node.version == self.node_version
                and (c is None or c.version == self.child_version))

    @property
    def deepest(self) -> Node:
        """RadixCache.deepest_node of the same ids: the node where the match ended or diverged."""
        return self.child if self.child is not None else self.node


class RadixCache:
    def __init__(self, pool: KVPool, events: Optional[CacheEventLog] = None):
        self.pool = pool
        self.events = events      # None: nothing recorded (the default: no cost)
        self.page_size = pool.page_size
        self._ids = 0
        self._clock = 0
        self.root = Node([], [], None, self._next_id())
        self.root.lock_ref = 1  # never evicted
        self.evictable_size = 0   # tokens in unlocked nodes
        self.evicted_total = 0    # tokens evicted since creation (reports and metrics)
        self.protected_size = 0   # tokens in locked nodes
        # lazy min-heap of (last_access, id, node) over evictable leaves; stale entries are
        # skipped on pop (node detached, has children, locked, or touched since)
        self._heap: list = []
        self._num_nodes = 0

    def _push(self, node: Node) -> None:
        if node.lock_ref == 0 and not node.children and node is not self.root:
            heapq.heappush(self._heap, (node.last_access, node.id, node))

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, ids: list[int], i: int):
        p = self.page_size
        return ids[i] if p == 1 else tuple(ids[i:i + p])

    def _next(self, node: Node, ids: list[int], i: int, n: int) -> tuple[Optional[Node], int]:
        """The child of node that continues ids at i, and how many tokens of it match
        (page-aligned, at most n - i); (None, 0) when no child does."""
        child = node.children.get(self._child_key(ids, i))
        if child is None:
            return None, 0
        m = min(_common_len(child.key, ids, i), n - i)
        return child, m - m % self.page_size

    def _enter(self, child: Node, m: int, t: int) -> Node:
        """Step into child over m matched tokens: split it where the match ends inside
        it, and touch it at tick t (0: no touch)."""
        if m < len(child.key):
            child = self._split(child, m)
        if t:
            child.last_access = t
            if not child.children:
                self._push(child)
        return child

    # ---- lookup --------------------------------------------------------------
    def match_prefix(self, ids: list[int], touch: bool = True, n: Optional[int] = None) -> tuple[list[int], Node]:
        """Longest cached prefix of ids[:n] (page-aligned; n: all of ids): (its slots,
        last node). Splits a node when the match ends inside it."""
        p = self.page_size
        n = len(ids) if n is None else n
        n -= n % p
        node = self.root
        out: list[int] = []
        i = 0
        t = self._tick() if touch else 0
        while i < n:
            child, m = self._next(node, ids, i, n)
            if m == 0:
                break
            child = self._enter(child, m, t)
            out.extend(child.value)
            i += m
            node = child
            if m < len(child.key):
                break
        return out, node

    def match_len(self, ids: list[int]) -> int:
        """Length of the cached prefix, without touching or splitting anything."""
        return self._walk(ids, len(ids)).hit

    def deepest_node(self, ids: list[int]) -> Node:
        """The deepest node whose whole key path is a prefix of ids, or inside whose own key
        ids end or diverge (its subtree is where ids belong); no split, no touch."""
        return self._walk(ids, len(ids)).deepest

    def match_info(self, ids: list[int], n: Optional[int] = None) -> tuple[int, int]:
        """(cached prefix length of ids[:n], how many of those tokens are unlocked now)
        without touching or splitting anything: what admission checks use."""
        hit, unlocked, _ = self.match_memo(None, len(ids) if n is None else n, lambda: ids)
        return hit, unlocked

    def match_memo(self, memo: Optional[PrefixMatch], n: int,
                   ids: Callable[[], list[int]]) -> tuple[int, int, PrefixMatch]:
        """match_info(ids(), n), answered from `memo` (what this call returned last time for
        the same request) while it holds; ids is called only when the tree must be walked
        again. Returns (hit, unlocked, the memo to keep). O(nodes on the unlocked end of
        the path) when the memo holds, whatever the prompt's length."""
        if memo is None or not memo.holds(n):
            memo = self._walk(ids(), n)
        c = memo.child
        unlocked = memo.partial if c is not None and c.lock_ref == 0 else 0
        node = memo.node
        root = self.root
        while node is not root and node.lock_ref == 0:   # locks run up the tree: the unlocked part is a tail
            unlocked += len(node.key)
            node = node.parent
        return memo.hit, unlocked, memo

    def _walk(self, ids: list[int], n: int) -> PrefixMatch:
        """match_info's walk over ids[:n], kept as a PrefixMatch (keyed by n as given)."""
        end = n - n % self.page_size
        node = self.root
        i = 0
        while i < end:
            child, m = self._next(node, ids, i, end)
            if m == 0:
                break
            i += m
            if m < len(child.key):
                return PrefixMatch(n, i, node, child, m)
            node = child
        return PrefixMatch(n, i, node, None, 0)

    def _split(self, child: Node, m: int) -> Node:
        """Cut child after m tokens; returns the new upper node."""
        parent = child.parent
        new = Node(child.key[:m], child.value[:m], parent, self._next_id())
        new.lock_ref = child.lock_ref
        new.last_access = child.last_access
        self._num_nodes += 1
        parent.version += 1
        child.version += 1
        parent.children[self._child_key(child.key, 0)] = new
        child.key = child.key[m:]
        child.value = child.value[m:]
        child.parent = new
        new.children[self._child_key(child.key, 0)] = child
        if self.events is not None:
            self.events.records.append(NodeSplit(child.id, new.id, m))
        return new

    # ---- insert --------------------------------------------------------------
    def insert(self, ids: list[int], slots: list[int]) -> int:
        """Insert ids[:n] -> slots[:n] (n page-aligned). Returns how many leading
        tokens were already cached: the caller owns slots[:that] duplicates and
        must free the ones it does not share with the tree."""
        return self.insert_node(ids, slots)[0]

    def insert_node(self, ids: list[int], slots: list[int], under: Optional[Node] = None) -> tuple[int, Node]:
        """insert(), and the node where ids[:n] ends: the one match_prefix(ids[:n])
        would return right after (insert splits nodes where the match ends). under: a
        node in the tree (a request's locked prefix) that ids and slots continue; its
        path is touched as a walk from the root would, without comparing it again."""
        p = self.page_size
        n = min(len(ids), len(slots))
        n -= n % p
        node = self.root
        i = 0
        t = self._tick()
        if under is not None:
            node = up = under
            while up is not self.root:
                up.last_access = t
                up = up.parent
            self._push(node)      # pushes only a leaf, as _enter would
        while i < n:
            child, m = self._next(node, ids, i, n)
            if m == 0:
                break
            child = self._enter(child, m, t)
            i += m
            node = child
        existing = i
        if i < n:
            # a slice of a list is a new list already; anything else (a tuple) becomes one
            key = ids[i:n] if isinstance(ids, list) else list(ids[i:n])
            value = slots[i:n] if isinstance(slots, list) else list(slots[i:n])
            leaf = Node(key, value, node, self._next_id())
            leaf.last_access = t
            node.version += 1
            node.children[self._child_key(ids, i)] = leaf
            self._num_nodes += 1
            self.evictable_size += n - i
            self._push(leaf)
            if self.events is not None:
                self.events.records.append(NodeAdded(leaf.id, 0 if node is self.root else node.id, key))
            node = leaf
        return existing, node

    # ---- locks ---------------------------------------------------------------
    def inc_lock_ref(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                k = len(node.key)
                self.evictable_size -= k
                self.protected_size += k
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                k = len(node.key)
                self.evictable_size += k
                self.protected_size -= k
            node.lock_ref -= 1
            assert node.lock_ref >= 0
            if node.lock_ref == 0 and not node.children:
                self._push(node)
            node = node.parent

    def unlocked_len(self, node: Node) -> int:
        """Tokens on the path root..node that are currently evictable."""
        s = 0
        while node is not self.root and node.lock_ref == 0:
            s += len(node.key)
            node = node.parent
        return s

    # ---- eviction ------------------------------------------------------------
    def _leaves(self) -> list[Node]:
        out = []
        stack = [self.root]
        while stack:
            nd = stack.pop()
            if nd.children:
                stack.extend(nd.children.values())
            elif nd is not self.root and nd.lock_ref == 0:
                out.append(nd)
        return out

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens (if that many are evictable), LRU leaves first, and of the
        last leaf only its tail: max(what is still needed, EVICT_CHUNK_TOKENS), page-aligned."""
        if num_tokens <= 0 or self.evictable_size == 0:
            return 0
        heap = self._heap
        if len(heap) > 2 * self._num_nodes + 1024:
            heap[:] = [(nd.last_access, nd.id, nd) for nd in self._leaves()]
            heapq.heapify(heap)
        freed = 0
        pool = self.pool
        while freed < num_tokens and heap:
            acc, _, nd = heapq.heappop(heap)
            if (nd.parent is None or nd.children or nd.lock_ref or acc != nd.last_access):
                continue     # stale entry
            need = max(num_tokens - freed, EVICT_CHUNK_TOKENS)
            need += -need % self.page_size
            if need < len(nd.key):
                # free only the leaf's tail that is needed (vLLM frees a sequence's blocks tail
                # first): the front stays cached, a leaf again at the same age, so the cache stays
                # full instead of holding a whole evicted history's room empty
                self._split(nd, len(nd.key) - need)
            pool.free(pool.pages_of(nd.value))
            k = len(nd.key)
            freed += k
            self.evictable_size -= k
            parent = nd.parent
            del parent.children[self._child_key(nd.key, 0)]
            nd.parent = None
            nd.version += 1
            parent.version += 1
            nd.key, nd.value = [], []   # a waiting request's memo may still point here: hold nothing
            self._num_nodes -= 1
            if self.events is not None:
                self.events.records.append(NodeEvicted(nd.id))
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._push(parent)
        self.evicted_total += freed
        return freed

    def reset(self) -> tuple[int, int]:
        """vLLM's reset_prefix_cache: evict every unlocked node; returns (tokens freed, tokens
        kept). Nodes locked by running requests stay, with their slots: those requests' KV is
        never freed under them, and they become evictable as those requests end, as any node
        does. With an event log, a CacheCleared record follows the evictions and the kept
        nodes are recorded again as added (parents first), so a consumer that clears on it
        ends up holding exactly what the cache holds."""
        # the heap may hold stale entries and miss none, but a reset must not depend on it
        self._heap[:] = [(nd.last_access, nd.id, nd) for nd in self._leaves()]
        heapq.heapify(self._heap)
        freed = self.evict(self.evictable_size)
        if self.events is not None:
            rec = self.events.records
            rec.append(CacheCleared())
            stack = list(self.root.children.values())
            while stack:
                nd = stack.pop()
                rec.append(NodeAdded(nd.id, 0 if nd.parent is self.root else nd.parent.id, nd.key))
                stack.extend(nd.children.values())
        return freed, self.protected_size

    # ---- introspection ---------------------------------------------------------
    def all_pages(self) -> list[int]:
        out: list[int] = []
        stack = list(self.root.children.values())
        while stack:
            nd = stack.pop()
            out.extend(self.pool.pages_of(nd.value))
            stack.extend(nd.children.values())
        return out

    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def check(self) -> None:
        """Recount evictable/protected from the tree and compare."""
        ev = pr = 0
        stack = list(self.root.children.values())
        while stack:
            nd = stack.pop()
            assert len(nd.key) == len(nd.value) and len(nd.key) % self.page_size == 0 and nd.key
            for ch in nd.children.values():
                assert ch.parent is nd
                assert nd.lock_ref >= ch.lock_ref
            if nd.lock_ref > 0:
                pr += len(nd.key)
            else:
                ev += len(nd.key)
            stack.extend(nd.children.values())
        assert ev == self.evictable_size, (ev, self.evictable_size)
        assert pr == self.protected_size, (pr, self.protected_size)
