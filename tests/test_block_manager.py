"""BlockManager: reference counts, prefix caching (chained hashes, verified token ids),
eviction order, allocation accounting and decode-slot growth. Pure Python, no model.

Expectations are derived from the design: a block is shareable only once full of computed
KV, hashes chain on the previous block, freed blocks stay cached until handed out again
(least recently freed first), and the last token of a sequence is never a cache hit.
"""

import random

import pytest

import nanovllm.engine.block_manager as bm_module
from nanovllm.engine.block_manager import BlockManager, block_hash
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

BS = 4


def make_seq(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_tokens=8))


def compute(bm: BlockManager, seq: Sequence, upto: int | None = None) -> None:
    """Pretend the model computed KV for the first ``upto`` tokens (default: all)."""
    seq.num_computed_tokens = len(seq) if upto is None else upto
    bm.commit_computed(seq)


def holders(bm: BlockManager, seqs) -> dict[int, int]:
    count: dict[int, int] = {}
    for s in seqs:
        for b in s.block_table:
            count[b] = count.get(b, 0) + 1
    return count


def check_invariants(bm: BlockManager, live_seqs) -> None:
    """Reference counts equal holders; the free list is exactly the unheld blocks;
    the hash map only points at blocks carrying that hash and full token contents."""
    held = holders(bm, live_seqs)
    for block in bm.blocks:
        assert block.ref_count == held.get(block.block_id, 0), block.block_id
        assert (block.block_id in bm.free_block_ids) == (block.ref_count == 0)
    for s in live_seqs:
        assert len(set(s.block_table)) == len(s.block_table), "a sequence holds one block twice"
    for h, b in bm.hash_to_block.items():
        assert bm.blocks[b].hash == h
        assert len(bm.blocks[b].token_ids) == bm.block_size
    for b, n in held.items():
        if n > 1:  # sharing is only allowed for full, hashed blocks
            assert bm.blocks[b].hash != -1
            assert len(bm.blocks[b].token_ids) == bm.block_size


# ----------------------------------------------------------------------------- hashing


def test_block_hash_is_deterministic_and_content_sensitive():
    a = [1, 2, 3, 4]
    assert block_hash(a, -1) == block_hash(list(a), -1)
    assert block_hash(a, -1) == block_hash(tuple(a), -1)
    assert block_hash(a, 17) == block_hash(tuple(a), 17)
    assert block_hash(a, -1) != block_hash([1, 2, 3, 5], -1)
    assert block_hash(a, -1) != block_hash([4, 3, 2, 1], -1), "token order must matter"
    # large and negative-free ids round-trip distinctly
    assert block_hash([2**31 - 1] * 4, -1) != block_hash([2**31 - 2] * 4, -1)


def test_block_hash_chains_on_previous_block():
    first_a, first_b, second = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    ha, hb = block_hash(first_a, -1), block_hash(first_b, -1)
    assert ha != hb
    assert block_hash(second, ha) != block_hash(second, hb)
    assert block_hash(second, ha) != block_hash(second, -1)
    assert block_hash(second, ha) == block_hash(second, ha)


def test_same_block_after_different_prefixes_is_not_shared():
    bm = BlockManager(16, BS)
    common = [9, 9, 9, 9]
    x = make_seq([1, 2, 3, 4] + common + [0])
    y = make_seq([5, 6, 7, 8] + common + [0])
    for s in (x, y):
        bm.allocate(s)
        compute(bm, s)
    bx, by = bm.blocks[x.block_table[1]], bm.blocks[y.block_table[1]]
    assert bx.token_ids == by.token_ids == tuple(common)
    assert bx.hash != by.hash
    assert bx.hash == block_hash(common, bm.blocks[x.block_table[0]].hash)
    # a newcomer with y's prefix hits y's two blocks, never x's
    z = make_seq([5, 6, 7, 8] + common + [1, 2])
    bm.allocate(z)
    assert z.block_table[:2] == y.block_table[:2]
    assert x.block_table[1] not in z.block_table
    # a newcomer with a fresh first block but the common second block hits nothing
    w = make_seq([7, 7, 7, 7] + common + [1])
    bm.allocate(w)
    assert w.num_computed_tokens == 0
    assert not set(w.block_table) & set(x.block_table + y.block_table)
    check_invariants(bm, [x, y, z, w])


# ------------------------------------------------------------------ sharing / ref counts


def test_shared_prefix_reference_counts():
    bm = BlockManager(10, BS)
    prompt = list(range(100, 109))  # 2 full blocks + 1 token
    a = make_seq(prompt)
    bm.allocate(a)
    assert a.num_computed_tokens == 0 and len(a.block_table) == 3
    compute(bm, a)
    assert a.num_hashed_blocks == 2
    assert bm.num_free_blocks == 7

    b = make_seq(prompt[:8] + [7, 7, 7])  # same two full blocks, different tail
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert b.num_hashed_blocks == 2
    for blk in a.block_table[:2]:
        assert bm.blocks[blk].ref_count == 2
    assert bm.blocks[a.block_table[2]].ref_count == 1
    assert bm.num_free_blocks == 6  # only b's own tail block was taken
    check_invariants(bm, [a, b])

    bm.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    for blk in b.block_table[:2]:
        assert bm.blocks[blk].ref_count == 1
        assert blk not in bm.free_block_ids
    check_invariants(bm, [b])
    shared = b.block_table[:2]
    bm.free(b)
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
    bm.allocate(a)
    bm.allocate(b)  # a's prefill has not run yet: nothing to share
    assert b.num_computed_tokens == 0
    assert not set(a.block_table) & set(b.block_table)
    assert all(bm.blocks[x].hash == -1 for x in a.block_table)
    assert bm.hash_to_block == {}

    # partial progress (a prompt chunk): only blocks full of computed KV become shareable
    compute(bm, a, upto=6)
    assert a.num_hashed_blocks == 1
    assert bm.blocks[a.block_table[0]].hash != -1
    assert bm.blocks[a.block_table[1]].hash == -1
    c = make_seq(prompt)
    bm.allocate(c)
    assert c.num_computed_tokens == BS and c.block_table[0] == a.block_table[0]

    compute(bm, a, upto=13)
    assert a.num_hashed_blocks == 3
    d = make_seq(prompt)
    bm.allocate(d)
    assert d.num_computed_tokens == 12
    assert d.block_table[:3] == a.block_table[:3]
    check_invariants(bm, [a, b, c, d])


def test_commit_is_incremental_and_idempotent():
    bm = BlockManager(8, BS)
    a = make_seq(range(1, 10))
    bm.allocate(a)
    compute(bm, a, upto=4)
    h0 = bm.blocks[a.block_table[0]].hash
    compute(bm, a, upto=4)  # nothing new
    assert a.num_hashed_blocks == 1 and bm.blocks[a.block_table[0]].hash == h0
    compute(bm, a, upto=8)
    assert a.num_hashed_blocks == 2
    assert bm.blocks[a.block_table[0]].hash == h0
    assert bm.blocks[a.block_table[1]].hash == block_hash([5, 6, 7, 8], h0)
    assert h0 == block_hash([1, 2, 3, 4], -1)
    assert len(bm.hash_to_block) == 2


# --------------------------------------------------------------- free / reuse / eviction


def test_freed_blocks_are_hit_again():
    bm = BlockManager(6, BS)
    prompt = list(range(50, 59))
    a = make_seq(prompt)
    bm.allocate(a)
    compute(bm, a)
    old = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 6

    b = make_seq(prompt + [1, 2])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:2] == old[:2]
    assert b.num_cached_tokens == 8
    assert bm.num_free_blocks == 6 - 3
    for blk in b.block_table[:2]:
        assert blk not in bm.free_block_ids and bm.blocks[blk].ref_count == 1
    check_invariants(bm, [b])


def test_reused_block_with_stale_hash_no_longer_matches():
    bm = BlockManager(3, BS)
    prompt = list(range(10, 19))  # 3 blocks: everything
    a = make_seq(prompt)
    bm.allocate(a)
    compute(bm, a)
    hashes = [bm.blocks[b].hash for b in a.block_table[:2]]
    assert all(h in bm.hash_to_block for h in hashes)
    bm.free(a)

    # another prompt takes every block, including the two that still carry a's hashes
    other = make_seq(range(200, 212))
    bm.allocate(other)
    assert other.num_computed_tokens == 0
    assert sorted(other.block_table) == [0, 1, 2]
    for h in hashes:
        assert h not in bm.hash_to_block, "a handed-out block's old hash must be dropped"
    assert all(bm.blocks[b].hash == -1 for b in other.block_table)
    assert all(bm.blocks[b].token_ids == () for b in other.block_table)

    # other computes different KV into those blocks; a's prompt must not hit them
    compute(bm, other)
    bm.free(other)
    again = make_seq(prompt)
    bm.allocate(again)
    assert again.num_computed_tokens == 0 and again.num_cached_tokens == 0
    check_invariants(bm, [again])


def test_hash_collision_is_caught_by_token_verification(monkeypatch):
    # every block hashes alike: only the token check can tell blocks apart
    monkeypatch.setattr(bm_module, "block_hash", lambda tokens, prev: 12345)
    bm = BlockManager(12, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    bm.allocate(a)
    compute(bm, a)
    assert bm.hash_to_block == {12345: a.block_table[0]}

    b = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 0])  # different first block, same hash
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    assert not set(b.block_table) & set(a.block_table)

    c = make_seq([1, 2, 3, 4, 9, 9, 9, 9, 0])  # genuine first block, colliding second block
    bm.allocate(c)
    assert c.block_table[0] == a.block_table[0]
    assert c.num_computed_tokens == BS
    assert c.block_table[1] not in a.block_table
    check_invariants(bm, [a, b, c])


def test_chained_hash_collision_verifies_the_whole_prefix(monkeypatch):
    """A block's KV depends on every token before it. If the chained hash collides (here:
    a hash that ignores the previous block), a block with the right tokens but computed
    after a *different* prefix must not be reused: checking only the block's own tokens
    is not enough."""
    monkeypatch.setattr(bm_module, "block_hash", lambda tokens, prev: hash(tuple(tokens)) & (2**62 - 1))
    bm = BlockManager(16, BS)
    head_x, head_z, tail = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    x = make_seq(head_x + tail + [0])  # tail's KV computed after head_x
    z = make_seq(head_z + [3, 3, 3, 3] + [0])
    for s in (x, z):
        bm.allocate(s)
        compute(bm, s)
    w = make_seq(head_z + tail + [0])  # tail after head_z: never computed
    bm.allocate(w)
    assert w.block_table[0] == z.block_table[0]
    assert x.block_table[1] not in w.block_table, "reused KV computed after another prefix"
    assert w.num_computed_tokens == BS

    # the same hole in its most direct form: one cached block hit at two positions
    y = make_seq(head_x + head_x + [0])
    bm.allocate(y)
    assert len(set(y.block_table)) == len(y.block_table)
    assert y.num_computed_tokens == BS


def test_corrupted_hash_map_does_not_produce_a_wrong_hit():
    bm = BlockManager(12, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    z = make_seq([7, 7, 7, 7, 8, 8, 8, 8, 0])
    for s in (a, z):
        bm.allocate(s)
        compute(bm, s)
    # point a's second-block hash at z's second block (different tokens)
    h1 = bm.blocks[a.block_table[1]].hash
    bm.hash_to_block[h1] = z.block_table[1]
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 1, 1])
    bm.allocate(b)
    assert b.block_table[0] == a.block_table[0]
    assert b.num_computed_tokens == BS, "only the verified first block may hit"
    assert z.block_table[1] not in b.block_table


def test_eviction_takes_least_recently_freed_first():
    bm = BlockManager(6, BS)
    a = make_seq(range(1, 9))  # blocks 0, 1
    b = make_seq(range(11, 19))  # blocks 2, 3
    for s in (a, b):
        bm.allocate(s)
        compute(bm, s)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    assert a_blocks == [0, 1] and b_blocks == [2, 3]
    bm.free(a)
    bm.free(b)
    # never-used blocks first, then a's (freed earlier) before b's; within a sequence its
    # tail goes before its head, so a cached prefix outlives the blocks that extend it
    assert list(bm.free_block_ids) == [4, 5, 1, 0, 3, 2]

    c = make_seq(range(100, 112))  # 3 blocks: 4, 5 and a's tail
    bm.allocate(c)
    assert c.block_table == [4, 5, 1]
    # a's head is still cached, its tail is gone; b is fully cached
    ha = [bm.blocks[0].hash]
    assert ha[0] == block_hash(list(range(1, 5)), -1) and bm.hash_to_block[ha[0]] == 0
    assert block_hash(list(range(5, 9)), ha[0]) not in bm.hash_to_block
    b2 = make_seq(list(range(11, 19)) + [0])
    bm.allocate(b2)
    # b's blocks are hits; the one new block is the least recently freed: a's head
    assert b2.block_table == b_blocks + [0] and b2.num_computed_tokens == 2 * BS
    assert ha[0] not in bm.hash_to_block
    check_invariants(bm, [c, b2])


# -------------------------------------------------------------------- allocation rules


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_full_prefix_hit_still_leaves_the_last_token(block_size):
    bm = BlockManager(64, block_size)
    prompt = list(range(1, 2 * block_size + 1))  # exactly two full blocks
    a = make_seq(prompt)
    bm.allocate(a)
    compute(bm, a)
    assert a.num_hashed_blocks == 2
    b = make_seq(prompt)  # everything is cached
    bm.allocate(b)
    assert b.num_computed_tokens < len(b)
    # the largest whole-block prefix that leaves at least one token
    assert b.num_computed_tokens == ((len(prompt) - 1) // block_size) * block_size
    assert b.num_computed_tokens == b.num_cached_tokens
    assert len(b.block_table) == 2
    assert b.is_prefilling or b.num_computed_tokens == len(b) - 1
    check_invariants(bm, [a, b])


def test_single_token_prompt_never_hits():
    bm = BlockManager(4, 1)
    a = make_seq([5])
    bm.allocate(a)
    compute(bm, a)
    b = make_seq([5])
    bm.allocate(b)
    assert b.num_computed_tokens == 0


def test_can_allocate_counts_free_cached_blocks_once():
    bm = BlockManager(3, BS)
    prompt = list(range(1, 10))  # 3 blocks, 2 of them full
    a = make_seq(prompt)
    assert bm.can_allocate(a)
    bm.allocate(a)
    compute(bm, a)
    bm.free(a)  # 3 free blocks, two of them cached

    # 4 blocks needed: 2 cached-and-free hits + 2 new = 4 > 3 free
    too_big = make_seq(prompt[:8] + [0] * 5)
    assert not bm.can_allocate(too_big)
    # 3 blocks needed: 2 hits + 1 new fits in 3 free blocks
    fits = make_seq(prompt[:8] + [0])
    assert bm.can_allocate(fits)
    bm.allocate(fits)
    assert fits.num_computed_tokens == 8 and bm.num_free_blocks == 0
    check_invariants(bm, [fits])


def test_can_allocate_hits_on_held_blocks_need_no_free_block():
    bm = BlockManager(4, BS)
    prompt = list(range(1, 10))
    a = make_seq(prompt)
    bm.allocate(a)  # blocks 0..2, one free
    compute(bm, a)
    assert bm.num_free_blocks == 1
    b = make_seq(prompt[:8] + [3])  # 3 blocks: 2 shared with the running a + 1 new
    assert bm.can_allocate(b)
    c = make_seq(prompt[:8] + [3] * 5)  # 4 blocks: 2 shared + 2 new > 1 free
    assert not bm.can_allocate(c)
    no_hit = make_seq([0] * 9)  # 3 new blocks > 1 free
    assert not bm.can_allocate(no_hit)
    bm.allocate(b)
    assert bm.num_free_blocks == 0
    check_invariants(bm, [a, b])


def test_can_allocate_agrees_with_allocate_randomized():
    """Whenever can_allocate says yes, allocate succeeds; when it says no, the blocks needed
    beyond the held hits really exceed the free blocks."""
    rng = random.Random(1)
    bm = BlockManager(12, BS)
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    live: list[Sequence] = []
    for _ in range(400):
        if live and rng.random() < 0.4:
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            tokens = rng.choice(prefixes)[: rng.randrange(0, 9)] + [
                rng.randrange(50) for _ in range(rng.randrange(1, 10))
            ]
            s = make_seq(tokens)
            ok = bm.can_allocate(s)
            needed = bm.num_blocks_needed(len(s))
            hits = bm._cached_prefix(s)
            extra = needed - sum(1 for b in hits if bm.blocks[b].ref_count > 0)
            assert ok == (extra <= bm.num_free_blocks)
            if ok:
                bm.allocate(s)
                assert len(s.block_table) == needed
                compute(bm, s, upto=rng.randrange(s.num_computed_tokens, len(s) + 1))
                live.append(s)
        check_invariants(bm, live)


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(10, BS, enable_prefix_caching=False)
    prompt = list(range(1, 10))
    a = make_seq(prompt)
    bm.allocate(a)
    compute(bm, a)
    assert bm.hash_to_block == {}
    assert all(bm.blocks[b].hash == -1 for b in a.block_table)
    b = make_seq(prompt)
    bm.allocate(b)
    assert b.num_computed_tokens == b.num_cached_tokens == 0
    assert not set(a.block_table) & set(b.block_table)
    bm.free(a)
    c = make_seq(prompt)
    bm.allocate(c)
    assert c.num_computed_tokens == 0
    check_invariants(bm, [b, c])


def test_allocate_twice_raises():
    bm = BlockManager(4, BS)
    a = make_seq([1, 2, 3])
    bm.allocate(a)
    with pytest.raises(RuntimeError):
        bm.allocate(a)


# ------------------------------------------------------------------------ decode slots


@pytest.mark.parametrize("block_size", [1, 2, 4, 8])
def test_decode_needs_ceil_len_over_block_size_blocks(block_size):
    """A sequence of length L computes position L-1 and needs ceil(L / block_size) blocks."""
    bm = BlockManager(64, block_size)
    s = make_seq([1])
    bm.allocate(s)
    assert len(s.block_table) == 1
    for length in range(2, 5 * block_size + 2):
        s.num_computed_tokens = len(s)
        bm.commit_computed(s)
        s.append_token(length)
        assert len(s) == length
        had = len(s.block_table)
        assert bm.can_append(s)
        bm.append_slot(s)
        expected = -(-length // block_size)
        assert len(s.block_table) == expected, (length, block_size)
        # a new block exactly when position L-1 starts one
        assert (len(s.block_table) - had) == (1 if (length - 1) % block_size == 0 else 0)
        assert (length - 1) // block_size < len(s.block_table)
    check_invariants(bm, [s])


def test_can_append_at_block_boundary_with_no_free_block():
    bm = BlockManager(2, BS)
    s = make_seq([1, 2, 3])
    other = make_seq([9])
    bm.allocate(s)
    bm.allocate(other)
    assert bm.num_free_blocks == 0
    compute(bm, s)
    s.append_token(4)  # len 4: position 3 is still in block 0
    assert bm.can_append(s)
    bm.append_slot(s)
    assert len(s.block_table) == 1
    compute(bm, s)
    s.append_token(5)  # len 5: position 4 needs block 1, none is free
    assert not bm.can_append(s)
    bm.free(other)
    assert bm.can_append(s)
    bm.append_slot(s)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 0
    check_invariants(bm, [s])


def test_append_slot_reuses_a_cached_free_block_and_drops_its_hash():
    bm = BlockManager(2, BS)
    a = make_seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    compute(bm, a)
    h = bm.blocks[a.block_table[0]].hash
    bm.free(a)  # both free; block 0 cached (freed last, so reused last)
    s = make_seq([7, 7, 7])
    bm.allocate(s)
    assert s.block_table == [1]
    compute(bm, s)
    s.append_token(7)
    s.num_computed_tokens = 4
    bm.commit_computed(s)
    s.append_token(8)
    bm.append_slot(s)
    assert s.block_table == [1, 0]
    assert h not in bm.hash_to_block and bm.blocks[0].hash == -1
    check_invariants(bm, [s])


def test_free_resets_sequence_state():
    bm = BlockManager(8, BS)
    prompt = list(range(1, 10))
    a = make_seq(prompt)
    bm.allocate(a)
    compute(bm, a)
    b = make_seq(prompt)
    bm.allocate(b)
    assert b.num_cached_tokens == 8
    bm.free(b)
    assert b.block_table == [] and b.num_hashed_blocks == 0
    assert b.num_computed_tokens == 0
    # it can be allocated again (preemption then readmission) and hits the same blocks
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    check_invariants(bm, [a, b])
