"""BlockManager: reference counts, allocation accounting and decode-slot growth. Pure Python.

Expectations are derived from the design: a block is shareable only once full of computed
KV, and the last token of a sequence is never a cache hit.
"""

import random

import pytest

from nanovllm.scheduling.block_manager import BlockManager, block_hash
from nanovllm.scheduling.sequence import Sequence
from tests.scheduling.helpers import BS, admit, check_invariants, compute, computed_seq, make_seq, release

# ------------------------------------------------------------------ sharing / ref counts


def test_shared_prefix_reference_counts():
    bm = BlockManager(10, BS)
    prompt = list(range(100, 109))  # 2 full blocks + 1 token
    a = make_seq(prompt)
    admit(bm, a)
    assert a.num_computed_tokens == 0 and len(a.block_table) == 3
    compute(bm, a)
    assert a.num_shared_blocks == 2
    assert bm.num_free_blocks == 7

    b = make_seq(prompt[:8] + [7, 7, 7])  # same two full blocks, different tail
    admit(bm, b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert b.num_shared_blocks == 2
    for blk in a.block_table[:2]:
        assert bm.blocks[blk].ref_count == 2
    assert bm.blocks[a.block_table[2]].ref_count == 1
    assert bm.num_free_blocks == 6  # only b's own tail block was taken
    check_invariants(bm, [a, b])

    release(bm, a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    for blk in b.block_table[:2]:
        assert bm.blocks[blk].ref_count == 1
        assert blk not in bm.free_block_ids
    check_invariants(bm, [b])
    shared = b.block_table[:2]
    release(bm, b)
    assert bm.num_free_blocks == 10
    for blk in shared:
        assert bm.blocks[blk].ref_count == 0
        assert bm.blocks[blk].hash != -1, "freed blocks keep their hash"
    check_invariants(bm, [])


def test_blocks_are_hashed_only_after_their_kv_is_computed():
    bm = BlockManager(20, BS)
    prompt = list(range(1, 14))  # 3 full blocks + 1
    a = make_seq(prompt)
    b = make_seq(prompt)
    admit(bm, a)
    admit(bm, b)  # a's prefill has not run yet: nothing to share
    assert b.num_computed_tokens == 0
    assert not set(a.block_table) & set(b.block_table)
    assert all(bm.blocks[x].hash == -1 for x in a.block_table)
    assert bm.hash_to_block == {}

    # partial progress (a prompt chunk): only blocks full of computed KV become shareable
    compute(bm, a, upto=6)
    assert a.num_shared_blocks == 1
    assert bm.blocks[a.block_table[0]].hash != -1
    assert bm.blocks[a.block_table[1]].hash == -1
    c = make_seq(prompt)
    admit(bm, c)
    assert c.num_computed_tokens == BS and c.block_table[0] == a.block_table[0]

    compute(bm, a, upto=13)
    assert a.num_shared_blocks == 3
    d = make_seq(prompt)
    admit(bm, d)
    assert d.num_computed_tokens == 12
    assert d.block_table[:3] == a.block_table[:3]
    check_invariants(bm, [a, b, c, d])


def test_commit_is_incremental_and_idempotent():
    bm = BlockManager(8, BS)
    a = make_seq(range(1, 10))
    admit(bm, a)
    compute(bm, a, upto=4)
    h0 = bm.blocks[a.block_table[0]].hash
    compute(bm, a, upto=4)  # nothing new
    assert a.num_shared_blocks == 1 and bm.blocks[a.block_table[0]].hash == h0
    compute(bm, a, upto=8)
    assert a.num_shared_blocks == 2
    assert bm.blocks[a.block_table[0]].hash == h0
    assert bm.blocks[a.block_table[1]].hash == block_hash([5, 6, 7, 8], h0)
    assert h0 == block_hash([1, 2, 3, 4], -1)
    assert len(bm.hash_to_block) == 2


# -------------------------------------------------------------------- allocation rules


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_full_prefix_hit_still_leaves_the_last_token(block_size):
    bm = BlockManager(64, block_size)
    prompt = list(range(1, 2 * block_size + 1))  # exactly two full blocks
    a = computed_seq(bm, prompt)
    assert a.num_shared_blocks == 2
    b = make_seq(prompt)  # everything is cached
    admit(bm, b)
    assert b.num_computed_tokens < len(b)
    # the largest whole-block prefix that leaves at least one token
    assert b.num_computed_tokens == ((len(prompt) - 1) // block_size) * block_size
    assert b.num_computed_tokens == b.num_cached_tokens
    assert len(b.block_table) == 2
    check_invariants(bm, [a, b])


def test_single_token_prompt_never_hits():
    bm = BlockManager(4, 1)
    computed_seq(bm, [5])
    b = make_seq([5])
    admit(bm, b)
    assert b.num_computed_tokens == 0


def assert_refused(bm: BlockManager, seq: Sequence) -> None:
    """``allocate`` says no and changes nothing."""
    free, hashes = list(bm.free_block_ids), dict(bm.hash_to_block)
    counts = [b.ref_count for b in bm.blocks]
    assert not admit(bm, seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert list(bm.free_block_ids) == free and bm.hash_to_block == hashes
    assert [b.ref_count for b in bm.blocks] == counts


def test_allocate_counts_free_cached_blocks_once():
    bm = BlockManager(3, BS)
    prompt = list(range(1, 10))  # 3 blocks, 2 of them full
    a = make_seq(prompt)
    assert admit(bm, a)
    compute(bm, a)
    release(bm, a)  # 3 free blocks, two of them cached

    # 4 blocks needed: 2 cached-and-free hits + 2 new = 4 > 3 free
    assert_refused(bm, make_seq(prompt[:8] + [0] * 5))
    # 3 blocks needed: 2 hits + 1 new fits in 3 free blocks
    fits = make_seq(prompt[:8] + [0])
    assert admit(bm, fits)
    assert fits.num_computed_tokens == 8 and bm.num_free_blocks == 0
    check_invariants(bm, [fits])


def test_allocate_hits_on_held_blocks_need_no_free_block():
    bm = BlockManager(4, BS)
    prompt = list(range(1, 10))
    a = make_seq(prompt)
    admit(bm, a)  # blocks 0..2, one free
    compute(bm, a)
    assert bm.num_free_blocks == 1
    assert_refused(bm, make_seq(prompt[:8] + [3] * 5))  # 4 blocks: 2 shared + 2 new > 1 free
    assert_refused(bm, make_seq([0] * 9))  # 3 new blocks > 1 free
    b = make_seq(prompt[:8] + [3])  # 3 blocks: 2 shared with the running a + 1 new
    assert admit(bm, b)
    assert bm.num_free_blocks == 0
    check_invariants(bm, [a, b])


def test_allocate_succeeds_exactly_when_the_blocks_fit_randomized():
    """allocate succeeds exactly when the blocks needed beyond the held hits fit in the
    free blocks, and changes nothing when it does not."""
    rng = random.Random(1)
    bm = BlockManager(12, BS)
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    live: list[Sequence] = []
    for _ in range(400):
        if live and rng.random() < 0.4:
            release(bm, live.pop(rng.randrange(len(live))))
        else:
            tokens = rng.choice(prefixes)[: rng.randrange(0, 9)] + [
                rng.randrange(50) for _ in range(rng.randrange(1, 10))
            ]
            s = make_seq(tokens)
            needed = bm.num_blocks_needed(len(s))
            hits = bm._cached_prefix(s)
            extra = needed - sum(1 for b in hits if bm.blocks[b].ref_count > 0)
            if extra > bm.num_free_blocks:
                assert_refused(bm, s)
            else:
                assert admit(bm, s)
                assert len(s.block_table) == needed
                compute(bm, s, upto=rng.randrange(s.num_computed_tokens, len(s) + 1))
                live.append(s)
        check_invariants(bm, live)


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(10, BS, enable_prefix_caching=False)
    prompt = list(range(1, 10))
    a = computed_seq(bm, prompt)
    assert bm.hash_to_block == {}
    assert all(bm.blocks[b].hash == -1 for b in a.block_table)
    b = make_seq(prompt)
    admit(bm, b)
    assert b.num_computed_tokens == b.num_cached_tokens == 0
    assert not set(a.block_table) & set(b.block_table)
    release(bm, a)
    c = make_seq(prompt)
    admit(bm, c)
    assert c.num_computed_tokens == 0
    check_invariants(bm, [b, c])


def test_allocate_twice_raises():
    bm = BlockManager(4, BS)
    a = make_seq([1, 2, 3])
    admit(bm, a)
    with pytest.raises(RuntimeError):
        admit(bm, a)


# ------------------------------------------------------------------------ decode slots


@pytest.mark.parametrize("block_size", [1, 2, 4, 8])
def test_decode_needs_ceil_len_over_block_size_blocks(block_size):
    """A sequence of length L computes position L-1 and needs ceil(L / block_size) blocks."""
    bm = BlockManager(64, block_size)
    s = make_seq([1])
    admit(bm, s)
    assert len(s.block_table) == 1
    for length in range(2, 5 * block_size + 2):
        s.num_computed_tokens = len(s)
        bm.commit_computed(s)
        s.token_ids.append(length)
        assert len(s) == length
        had = len(s.block_table)
        assert bm.make_room(s)
        expected = -(-length // block_size)
        assert len(s.block_table) == expected, (length, block_size)
        # a new block exactly when position L-1 starts one
        assert (len(s.block_table) - had) == (1 if (length - 1) % block_size == 0 else 0)
        assert (length - 1) // block_size < len(s.block_table)
    check_invariants(bm, [s])


def test_make_room_at_block_boundary_with_no_free_block():
    bm = BlockManager(2, BS)
    s = make_seq([1, 2, 3])
    other = make_seq([9])
    admit(bm, s)
    admit(bm, other)
    assert bm.num_free_blocks == 0
    compute(bm, s)
    s.token_ids.append(4)  # len 4: position 3 is still in block 0
    assert bm.make_room(s)
    assert len(s.block_table) == 1
    compute(bm, s)
    s.token_ids.append(5)  # len 5: position 4 needs block 1, none is free
    assert not bm.make_room(s)
    assert len(s.block_table) == 1
    release(bm, other)
    assert bm.make_room(s)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 0
    check_invariants(bm, [s])


def test_make_room_reuses_a_cached_free_block_and_drops_its_hash():
    bm = BlockManager(2, BS)
    a = computed_seq(bm, [1, 2, 3, 4, 5])
    h = bm.blocks[a.block_table[0]].hash
    release(bm, a)  # both free; block 0 cached (freed last, so reused last)
    s = make_seq([7, 7, 7])
    admit(bm, s)
    assert s.block_table == [1]
    compute(bm, s)
    s.token_ids.append(7)
    s.num_computed_tokens = 4
    bm.commit_computed(s)
    s.token_ids.append(8)
    bm.make_room(s)
    assert s.block_table == [1, 0]
    assert h not in bm.hash_to_block and bm.blocks[0].hash == -1
    check_invariants(bm, [s])


def test_free_resets_sequence_state():
    bm = BlockManager(8, BS)
    prompt = list(range(1, 10))
    a = computed_seq(bm, prompt)
    b = make_seq(prompt)
    admit(bm, b)
    assert b.num_cached_tokens == 8
    release(bm, b)
    assert b.block_table == [] and b.num_shared_blocks == 0
    assert b.num_computed_tokens == 0
    # it can be allocated again (preemption then readmission) and hits the same blocks
    admit(bm, b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    check_invariants(bm, [a, b])
