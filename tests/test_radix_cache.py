from shepherd.scheduler.kv_pool import KVPool
from shepherd.scheduler.radix_cache import RadixCache


def _ins(tree, pool, ids):
    slots = []
    pool.extend(slots, len(ids), pool.alloc(pool.pages_needed(0, len(ids))))
    existing = tree.insert(ids, slots)
    if existing:
        pool.free(pool.pages_of(slots, 0, existing))
    return slots


def test_match_insert_split_and_sizes():
    pool = KVPool(64)
    t = RadixCache(pool)
    a = _ins(t, pool, [1, 2, 3, 4, 5])
    assert t.evictable_size == 5
    hit, node = t.match_prefix([1, 2, 3, 9])
    assert hit == a[:3]
    assert t.match_len([1, 2, 3, 4, 5, 6]) == 5
    _ins(t, pool, [1, 2, 3, 7, 8])
    assert t.evictable_size == 7          # shared [1,2,3] stored once
    t.check()
    assert t.match_info([1, 2, 3, 7]) == (4, 4)


def test_lock_protects_from_eviction():
    pool = KVPool(16)
    t = RadixCache(pool)
    _ins(t, pool, [1, 2, 3, 4])
    _ins(t, pool, [5, 6, 7, 8])
    _, node = t.match_prefix([1, 2, 3, 4])
    t.inc_lock_ref(node)
    assert t.protected_size == 4 and t.evictable_size == 4
    assert t.match_info([1, 2, 3, 4]) == (4, 0)
    freed = t.evict(100)
    assert freed == 4 and t.match_len([5, 6, 7, 8]) == 0 and t.match_len([1, 2, 3, 4]) == 4
    t.dec_lock_ref(node)
    assert t.evictable_size == 4 and t.protected_size == 0
    t.check()


def test_lru_evicts_least_recent_leaf_then_parent():
    pool = KVPool(32)
    t = RadixCache(pool)
    _ins(t, pool, [1, 2, 3, 4])
    _ins(t, pool, [1, 2, 9, 9])        # splits: [1,2] -> {[3,4], [9,9]}
    _ins(t, pool, [7, 7])
    t.match_prefix([1, 2, 3, 4])        # touch: [1,2,3,4] most recent
    t.evict(2)                          # LRU leaf: [9,9]? no -- [7,7] was inserted after [9,9]
    assert t.match_len([1, 2, 9, 9]) == 2
    assert t.match_len([7, 7]) == 2
    t.evict(2)
    assert t.match_len([7, 7]) == 0
    t.evict(4)                          # [3,4], then [1,2] becomes a leaf and goes too
    assert t.match_len([1, 2, 3, 4]) == 0
    assert pool.free_pages == 32
    assert t.evicted_total == 8             # every cached token was evicted once, and counted
    t.check()


def test_page_aligned_matching():
    pool = KVPool(64, page_size=4)
    t = RadixCache(pool)
    _ins(t, pool, list(range(10, 22)))            # 12 tokens = 3 pages
    assert t.match_len(list(range(10, 21))) == 8  # 11 tokens -> 2 full pages
    assert t.match_len(list(range(10, 16)) + [0, 0]) == 4
    hit, _ = t.match_prefix(list(range(10, 16)) + [0, 0])
    assert len(hit) == 4
    t.check()


def _shape(t):
    """Every node as (path tokens, last_access, lock_ref), and the evictable count."""
    out = []
    stack = [(t.root, ())]
    while stack:
        nd, path = stack.pop()
        for ch in nd.children.values():
            p = path + tuple(ch.key)
            out.append((p, ch.last_access, ch.lock_ref))
            stack.append((ch, p))
    return sorted(out), t.evictable_size


def test_insert_under_a_locked_node_is_an_insert_from_the_root():
    """insert_node(under=node) skips comparing node's path again; it must leave the
    same tree (splits, touches, sizes) and the same eviction order as a root walk."""
    trees = []
    for under in (False, True):
        pool = KVPool(64)
        t = RadixCache(pool)
        _ins(t, pool, [1, 2, 3, 4, 5, 6])
        _ins(t, pool, [1, 2, 9])
        slots, node = t.match_prefix([1, 2, 3, 4, 7], n=4)       # splits [3, 4, 5, 6] after 4
        t.inc_lock_ref(node)
        own = pool.alloc(3)
        seq, all_slots = [1, 2, 3, 4, 8, 8, 8], slots + own
        if under:
            existing, end = t.insert_node(seq[4:], all_slots[4:], under=node)
            existing += 4
        else:
            existing, end = t.insert_node(seq, all_slots)
        assert existing == 4 and t.match_prefix(seq, touch=False)[1] is end
        t.check()
        t.dec_lock_ref(node)
        shape = _shape(t)
        order = []
        while t.evictable_size:
            before = _shape(t)[0]
            t.evict(1)
            order.append(sorted(set(before) - set(_shape(t)[0])))
        trees.append((shape, order))
    assert trees[0] == trees[1]


def test_reset_frees_every_unlocked_node_and_keeps_the_locked_path():
    from shepherd.scheduler.cache_events import CacheCleared, CacheEventLog, NodeAdded
    pool = KVPool(64)
    t = RadixCache(pool, CacheEventLog())
    _ins(t, pool, [1, 2, 3, 4, 5, 6])
    _ins(t, pool, [1, 2, 3, 9, 9])             # splits [1,2,3] off: a running request will hold this path
    _ins(t, pool, [7, 7, 7])
    _ins(t, pool, [1, 2, 3, 9, 9, 8, 8])       # a child under the locked node: unlocked, must go
    kept, node = t.match_prefix([1, 2, 3, 9, 9])
    t.inc_lock_ref(node)
    t.events.drain()
    assert t.reset() == (3 + 3 + 2, 5)         # [4,5,6], [7,7,7], [8,8] freed; [1,2,3] + [9,9] kept
    assert t.evictable_size == 0 and t.protected_size == 5
    assert t.match_prefix([1, 2, 3, 9, 9, 8, 8])[0] == kept     # the running request's slots are intact
    assert t.match_len([1, 2, 3, 4]) == 3 and t.match_len([7, 7, 7]) == 0
    assert pool.free_pages == 64 - 5
    recs = t.events.drain()
    cleared = [i for i, r in enumerate(recs) if isinstance(r, CacheCleared)]
    assert len(cleared) == 1
    again = recs[cleared[0] + 1:]              # the kept nodes, parents first
    assert [r.tokens for r in again] == [[1, 2, 3], [9, 9]] and all(isinstance(r, NodeAdded) for r in again)
    assert again[0].parent == 0 and again[1].parent == again[0].node
    t.dec_lock_ref(node)                       # the request ends: its path is an ordinary cached prefix
    assert t.evictable_size == 5 and t.evict(100) == 5 and pool.free_pages == 64
    t.check()


def test_eviction_frees_only_the_tail_it_needs():
    # a long leaf loses its tail (at least EVICT_CHUNK_TOKENS, page-aligned), not the whole history:
    # the front stays cached and matchable, a leaf again at the same age
    from shepherd.scheduler.radix_cache import EVICT_CHUNK_TOKENS as C
    pool = KVPool(4096, page_size=16)
    t = RadixCache(pool)
    old = list(range(1000, 1000 + 4 * C))            # inserted first: the LRU leaf
    new = list(range(9000, 9000 + 4 * C))
    _ins(t, pool, old)
    _ins(t, pool, new)
    assert t.evict(16) == C                          # one page asked: one chunk freed
    assert t.match_len(old) == 3 * C and t.match_len(new) == 4 * C
    assert t.evict(C + 16) == C + 16                 # the same front is still the oldest
    assert t.match_len(old) == 2 * C - 16 and t.match_len(new) == 4 * C
    assert t.evicted_total == 2 * C + 16 and t.evictable_size == 6 * C - 16
    t.check()
