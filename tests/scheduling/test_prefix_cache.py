"""Prefix caching: chained hashes, verified token ids, reuse after free, eviction order.

Freed blocks stay cached until handed out again (least recently freed first); a hit is
trusted only when the tokens and the whole prefix match, not the hash alone.
"""

import nanovllm.scheduling.block_manager as bm_module
from nanovllm.scheduling.block_manager import BlockManager, block_hash
from tests.scheduling.helpers import BS, admit, check_invariants, compute, computed_seq, make_seq, release

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
        admit(bm, s)
        compute(bm, s)
    bx, by = bm.blocks[x.block_table[1]], bm.blocks[y.block_table[1]]
    assert bx.token_ids == by.token_ids == common
    assert bx.hash != by.hash
    assert bx.hash == block_hash(common, bm.blocks[x.block_table[0]].hash)
    # a newcomer with y's prefix hits y's two blocks, never x's
    z = make_seq([5, 6, 7, 8] + common + [1, 2])
    admit(bm, z)
    assert z.block_table[:2] == y.block_table[:2]
    assert x.block_table[1] not in z.block_table
    # a newcomer with a fresh first block but the common second block hits nothing
    w = make_seq([7, 7, 7, 7] + common + [1])
    admit(bm, w)
    assert w.num_computed_tokens == 0
    assert not set(w.block_table) & set(x.block_table + y.block_table)
    check_invariants(bm, [x, y, z, w])


def test_prompts_past_the_shared_length_neither_hit_nor_register():
    """With dynamic rope scaling a prompt longer than the original context is rotated by its
    own length: its KV is no other prompt's."""
    bm = BlockManager(16, BS, max_shared_prompt_len=8)
    long = computed_seq(bm, range(1, 11))
    assert not bm.hash_to_block and long.num_shared_blocks == 0
    short = computed_seq(bm, range(1, 9))  # within the limit: registers its two blocks
    assert len(bm.hash_to_block) == 2
    longer = make_seq(range(1, 12))
    admit(bm, longer)
    assert longer.num_computed_tokens == 0 and not set(longer.block_table) & set(short.block_table)
    shorter = make_seq(range(1, 8))
    admit(bm, shorter)
    assert shorter.block_table[0] == short.block_table[0] and shorter.num_cached_tokens == BS
    check_invariants(bm, [long, short, longer, shorter])


# --------------------------------------------------------------- free / reuse / eviction


def test_freed_blocks_are_hit_again():
    bm = BlockManager(6, BS)
    prompt = list(range(50, 59))
    a = computed_seq(bm, prompt)
    old = list(a.block_table)
    release(bm, a)
    assert bm.num_free_blocks == 6

    b = make_seq(prompt + [1, 2])
    assert admit(bm, b)
    assert b.block_table[:2] == old[:2]
    assert b.num_cached_tokens == 8
    assert bm.num_free_blocks == 6 - 3
    for blk in b.block_table[:2]:
        assert blk not in bm.free_block_ids and bm.blocks[blk].ref_count == 1
    check_invariants(bm, [b])


def test_reused_block_with_stale_hash_no_longer_matches():
    bm = BlockManager(3, BS)
    prompt = list(range(10, 19))  # 3 blocks: everything
    a = computed_seq(bm, prompt)
    hashes = [bm.blocks[b].hash for b in a.block_table[:2]]
    assert all(h in bm.hash_to_block for h in hashes)
    release(bm, a)

    # another prompt takes every block, including the two that still carry a's hashes
    other = make_seq(range(200, 212))
    admit(bm, other)
    assert other.num_computed_tokens == 0
    assert sorted(other.block_table) == [0, 1, 2]
    for h in hashes:
        assert h not in bm.hash_to_block, "a handed-out block's old hash must be dropped"
    assert all(bm.blocks[b].hash == -1 for b in other.block_table)
    assert all(bm.blocks[b].token_ids == [] for b in other.block_table)

    # other computes different KV into those blocks; a's prompt must not hit them
    compute(bm, other)
    release(bm, other)
    again = make_seq(prompt)
    admit(bm, again)
    assert again.num_computed_tokens == 0 and again.num_cached_tokens == 0
    check_invariants(bm, [again])


def test_hash_collision_is_caught_by_token_verification(monkeypatch):
    # every block hashes alike: only the token check can tell blocks apart
    monkeypatch.setattr(bm_module, "block_hash", lambda tokens, prev: 12345)
    bm = BlockManager(12, BS)
    a = computed_seq(bm, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert bm.hash_to_block == {12345: a.block_table[0]}

    b = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 0])  # different first block, same hash
    admit(bm, b)
    assert b.num_computed_tokens == 0
    assert not set(b.block_table) & set(a.block_table)

    c = make_seq([1, 2, 3, 4, 9, 9, 9, 9, 0])  # genuine first block, colliding second block
    admit(bm, c)
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
        admit(bm, s)
        compute(bm, s)
    w = make_seq(head_z + tail + [0])  # tail after head_z: never computed
    admit(bm, w)
    assert w.block_table[0] == z.block_table[0]
    assert x.block_table[1] not in w.block_table, "reused KV computed after another prefix"
    assert w.num_computed_tokens == BS

    # the same hole in its most direct form: one cached block hit at two positions
    y = make_seq(head_x + head_x + [0])
    admit(bm, y)
    assert len(set(y.block_table)) == len(y.block_table)
    assert y.num_computed_tokens == BS


def test_corrupted_hash_map_does_not_produce_a_wrong_hit():
    bm = BlockManager(12, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    z = make_seq([7, 7, 7, 7, 8, 8, 8, 8, 0])
    for s in (a, z):
        admit(bm, s)
        compute(bm, s)
    # point a's second-block hash at z's second block (different tokens)
    h1 = bm.blocks[a.block_table[1]].hash
    bm.hash_to_block[h1] = z.block_table[1]
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 1, 1])
    admit(bm, b)
    assert b.block_table[0] == a.block_table[0]
    assert b.num_computed_tokens == BS, "only the verified first block may hit"
    assert z.block_table[1] not in b.block_table


def test_eviction_takes_least_recently_freed_first():
    bm = BlockManager(6, BS)
    a = make_seq(range(1, 9))  # blocks 0, 1
    b = make_seq(range(11, 19))  # blocks 2, 3
    for s in (a, b):
        admit(bm, s)
        compute(bm, s)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    assert a_blocks == [0, 1] and b_blocks == [2, 3]
    release(bm, a)
    release(bm, b)
    # never-used blocks first, then a's (freed earlier) before b's; within a sequence its
    # tail goes before its head, so a cached prefix outlives the blocks that extend it
    assert list(bm.free_block_ids) == [4, 5, 1, 0, 3, 2]

    c = make_seq(range(100, 112))  # 3 blocks: 4, 5 and a's tail
    admit(bm, c)
    assert c.block_table == [4, 5, 1]
    # a's head is still cached, its tail is gone; b is fully cached
    ha = [bm.blocks[0].hash]
    assert ha[0] == block_hash(list(range(1, 5)), -1) and bm.hash_to_block[ha[0]] == 0
    assert block_hash(list(range(5, 9)), ha[0]) not in bm.hash_to_block
    b2 = make_seq(list(range(11, 19)) + [0])
    admit(bm, b2)
    # b's blocks are hits; the one new block is the least recently freed: a's head
    assert b2.block_table == b_blocks + [0] and b2.num_computed_tokens == 2 * BS
    assert ha[0] not in bm.hash_to_block
    check_invariants(bm, [c, b2])
