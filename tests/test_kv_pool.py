from shepherd.scheduler.kv_pool import KVPool


def test_alloc_free_accounting():
    p = KVPool(64, page_size=4)
    assert p.num_pages == 16 and p.free_tokens == 64
    a = p.alloc(3)
    assert len(a) == 3 and p.free_pages == 13
    assert p.alloc(14) is None and p.free_pages == 13      # nothing taken on failure
    p.free(a)
    assert p.free_pages == 16


def test_bulk_alloc_equals_single_allocs():
    p1, p2 = KVPool(32), KVPool(32)
    bulk = p1.alloc(10)
    single = [p2.alloc(1)[0] for _ in range(10)]
    assert bulk == single


def test_extend_fills_partial_page_first():
    p = KVPool(64, page_size=4)
    slots = []
    p.extend(slots, 6, p.alloc(p.pages_needed(0, 6)))
    assert len(slots) == 6
    assert slots[:4] == list(range(slots[0], slots[0] + 4)) and slots[0] % 4 == 0
    assert p.pages_needed(6, 2) == 0
    p.extend(slots, 2, [])
    assert slots[4:8] == list(range(slots[4], slots[4] + 4))
    assert p.pages_needed(8, 1) == 1
    assert p.pages_of(slots) == [slots[0] // 4, slots[4] // 4]


def test_token_granularity():
    p = KVPool(8, page_size=1)
    s = []
    p.extend(s, 5, p.alloc(5))
    assert sorted(s) == [0, 1, 2, 3, 4]
    assert p.pages_of(s, 2) == s[2:]
