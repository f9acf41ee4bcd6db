"""KV-cache blocks: allocation, reference counts and prefix caching. No torch here."""

import xxhash

from nanovllm.engine.sequence import Sequence


def block_hash(token_ids: list[int] | tuple[int, ...], prev_hash: int) -> int:
    """Hash of a full block, chained on the previous block's hash (-1 for the first)."""
    h = xxhash.xxh64()
    if prev_hash != -1:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids))
    return h.intdigest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "prev_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.prev_hash = -1  # with token_ids, verifies a hit on the whole prefix, not only the hash
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    """Hands out fixed-size KV blocks and shares full blocks between sequences.

    A block is hashed (and so becomes shareable) only once its KV has been computed. Freed
    blocks keep their hash and contents until they are handed out again, so a later
    sequence with the same prefix can still hit them; the least recently freed goes first.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        # dict as an insertion-ordered set: O(1) removal of a cache hit, FIFO reuse
        self.free_block_ids: dict[int, None] = dict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _take_free_block(self) -> Block:
        block_id = next(iter(self.free_block_ids))
        del self.free_block_ids[block_id]
        block = self.blocks[block_id]
        if block.hash != -1:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.prev_hash, block.token_ids = -1, -1, ()
        block.ref_count = 1
        return block

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq``, token ids verified."""
        if not self.enable_prefix_caching:
            return []
        hits, prev = [], -1
        # a full-prompt hit would leave nothing to compute, so the last token is never a hit
        for i in range((len(seq) - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(tokens, prev)
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.prev_hash != prev:
                break
            hits.append(block_id)
            prev = h
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._cached_prefix(seq)
        reused_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        new = self.num_blocks_needed(len(seq)) - len(hits)
        return new + reused_free <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens, reusing cached ones; sets its computed count."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        hits = self._cached_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = hits + [
            self._take_free_block().block_id for _ in range(self.num_blocks_needed(len(seq)) - len(hits))
        ]
        seq.num_hashed_blocks = len(hits)
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks nobody holds go back to the free list."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0

    def has_slot(self, seq: Sequence, lookahead: int = 0) -> bool:
        """Whether ``seq``'s blocks already hold ``num_tokens + lookahead`` tokens."""
        return len(seq.block_table) * self.block_size >= seq.num_tokens + lookahead

    def can_append(self, seq: Sequence) -> bool:
        """Whether the token about to be computed has a slot (a new block if needed)."""
        return self.has_slot(seq) or bool(self.free_block_ids)

    def append_slot(self, seq: Sequence, lookahead: int = 0) -> None:
        """Make room for ``num_tokens + lookahead`` tokens (at most one new block)."""
        if not self.has_slot(seq, lookahead):
            seq.block_table.append(self._take_free_block().block_id)

    def commit_computed(self, seq: Sequence) -> None:
        """Hash the blocks that became full of computed KV, making them shareable."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_hashed_blocks:
            return
        prev = self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].hash if seq.num_hashed_blocks else -1
        for i in range(seq.num_hashed_blocks, full):
            block = self.blocks[seq.block_table[i]]
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block.prev_hash, block.hash, block.token_ids = prev, block_hash(tokens, prev), tokens
            prev = block.hash
            self.hash_to_block.setdefault(prev, block.block_id)
        seq.num_hashed_blocks = full
