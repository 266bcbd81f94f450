"""BlockManager: allocation, prefix caching of full computed blocks, ref counts, eviction order, no leaks."""

import pytest

from kiln.errors import KilnError
from kiln.infer.block_manager import BlockManager, block_hash

from ._helpers import make_seq


def computed(bm: BlockManager, seq, n: int) -> None:
    """What a step that computed seq's first n tokens does to it."""
    seq.num_computed_tokens = n
    bm.mark_computed(seq)


def test_allocate_and_free():
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq(0, list(range(10)))
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert seq.num_computed_tokens == seq.num_cached_tokens == 0
    assert (bm.num_free_blocks, bm.num_used_blocks) == (7, 3)
    assert all(bm.ref_counts[b] == 1 for b in seq.block_table)
    bm.deallocate(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 10 and sum(bm.ref_counts) == 0


def test_cannot_allocate_more_than_free():
    bm = BlockManager(num_blocks=2, block_size=4)
    big = make_seq(0, list(range(9)))  # 3 blocks
    assert not bm.can_allocate(big)
    with pytest.raises(RuntimeError, match="not enough free blocks"):
        bm.allocate(big)


def test_append_slot_adds_a_block_when_the_next_token_starts_one():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(0, [1, 2, 3, 4])
    bm.allocate(seq)
    computed(bm, seq, 4)
    seq.append_token(9)  # 5 tokens: position 4 starts block 1
    assert bm.can_append(seq)
    bm.append_slot(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 2
    computed(bm, seq, 5)
    seq.append_token(10)  # position 5 is inside block 1: nothing to add
    bm.append_slot(seq)
    assert len(seq.block_table) == 2


def test_prefix_hit_shares_full_computed_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(0, list(range(10)))
    bm.allocate(a)
    computed(bm, a, 10)  # blocks 0, 1 full and computed; block 2 partial
    assert bm.num_cached_blocks == 2
    b = make_seq(1, list(range(8)) + [50, 51, 52])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    # a different first block: the chain breaks at once even though block 1's tokens match
    c = make_seq(2, [99, 1, 2, 3] + list(range(4, 8)) + [7])
    assert bm.num_cached_prefix_tokens(c) == 0
    # the hash chains the parent: equal tokens under another parent are another key
    assert block_hash(b"", [4, 5, 6, 7]) != block_hash(block_hash(b"", [0, 1, 2, 3]), [4, 5, 6, 7])
    bm.deallocate(a)
    assert [bm.ref_counts[x] for x in b.block_table] == [1, 1, 1]
    bm.deallocate(b)
    assert bm.num_free_blocks == 16


def test_no_hit_on_blocks_not_yet_computed():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(0, list(range(12)))
    bm.allocate(a)
    b = make_seq(1, list(range(12)) + [7])
    assert bm.num_cached_prefix_tokens(b) == 0  # allocated but nothing computed
    computed(bm, a, 6)  # a chunk of 6: block 0 full and computed, block 1 half written
    assert bm.num_cached_prefix_tokens(b) == 4
    computed(bm, a, 8)
    assert bm.num_cached_prefix_tokens(b) == 8
    bm.deallocate(a)


def test_hit_never_covers_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(0, list(range(9)))
    bm.allocate(a)
    computed(bm, a, 9)
    same = make_seq(1, list(range(8)))  # exactly two full cached blocks: the second is recomputed
    bm.allocate(same)
    assert same.num_computed_tokens == 4 and same.block_table[0] == a.block_table[0]
    assert same.block_table[1] != a.block_table[1]
    longer = make_seq(2, list(range(9)))
    assert bm.num_cached_prefix_tokens(longer) == 8


def test_concurrent_duplicate_prefill_keeps_the_first_copy():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(0, list(range(5))), make_seq(1, list(range(5)))
    bm.allocate(a)
    bm.allocate(b)  # nothing computed yet: no sharing
    assert set(a.block_table).isdisjoint(b.block_table)
    computed(bm, a, 5)
    computed(bm, b, 5)
    assert bm.num_cached_blocks == 1
    c = make_seq(2, list(range(5)))
    bm.allocate(c)
    assert c.block_table[0] == a.block_table[0]
    for s in (a, b, c):
        bm.deallocate(s)
    assert bm.num_free_blocks == 8


def test_freed_blocks_stay_hittable_until_reused_lru():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_seq(0, [1, 2, 3, 4, 5])  # 3 blocks
    bm.allocate(a)
    computed(bm, a, 5)
    table = list(a.block_table)
    bm.deallocate(a)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 2
    # a hit revives the free cached blocks: they leave the free queue
    b = make_seq(1, [1, 2, 3, 4, 9])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:2] == table[:2] and b.num_cached_tokens == 4
    assert bm.num_free_blocks == 3
    bm.deallocate(b)
    # free queue now: the 3 never-cached blocks, b's tail block, then [3, 4], then [1, 2] (a sequence
    # frees tail first, so a prefix's head is the last to go)
    c = make_seq(2, [7] * 9)  # 5 blocks: evicts the [3, 4] block, keeps [1, 2]
    bm.allocate(c)
    assert table[1] in c.block_table and table[0] not in c.block_table
    d = make_seq(3, [1, 2, 3, 4, 5])
    assert bm.num_cached_prefix_tokens(d) == 2
    bm.deallocate(c)
    assert bm.num_free_blocks == 6


def test_can_allocate_counts_revived_blocks():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_seq(0, [1, 2, 3, 4, 5])
    bm.allocate(a)
    computed(bm, a, 5)
    bm.deallocate(a)
    hold = make_seq(1, [8, 8, 8])  # takes 2 blocks: the uncached one, then the [3, 4] one (evicted)
    bm.allocate(hold)
    b = make_seq(2, [1, 2, 3, 4, 5])  # hits [1, 2] (free) and needs 2 more: 3 > 1 free
    assert bm.num_cached_prefix_tokens(b) == 2 and not bm.can_allocate(b)
    bm.deallocate(hold)
    assert bm.can_allocate(b)


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_seq(0, [1, 2, 3, 4, 5])
    bm.allocate(a)
    computed(bm, a, 5)
    assert bm.num_cached_blocks == 0 and bm.num_cached_prefix_tokens(make_seq(1, [1, 2, 3, 4, 5])) == 0


def test_reset():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq(0, [1, 2, 3])
    bm.allocate(a)
    computed(bm, a, 3)
    with pytest.raises(KilnError, match="in use"):
        bm.reset()
    bm.deallocate(a)
    bm.reset()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 4


def test_bad_sizes():
    with pytest.raises(KilnError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(KilnError, match="block_size"):
        BlockManager(4, 0)


def test_no_leak_with_shared_prefixes():
    bm = BlockManager(num_blocks=64, block_size=4)
    start = bm.num_free_blocks
    shared = list(range(11))
    seqs = [make_seq(i, shared + [100 + i] * (i + 1)) for i in range(6)]
    for s in seqs:
        bm.allocate(s)
        computed(bm, s, s.num_tokens)
        for t in range(5):  # five decode steps each
            s.append_token(200 + t)
            bm.append_slot(s)
            computed(bm, s, s.num_tokens)
    assert bm.num_used_blocks < sum(len(s.block_table) for s in seqs)  # sharing happened
    for s in seqs:
        bm.deallocate(s)
    assert bm.num_free_blocks == start and sum(bm.ref_counts) == 0
