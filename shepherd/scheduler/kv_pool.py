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


class KVPool:
    def __init__(self, capacity: int, page_size: int = 1):
        if capacity < 1 or page_size < 1 or capacity % page_size:
            raise ValueError(f"bad KV pool shape: capacity={capacity} page_size={page_size}")
        self.capacity = capacity
        self.page_size = page_size
        self.num_pages = capacity // page_size
        # pop from the end: page 0 first
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))

    # ---- sizes -------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def free_tokens(self) -> int:
        return len(self._free) * self.page_size

    # ---- pages -------------------------------------------------------------
    def alloc(self, n: int) -> list[int] | None:
        """n pages, or None when fewer are free (nothing is taken then)."""
        if n <= 0:
            return []
        free = self._free
        if n > len(free):
            return None
        out = free[-n:]
        del free[-n:]
        out.reverse()
        return out

    def free(self, pages) -> None:
        self._free.extend(pages)

    def free_set(self) -> set[int]:
        return set(self._free)

    # ---- slot lists ----------------------------------------------------------
    def pages_needed(self, cur_len: int, n: int) -> int:
        """Pages to allocate to grow a page-aligned slot list from cur_len to cur_len+n."""
        p = self.page_size
        if p == 1:
            return n
        return -(-(cur_len + n) // p) - (-(-cur_len // p))

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
