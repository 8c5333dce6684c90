"""The SGLang router's approximate radix tree: one tree over request keys
shared by all replicas, each node remembering which replicas it was sent to."""
from __future__ import annotations

import heapq
from typing import Hashable, Optional, Sequence


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
