"""KV-cache blocks: allocation, reference counts and prefix caching. No torch here."""

import struct
from collections import OrderedDict

import xxhash

from nanovllm.scheduling.sequence import Sequence


def block_hash(token_ids: list[int], prev_hash: int) -> int:
    """Hash of a full block, chained on the previous block's hash (-1 for the first)."""
    data = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return xxhash.xxh3_64_intdigest(data, seed=(prev_hash + 1) & 0xFFFF_FFFF_FFFF_FFFF)


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "prev_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.prev_hash = -1  # with token_ids, verifies a hit on the whole prefix, not only the hash
        self.token_ids: list[int] = []


class BlockManager:
    """Hands out fixed-size KV blocks and shares full blocks between sequences.

    A block is hashed (and so becomes shareable) only once its KV has been computed. Freed
    blocks keep their hash and contents until they are handed out again, so a later
    sequence with the same prefix can still hit them; the least recently freed goes first.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        max_shared_prompt_len: int | None = None,
    ):
        """``max_shared_prompt_len``: a sequence whose prompt is longer neither takes cache hits
        nor registers its blocks (with dynamic rope scaling its keys depend on that length)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_shared_prompt_len = max_shared_prompt_len
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        # an ordered set: O(1) to take the oldest, to drop a cache hit, to put back a freed block
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != -1:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.prev_hash, block.token_ids = -1, -1, []
        block.ref_count = 1
        return block_id

    def shares_blocks(self, seq: Sequence) -> bool:
        """Whether ``seq``'s computed blocks go through the prefix cache, both ways."""
        limit = self.max_shared_prompt_len
        return self.enable_prefix_caching and (limit is None or seq.num_prompt_tokens <= limit)

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chained hashes of ``seq``'s first ``num_blocks`` full blocks, each computed once."""
        hashes, bs = seq.block_hashes, self.block_size
        for i in range(len(hashes), num_blocks):
            hashes.append(block_hash(seq.token_ids[i * bs : (i + 1) * bs], hashes[i - 1] if i else -1))
        return hashes

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq``, token ids verified. A sequence
        that asks for its prompt's log-probabilities, or that shares no blocks, computes the
        whole prompt."""
        if not self.hash_to_block or seq.params.prompt_logprobs is not None or not self.shares_blocks(seq):
            return []
        # a full-prompt hit would leave nothing to compute, so the last token is never a hit
        num_full = (len(seq) - 1) // self.block_size
        hashes, bs = self._block_hashes(seq, num_full), self.block_size
        hits, prev = [], -1
        for i in range(num_full):
            block_id = self.hash_to_block.get(hashes[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.prev_hash != prev or block.token_ids != seq.token_ids[i * bs : (i + 1) * bs]:
                break
            hits.append(block_id)
            prev = hashes[i]
        return hits

    def allocate(self, seq: Sequence) -> int | None:
        """Give ``seq`` blocks for all its tokens, reusing cached ones; returns how many of its
        tokens the reused blocks hold, or None, changing nothing, when too few blocks are free."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        hits = self._cached_prefix(seq)
        reused_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        new = self.num_blocks_needed(len(seq)) - len(hits)
        if new + reused_free > len(self.free_block_ids):
            return None
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = hits + [self._take_free_block() for _ in range(new)]
        seq.num_shared_blocks = len(hits)
        return len(hits) * self.block_size

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks nobody holds go back to the free list."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_shared_blocks = 0

    def release_all(self) -> None:
        """Drop every reference, whoever held it: all blocks are free again (cached ones keep
        their hash). What an interrupted step took is recovered too, recorded or not."""
        for block in self.blocks:
            if block.ref_count:
                block.ref_count = 0
                self.free_block_ids[block.block_id] = None

    def forget_cached(self) -> None:
        """Drop every block's hash: nothing cached may be hit again (the KV contents are gone,
        or the weights that computed them changed)."""
        self.hash_to_block.clear()
        for block in self.blocks:
            block.hash, block.prev_hash, block.token_ids = -1, -1, []

    def make_room(self, seq: Sequence, lookahead: int = 0) -> bool:
        """Make room for ``len(seq) + lookahead`` tokens (at most one new block); returns
        False when that needs a block and none is free."""
        if len(seq.block_table) * self.block_size >= len(seq.token_ids) + lookahead:
            return True
        if not self.free_block_ids:
            return False
        seq.block_table.append(self._take_free_block())
        return True

    def make_room_for_all(self, seqs: list[Sequence], lookahead: int = 0) -> bool:
        """:meth:`make_room` for each of ``seqs``, all or none: False, taking no block, when
        too few are free."""
        bs = self.block_size
        short = [s for s in seqs if len(s.block_table) * bs < len(s.token_ids) + lookahead]
        if len(short) > len(self.free_block_ids):
            return False
        for seq in short:
            seq.block_table.append(self._take_free_block())
        return True

    def commit_computed(self, seq: Sequence) -> None:
        """Register the blocks that became full of computed KV, making them shareable."""
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_shared_blocks or not self.shares_blocks(seq):
            return
        hashes, bs = self._block_hashes(seq, full), self.block_size
        for i in range(seq.num_shared_blocks, full):
            block = self.blocks[seq.block_table[i]]
            block.prev_hash = hashes[i - 1] if i else -1
            block.hash = hashes[i]
            block.token_ids = seq.token_ids[i * bs : (i + 1) * bs]
            self.hash_to_block.setdefault(block.hash, block.block_id)
        seq.num_shared_blocks = full
