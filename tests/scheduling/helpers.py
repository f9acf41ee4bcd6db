"""Helpers for the BlockManager tests: sequences, fake KV computation, invariants."""

from itertools import count

from nanovllm.sampling_params import SamplingParams
from nanovllm.scheduling.block_manager import BlockManager
from nanovllm.scheduling.sequence import Sequence

BS = 4
_seq_ids = count()


def make_seq(tokens) -> Sequence:
    return Sequence(next(_seq_ids), list(tokens), SamplingParams(max_tokens=8))


def admit(bm: BlockManager, seq: Sequence) -> bool:
    """Allocate ``seq``'s blocks as the scheduler does (its computed count starts at its cache
    hits); False when they do not fit."""
    num_cached = bm.allocate(seq)
    if num_cached is None:
        return False
    seq.num_cached_tokens = seq.num_computed_tokens = num_cached
    return True


def release(bm: BlockManager, seq: Sequence) -> None:
    """Free ``seq``'s blocks as the scheduler does."""
    bm.free(seq)
    seq.num_computed_tokens = 0


def computed_seq(bm: BlockManager, tokens) -> Sequence:
    """A sequence allocated in ``bm`` with KV computed for all its tokens."""
    seq = make_seq(tokens)
    admit(bm, seq)
    compute(bm, seq)
    return seq


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
