"""KVManager: the one owner of KV memory and of every write to a request's slots.

It holds the device pool, the prefix cache (radix tree) and the host (swap)
pool, and is the only code that matches, allocates, grows, caches, swaps or
frees a request's slots. The Scheduler decides *who*; this decides *where*.
(vLLM's KVCacheManager and mini-sglang's CacheManager own the same thing.)
"""
from __future__ import annotations

from typing import Iterable, Optional

from shepherd.request import RequestState
from shepherd.scheduler.cache_events import DECODE_CACHE_BLOCK, CacheEventLog
from shepherd.scheduler.kv_pool import KVPool, pages_for
from shepherd.scheduler.radix_cache import RadixCache
from shepherd.scheduler.state import Entry, SchedulerStats
from shepherd.step import SwapOp


def lookup_len(req, n: int) -> int:
    """How many of a request's n known tokens the prefix cache may serve: all but the last (its
    logits are needed), none for a request that asked for its prompt's logprobs (every position
    must run through the model)."""
    return 0 if req.params.prompt_logprobs is not None else n - 1


class KVManager:
    def __init__(self, capacity: int, page_size: int, prefix_cache: bool, host_capacity: int,
                 stats: SchedulerStats):
        self.capacity = capacity
        self.page_size = page_size
        self.pool = KVPool(capacity, page_size)
        self.tree: Optional[RadixCache] = RadixCache(self.pool) if prefix_cache else None
        self.host_capacity = max(0, int(host_capacity))
        self.host_used = 0
        self.stats = stats

    def record_cache_events(self) -> Optional[CacheEventLog]:
        """Have the prefix cache record what it adds, splits and evicts (None when it is off)."""
        if self.tree is None:
            return None
        if self.tree.events is None:
            self.tree.events = CacheEventLog()
        return self.tree.events

    def reset_prefix_cache(self) -> tuple[int, int]:
        """Empty the prefix cache but for what running requests use (RadixCache.reset):
        (tokens freed, tokens kept); (0, 0) when the cache is off."""
        return self.tree.reset() if self.tree is not None else (0, 0)

    # ------------------------------------------------------------------ sizes
    def available_pages(self) -> int:
        """Free pages plus what the prefix cache could give back."""
        ev = self.tree.evictable_size // self.page_size if self.tree is not None else 0
        return self.pool.free_pages + ev

    @property
    def evictable_tokens(self) -> int:
        return self.tree.evictable_size if self.tree is not None else 0

    @property
    def evicted_tokens(self) -> int:
        """Tokens the prefix cache has evicted so far."""
        return self.tree.evicted_total if self.tree is not None else 0

    def used_tokens(self) -> int:
        ev = self.tree.evictable_size if self.tree is not None else 0
        return self.capacity - self.pool.free_pages * self.page_size - ev

    def own_pages(self, e: Entry) -> list[int]:
        return self.pool.pages_of(e.req.slots, e.cached_len)

    def alloc(self, npages: int) -> Optional[list[int]]:
        pool = self.pool
        if npages > pool.free_pages and self.tree is not None:
            self.tree.evict((npages - pool.free_pages) * self.page_size)
        return pool.alloc(npages)

    # ------------------------------------------------------------------ admission figures
    def _growth(self, e: Entry, length: int) -> int:
        b = e.final - length
        return b + self.page_size - 1 if b > 0 else 0

    def pair(self, e: Entry, length: Optional[int] = None) -> tuple[int, int]:
        """(own, b) of a running request whose slot list is `length` long (now by default)."""
        L = len(e.req.slots) if length is None else length
        return pages_for(L - e.cached_len, self.page_size) * self.page_size, self._growth(e, L)

    def lockstep_pair(self, e: Entry, ahead: int = 0) -> tuple[int, int]:
        """pair() for a lockstep (peak) estimate, `ahead` decode steps from now: a request whose
        next step allocates nothing (its last prompt token still to run) grows one step behind
        the others and lives one step longer, so its b counts that step (an upper bound)."""
        r = e.req
        L = max(len(r.slots), r.num_computed + ahead)
        own, b = self.pair(e, L)
        return own, b + L - r.num_computed - ahead

    def _cached(self, req) -> bool:
        """Whether this request's KV is shared through the prefix cache: the base model's
        only. A LoRA adapter changes every layer's K and V, so its KV is never another's
        (no hits across adapters); requests of one adapter do not share theirs either (yet)."""
        return self.tree is not None and req.adapter is None

    def candidate_need(self, e: Entry) -> tuple[int, int, int]:
        """(own tokens, growth b, locked-from-free) for admitting waiting e now.
        No side effects on the cache: a failed attempt leaves it exactly as it was. The
        match is remembered on the entry (RadixCache.match_memo), so a request that waits
        through many steps is not compared against the tree again while the tree around
        its match has not changed."""
        req = e.req
        n = len(req.prompt_ids) + len(req.output_ids)
        hit = locked = 0
        if self._cached(req):
            hit, locked, e.prefix_memo = self.tree.match_memo(e.prefix_memo, lookup_len(req, n),
                                                              lambda: self._ids(req))
        own = self.pool.pages_needed(hit, n - hit) * self.page_size
        return own, self._growth(e, n), locked

    @staticmethod
    def _ids(req) -> list[int]:
        return req.all_ids if req.output_ids else req.prompt_ids   # no copy of a prompt that waits

    def swap_need(self, e: Entry) -> tuple[int, int, int]:
        n = e.req.num_tokens
        return self.pool.pages_needed(0, n) * self.page_size, self._growth(e, n), 0

    # ------------------------------------------------------------------ admit / swap
    def admit(self, e: Entry, own: int) -> None:
        """Give waiting e its whole known sequence: the cached prefix (locked) plus `own` fresh tokens."""
        req = e.req
        ids = self._ids(req)
        e.prefix_memo = None          # running now: the memo would only keep nodes alive
        arrived = req.kv_ready        # its prompt was looked up where it was computed: not counted again
        hit = 0
        req.slots = []
        st = self.stats
        if self._cached(req):
            hit_slots, node = self.tree.match_prefix(ids, touch=True, n=lookup_len(req, len(ids)))
            hit = len(hit_slots)
            if hit:
                self.tree.inc_lock_ref(node)
                e.node = node
            req.slots = hit_slots
            if own != self.pool.pages_needed(hit, len(ids) - hit) * self.page_size:
                raise AssertionError("match_prefix disagrees with match_info")
            if not arrived:
                st.prefix_query_tokens += len(ids)
        e.cached_len = hit
        pages = self.alloc(own // self.page_size)
        assert pages is not None, "admission promised pages"
        self.pool.extend(req.slots, len(ids) - hit, pages)
        # KV that came with the request (Request.kv_ready) is written, not computed; the last known
        # token is always fed, to sample the next. Once only: after a preemption it is recomputed.
        req.num_computed = max(hit, min(req.kv_ready, len(ids) - 1))
        req.kv_ready = 0
        if not e.admitted_once:
            req.num_cached = hit
        if not arrived:
            st.prefix_hit_tokens += hit
            st.last_cached_tokens += hit

    def swap_in(self, e: Entry, own: int) -> SwapOp:
        req = e.req
        pages = self.alloc(own // self.page_size)
        assert pages is not None, "admission promised pages"
        req.slots = []
        self.pool.extend(req.slots, req.num_tokens, pages)
        self.host_used -= e.host_tokens
        self.stats.swap_in_tokens += e.host_tokens
        self.stats.last_swap_in += e.host_tokens
        e.host_tokens = 0
        return SwapOp(req.req_id, req.slots[:req.num_computed])

    def undo_swap_in(self, e: Entry, op: SwapOp) -> None:
        """Take back a swap-in decided earlier in this step (the executor never saw it)."""
        req = e.req
        self.pool.free(self.pool.pages_of(req.slots, 0))
        req.slots = []
        e.host_tokens = len(op.slots)
        self.host_used += e.host_tokens
        self.stats.swap_in_tokens -= e.host_tokens
        self.stats.last_swap_in -= e.host_tokens

    def swap_out(self, e: Entry) -> Optional[SwapOp]:
        """Move e's computed KV to the host pool; None (nothing done) when it does not fit."""
        req = e.req
        tokens = req.num_computed
        if tokens <= 0 or self.host_used + tokens > self.host_capacity:
            return None
        op = SwapOp(req.req_id, req.slots[:tokens])
        self.host_used += tokens
        e.host_tokens = tokens
        self.stats.swap_out_tokens += tokens
        self.stats.last_swap_out += tokens
        self.release(e, cache=False)
        return op

    def drop_host(self, e: Entry) -> None:
        self.host_used -= e.host_tokens
        e.host_tokens = 0

    # ------------------------------------------------------------------ release / cache
    def release(self, e: Entry, cache: bool = True) -> None:
        """Give back a request's device KV: computed full pages go into the prefix
        cache (when on), duplicates and the rest to the free list."""
        req = e.req
        pool = self.pool
        slots = req.slots
        if self._cached(req) and cache:
            n = min(req.num_computed, len(slots))
            n -= n % self.page_size
            if n > e.cached_len:
                existing = self._insert_rest(e, n)[0]
                if existing > e.cached_len:
                    pool.free(pool.pages_of(slots, e.cached_len, existing))
                pool.free(pool.pages_of(slots, n))
            else:
                pool.free(pool.pages_of(slots, e.cached_len))
        else:
            pool.free(pool.pages_of(slots, e.cached_len))
        if e.node is not None:
            self.tree.dec_lock_ref(e.node)
            e.node = None
        e.cached_len = 0
        req.slots = []

    @staticmethod
    def _seq(req, n: int, more: list[int]) -> list[int]:
        """Positions 0..n-1 of req's sequence: its prompt, its output ids, then `more` (tokens
        sampled in a fast-forward window that output_ids does not hold yet)."""
        pr = req.prompt_ids
        if n <= len(pr):
            return pr
        out = req.output_ids
        return pr + (out + more if more else out)[:n - len(pr)]

    def _insert_rest(self, e: Entry, n: int, more: list[int] = ()):
        """Insert positions cached_len..n-1 of e's sequence under the node that holds its
        cached prefix (the root when none): the prefix is neither compared nor copied
        again. Returns (how many of positions 0..n-1 the tree already held, the node
        where position n-1 ends)."""
        req = e.req
        c = e.cached_len
        assert e.node is not None or c == 0
        pr = req.prompt_ids
        if n <= len(pr):
            ids = pr[c:n]
        else:
            out = req.output_ids + more if more else req.output_ids
            ids = pr[c:] + out[max(0, c - len(pr)):n - len(pr)]
        existing, node = self.tree.insert_node(ids, req.slots[c:n], under=e.node)
        return c + existing, node

    def cache_prefilled(self, e: Entry, n: Optional[int] = None, more: list[int] = ()) -> None:
        """SGLang's cache_unfinished_req: once a prompt is computed, put it in the
        prefix cache right away (not only when the request ends), so that requests
        arriving meanwhile with the same prefix hit it. Where the tree already held
        some of these tokens, the request switches to the tree's slots and frees its
        duplicates (the executor is sent the whole slot table again). n: cache
        positions 0..n-1 (page-aligned; default: all computed); more: see _seq."""
        req = e.req
        if n is None:
            n = req.num_computed
            n -= n % self.page_size
        if not self._cached(req) or n <= e.cached_len:
            return
        tree = self.tree
        existing, node = self._insert_rest(e, n, more)
        if existing > e.cached_len:
            slots, node = tree.match_prefix(self._seq(req, n, more), touch=False, n=n)   # the tree's slots for the shared part
            assert len(slots) == n
            self.pool.free(self.pool.pages_of(req.slots, e.cached_len, existing))
            req.slots[e.cached_len:existing] = slots[e.cached_len:existing]
            e.synced = 0
        tree.inc_lock_ref(node)
        if e.node is not None:
            tree.dec_lock_ref(e.node)
        e.node = node
        e.cached_len = n

    # ------------------------------------------------------------------ decode caching (vLLM's full blocks)
    def next_cache_at(self, cached_len: int) -> int:
        """The computed length at which a decoding request whose cache ends at cached_len
        caches again: the first page boundary at or past the next whole DECODE_CACHE_BLOCK."""
        p = self.page_size
        t = (cached_len // DECODE_CACHE_BLOCK + 1) * DECODE_CACHE_BLOCK
        return -(-t // p) * p

    def cache_decoded(self, e: Entry) -> None:
        """vLLM caches a running request's blocks as they fill: when e's computed length has
        crossed a whole DECODE_CACHE_BLOCK past what it cached, its sequence so far (prompt
        and the answer's computed tokens, never a rejected draft: num_computed counts only
        accepted ones) goes into the prefix cache, so a request sharing it hits it and the
        KV events announce it while e still runs. Runs after e's tokens are accepted."""
        if e.req.num_computed >= self.next_cache_at(e.cached_len) and self._cached(e.req):
            self.cache_prefilled(e)

    def cache_may_share(self, e: Entry, shared: set) -> bool:
        """Whether e's next decode insert might find its tokens in the tree already (another
        request's continuation below its cached end, or another running request with the same
        cached end: `shared` holds the ids of such nodes), and so swap slots and free pages:
        the fast path ends its window by then (fast_path.py)."""
        nd = e.node
        return self._cached(e.req) and (nd is None or bool(nd.children) or id(nd) in shared)

    # ------------------------------------------------------------------ decode growth
    def decode_pages(self, e: Entry, k: int = 1) -> int:
        """Pages e must allocate to decode k more steps."""
        r = e.req
        L = len(r.slots)
        target = r.num_computed + k
        if L >= target:
            return 0
        p = self.page_size
        return target - L if p == 1 else pages_for(target, p) - pages_for(L, p)

    def step_pages(self, entries: list[Entry]) -> list[int]:
        """decode_pages(e, 1) of each entry, in one pass (this runs every step)."""
        p = self.page_size
        return [1 if len(e.req.slots) <= e.req.num_computed and (p == 1 or len(e.req.slots) % p == 0) else 0
                for e in entries]

    def grow(self, running: list[Entry], k: int) -> None:
        """Give every running decoder slots for k more positions, popping pages in the
        order k single decode steps would (step by step, batch order): so one step
        and a fast-forward of k steps leave the same pool."""
        pool = self.pool
        p = self.page_size
        n = len(running)
        if k == 1:   # one decode step (every step of the engine): a new page only at a page boundary
            need = self.step_pages(running)
            pages = self.alloc(sum(need))
            assert pages is not None
            it = iter(pages)
            for e, new_page in zip(running, need):
                sl = e.req.slots
                if new_page:
                    sl.append(next(it) * p if p > 1 else next(it))   # the pool's own int, not a copy
                elif len(sl) <= e.req.num_computed:
                    sl.append(sl[-1] + 1)
            return
        if p == 1 and all(len(e.req.slots) == e.req.num_computed for e in running):
            pages = self.alloc(n * k)
            assert pages is not None
            for i, e in enumerate(running):
                e.req.slots.extend(pages[i::n])
            return
        events = []
        for i, e in enumerate(running):
            r = e.req
            nc = r.num_computed
            q = max(nc, len(r.slots))
            q += (-q) % p if p > 1 else 0
            while q < nc + k:
                events.append((q - nc + 1, i))
                q += p
        events.sort()
        pages = self.alloc(len(events))
        assert pages is not None
        per: list[list[int]] = [[] for _ in running]
        for (_, i), pg in zip(events, pages):
            per[i].append(pg)
        for i, e in enumerate(running):
            r = e.req
            target = r.num_computed + k
            if len(r.slots) < target:
                pool.extend(r.slots, target - len(r.slots), per[i])

    # ------------------------------------------------------------------ speculation
    def grow_ahead(self, e: Entry, k: int) -> int:
        """Slots for up to k positions past the one e decodes next (its drafts), from free pages
        and what the prefix cache can give back, never another request's: how many it got."""
        r = e.req
        sl = r.slots
        have = len(sl) - r.num_computed - 1
        if have >= k:
            return k
        p = self.page_size
        n = k - have
        pages = self.pool.pages_needed(len(sl), n)
        avail = self.available_pages()
        if pages > avail:
            n = min(n, (-len(sl)) % p + avail * p)
            pages = self.pool.pages_needed(len(sl), n)
        if n <= 0:
            return max(0, have)
        got = self.alloc(pages)
        assert got is not None
        self.pool.extend(sl, n, got)
        return have + n

    def trim(self, e: Entry, keep: int) -> None:
        """Free e's slots past position keep - 1 (rejected drafts): whole pages go back to the
        free list; the executor is sent the table from `keep` on with the next step."""
        sl = e.req.slots
        if len(sl) <= keep:
            return
        p = self.page_size
        first = pages_for(keep, p) * p          # the first position of a page no longer needed
        if first < len(sl):
            self.pool.free(self.pool.pages_of(sl, first))
        del sl[keep:]
        if e.synced > keep:
            e.synced = keep

    # ------------------------------------------------------------------ integrity
    def check(self, running: Iterable[Entry], waiting: Iterable[Entry], swapped: Iterable[Entry]) -> None:
        """Raise AssertionError if any page is lost or owned twice; when nothing
        runs, also free + evictable == capacity and no cache node is locked."""
        pool = self.pool
        seen: dict[int, str] = {}
        for pg in pool.free_list():
            assert pg not in seen, f"page {pg} twice in the free list"
            seen[pg] = "free"
        if self.tree is not None:
            self.tree.check()
            for pg in self.tree.all_pages():
                assert pg not in seen, f"cache page {pg} also {seen[pg]}"
                seen[pg] = "cache"
        running = list(running)
        for e in running:
            r = e.req
            assert r.state is RequestState.RUNNING
            assert len(r.slots) >= r.num_computed, (r.req_id, len(r.slots), r.num_computed)
            assert e.cached_len % self.page_size == 0
            assert len(r.slots) <= r.num_tokens, (r.req_id, len(r.slots), r.num_tokens)
            for pg in self.own_pages(e):
                assert pg not in seen, f"page {pg} of {r.req_id} also {seen[pg]}"
                seen[pg] = r.req_id
        assert len(seen) == pool.num_pages, f"{pool.num_pages - len(seen)} pages leaked"
        for e in waiting:
            assert e.req.state is RequestState.WAITING and not e.req.slots and e.node is None
        swapped = list(swapped)
        for e in swapped:
            assert e.req.state is RequestState.SWAPPED and not e.req.slots and e.host_tokens > 0
        assert self.host_used == sum(e.host_tokens for e in swapped)
        assert self.host_used <= self.host_capacity
        if not running:
            prot = self.tree.protected_size if self.tree is not None else 0
            assert prot == 0, f"{prot} cache tokens still locked while idle"
            ev = self.evictable_tokens
            assert pool.free_tokens + ev == self.capacity, (pool.free_tokens, ev, self.capacity)
