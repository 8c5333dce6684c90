"""Token-slot allocator over a fixed KV capacity, in pages.

Slots are token indices 0 .. capacity-1. They are handed out in pages of
`page_size` consecutive slots (page k = slots k*p .. k*p+p-1); page_size=1 is
LightLLM/SGLang token granularity. A request's `slots` list maps position i to
a slot; positions are page-aligned inside a request (position i lives in the
page that holds position i - i % p), so a request's partially filled last page
is reserved for it and is counted as used.

The free list is a stack: `alloc(n)` returns exactly the pages that n calls of
`alloc(1)` would have returned, in that order (fast_forward relies on it).
"""
from __future__ import annotations


_PAGE_IDS: list[int] = []


def _page_ids(lo: int, hi: int) -> list[int]:
    """Page numbers lo..hi-1 as int objects shared by every pool of the process: the
    simulator's replicas then hold one set of slot ints between them, not one each,
    and list copies of slot lists touch a few MB instead of a hundred."""
    if hi > len(_PAGE_IDS):
        _PAGE_IDS.extend(range(len(_PAGE_IDS), hi))
    return _PAGE_IDS[lo:hi]


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` slots: the one page rounding, reused everywhere."""
    return -(-tokens // page_size)


class KVPool:
    def __init__(self, capacity: int, page_size: int = 1):
        if capacity < 1 or page_size < 1 or capacity % page_size:
            raise ValueError(f"bad KV pool shape: capacity={capacity} page_size={page_size}")
        self.capacity = capacity
        self.page_size = page_size
        self.num_pages = capacity // page_size
        # freed pages: a stack (pop from the end); never-used pages: hw .. num_pages-1,
        # handed out in order after the stack is empty (no O(capacity) list at start)
        self._free: list[int] = []
        self._hw = 0

    # ---- sizes -------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free) + self.num_pages - self._hw

    @property
    def free_tokens(self) -> int:
        return self.free_pages * self.page_size

    def free_list(self) -> list[int]:
        """All free pages, in the order pop() would see them from the end."""
        return list(range(self.num_pages - 1, self._hw - 1, -1)) + self._free

    # ---- pages -------------------------------------------------------------
    def alloc(self, n: int) -> list[int] | None:
        """n pages, or None when fewer are free (nothing is taken then)."""
        if n <= 0:
            return []
        free = self._free
        k = len(free)
        if n > k + self.num_pages - self._hw:
            return None
        if n <= k:
            out = free[-n:]
            del free[-n:]
            out.reverse()
            return out
        out = free[::-1]
        free.clear()
        hw = self._hw
        out.extend(_page_ids(hw, hw + n - k))
        self._hw = hw + n - k
        return out

    def free(self, pages) -> None:
        self._free.extend(pages)

    def free_set(self) -> set[int]:
        return set(self.free_list())

    # ---- slot lists ----------------------------------------------------------
    def pages_needed(self, cur_len: int, n: int) -> int:
        """Pages to allocate to grow a page-aligned slot list from cur_len to cur_len+n."""
        p = self.page_size
        if p == 1:
            return n
        return pages_for(cur_len + n, p) - pages_for(cur_len, p)

    def extend(self, slots: list[int], n: int, pages: list[int]) -> None:
        """Append n positions to `slots`, filling the partial last page first,
        then the given freshly allocated pages (len == pages_needed)."""
        p = self.page_size
        if p == 1:
            slots.extend(pages)
            return
        cur = len(slots)
        room = (-cur) % p
        take = min(room, n)
        if take:
            base = slots[-1] + 1
            slots.extend(range(base, base + take))
        rest = n - take
        for pg in pages:
            k = min(p, rest)
            slots.extend(range(pg * p, pg * p + k))
            rest -= k
        assert rest == 0

    def pages_of(self, slots: list[int], start: int = 0, end: int | None = None) -> list[int]:
        """Pages holding positions start..end-1 of a page-aligned slot list (start aligned)."""
        p = self.page_size
        if end is None:
            end = len(slots)
        if p == 1:
            return slots[start:end]
        return [slots[i] // p for i in range(start, end, p)]
