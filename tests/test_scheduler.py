"""Scheduler over a real BlockManager, driven by a fake model. Pure Python, no torch.

The fake model's next token is a fixed function of the whole context, so the expected
completion of every request is known without the scheduler; a fake KV cache records, for
every slot, a fingerprint of the context its KV was computed from, and every step checks
that a sequence only ever reads KV of its own prefix (prefix hits, preemption and chunking
included) and only writes into blocks nobody else holds.
"""

import contextlib
import random
import signal

import pytest

from nanovllm.engine.batch import StepBatch
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

VOCAB = 1000
DUMMY = -12345  # what the "model" returns for a prompt chunk; must never be appended


def fingerprints(tokens: list[int]) -> list[int]:
    """fingerprints(t)[p] identifies the context t[:p+1] (what position p's KV depends on)."""
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


def model(tokens: list[int]) -> int:
    """The fake model: next token as a fixed function of the full context."""
    h = 7
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % (2**61 - 1)
    return h % VOCAB


def expected_completion(prompt: list[int], max_tokens: int, max_model_len: int, stop=()) -> list[int]:
    tokens, out = list(prompt), []
    while True:
        t = model(tokens)
        tokens.append(t)
        out.append(t)
        if t in stop or len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail instead of hanging when the code under test spins."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: the scheduler spins")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Harness:
    """A Scheduler + BlockManager pair with a fake model and fake, checked KV cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 1024,
        max_model_len: int = 1024,
        eos: tuple[int, ...] = (),
        prefix_caching: bool = True,
    ) -> None:
        self.bs = block_size
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.sched = Scheduler(self.bm, max_num_seqs, max_num_batched_tokens, max_model_len, list(eos))
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.seqs: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.num_steps = 0
        self.prefix_hit_tokens = 0
        self.preempted_ids: set[int] = set()
        self.readmitted_with_hit = 0

    def add(self, tokens, **params) -> Sequence:
        seq = Sequence(list(tokens), SamplingParams(**params))
        self.sched.add(seq)
        self.seqs.append(seq)
        return seq

    def step(self, tokens_for=None) -> tuple[list[Sequence], bool, list[Sequence]]:
        """One engine step; ``tokens_for(seq)`` overrides the fake model's token."""
        waiting_before = {s.seq_id for s in self.sched.waiting}
        running_before = {s.seq_id for s in self.sched.running}
        seqs, is_prefill = self.sched.schedule()
        self.num_steps += 1
        for s in self.seqs:
            if s.seq_id in running_before and s.status == SequenceStatus.WAITING:
                self.preempted_ids.add(s.seq_id)
        for s in seqs:
            if s.seq_id in waiting_before:
                self.prefix_hit_tokens += s.num_cached_tokens
                if s.seq_id in self.preempted_ids and s.num_cached_tokens:
                    self.readmitted_with_hit += 1
        self.check(seqs, is_prefill)
        tokens = [self.compute(s) for s in seqs]
        if tokens_for is not None:
            tokens = [tokens_for(s) if t != DUMMY else t for s, t in zip(seqs, tokens)]
        finished = self.sched.postprocess(seqs, tokens, is_prefill)
        self.finished.extend(finished)
        for s in seqs:
            assert s.num_scheduled_tokens == 0
        self.check_blocks()
        return seqs, is_prefill, finished

    def run(self, max_steps: int = 20_000) -> None:
        with deadline(30):
            while not self.sched.is_finished():
                assert self.num_steps < max_steps, "the scheduler does not terminate"
                self.step()

    # ---------------------------------------------------------------- fake execution

    def compute(self, seq: Sequence) -> int:
        start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
        fps = fingerprints(seq.token_ids)
        for p in range(start):  # attention reads every earlier position
            blk = seq.block_table[p // self.bs]
            assert self.kv[blk][p % self.bs] == fps[p], (
                f"seq {seq.seq_id} reads wrong KV at position {p} (block {blk})"
            )
        for p in range(start, start + n):
            blk = seq.block_table[p // self.bs]
            assert self.bm.blocks[blk].ref_count == 1, f"write into shared block {blk}"
            self.kv[blk][p % self.bs] = fps[p]
        end = start + n
        return model(seq.token_ids[:end]) if end == len(seq) else DUMMY

    # ---------------------------------------------------------------------- checks

    def check(self, seqs: list[Sequence], is_prefill: bool) -> None:
        sched = self.sched
        ids = [s.seq_id for s in seqs]
        assert len(set(ids)) == len(ids)
        running = {s.seq_id for s in sched.running}
        waiting = {s.seq_id for s in sched.waiting}
        done = {s.seq_id for s in self.finished}
        assert not running & waiting and not running & done and not waiting & done
        assert running | waiting | done == {s.seq_id for s in self.seqs}, "a sequence was lost"
        assert len(sched.running) <= sched.max_num_seqs
        assert set(ids) <= running
        for s in sched.running:
            assert s.status == SequenceStatus.RUNNING
            if s.seq_id not in ids:
                assert s.num_scheduled_tokens == 0
        for s in sched.waiting:
            assert s.status == SequenceStatus.WAITING and s.block_table == []
        if is_prefill:
            assert sum(s.num_scheduled_tokens for s in seqs) <= sched.max_num_batched_tokens
        else:
            assert len(seqs) <= sched.max_num_seqs
        for s in seqs:
            assert s.num_scheduled_tokens >= 1
            end = s.num_computed_tokens + s.num_scheduled_tokens
            assert end <= len(s)
            if not is_prefill:
                assert s.num_scheduled_tokens == 1 and s.num_computed_tokens == len(s) - 1
            assert len(s.block_table) == cdiv(len(s), self.bs)
        self.check_blocks()

    def check_blocks(self) -> None:
        bm = self.bm
        where: dict[int, list[tuple[Sequence, int]]] = {}
        for s in self.sched.running:
            assert len(set(s.block_table)) == len(s.block_table)
            for i, b in enumerate(s.block_table):
                where.setdefault(b, []).append((s, i))
        for block in bm.blocks:
            holders = where.get(block.block_id, [])
            assert block.ref_count == len(holders), f"block {block.block_id}"
            assert (block.block_id in bm.free_block_ids) == (not holders)
            if len(holders) > 1:  # only a full, hashed, computed block may be shared
                assert block.hash != -1 and len(block.token_ids) == self.bs
                assert len({i for _, i in holders}) == 1, "shared block at different positions"
                for s, i in holders:
                    assert tuple(s.token_ids[i * self.bs : (i + 1) * self.bs]) == block.token_ids
                    assert (i + 1) * self.bs <= s.num_computed_tokens + s.num_scheduled_tokens

    def check_done(self, max_model_len: int | None = None) -> None:
        assert self.sched.is_finished()
        assert len(self.finished) == len(self.seqs)
        mml = max_model_len or self.sched.max_model_len
        for s in self.seqs:
            assert s.is_finished
            prompt = s.token_ids[: s.num_prompt_tokens]
            want = expected_completion(prompt, s.params.max_tokens, mml, s.params.stop_token_ids)
            assert s.completion_token_ids == want, f"seq {s.seq_id}"
        assert self.bm.num_free_blocks == len(self.bm.blocks)
        assert all(b.ref_count == 0 for b in self.bm.blocks)


# =============================================================== budgets and batching


def test_max_num_seqs_not_multiple_of_16():
    h = Harness(num_blocks=100, block_size=4, max_num_seqs=7)
    seqs = [h.add([i + 1] * 3, max_tokens=4) for i in range(10)]
    batch, is_prefill, _ = h.step()
    assert is_prefill and batch == seqs[:7]
    assert list(h.sched.waiting) == seqs[7:]
    batch, is_prefill, _ = h.step()
    assert not is_prefill and batch == seqs[:7]  # running is full: nothing more admitted
    sizes = []
    while not h.sched.is_finished():
        batch, _, _ = h.step()
        sizes.append(len(batch))
    assert max(sizes) == 7
    h.check_done()


def test_token_budget_chunks_the_prompt_that_does_not_fit():
    h = Harness(num_blocks=100, block_size=4, max_num_batched_tokens=25)
    a, b, c, d = (h.add([k] * 10, max_tokens=3) for k in (1, 2, 3, 4))
    batch, is_prefill, _ = h.step()
    assert is_prefill and batch == [a, b, c]
    assert [len(s) for s in (a, b, c)] == [11, 11, 10]  # c got only a 5-token chunk
    assert c.num_computed_tokens == 5 and c.completion_token_ids == []
    assert d.status == SequenceStatus.WAITING
    # next prefill: c's remaining 5 tokens first, then d (10) within 25
    batch, is_prefill, _ = h.step()
    assert is_prefill and batch == [c, d]
    assert c.num_computed_tokens == 10 and len(c.completion_token_ids) == 1
    assert d.num_computed_tokens == 10
    h.run()
    h.check_done()


def test_chunked_prefill_advances_by_the_chunk_and_samples_once():
    h = Harness(num_blocks=100, block_size=4, max_num_batched_tokens=16)
    prompt = [(7 * i) % 97 for i in range(50)]
    s = h.add(prompt, max_tokens=3)
    chunks = []
    while s.num_computed_tokens < 50:
        before = s.num_computed_tokens
        batch, is_prefill, _ = h.step(tokens_for=lambda _: 999)
        assert batch == [s] and is_prefill
        chunks.append(s.num_computed_tokens - before)
        if s.num_computed_tokens < 50:
            assert len(s) == 50, "a prompt chunk must not sample a token"
    assert chunks == [16, 16, 16, 2]
    assert s.completion_token_ids == [999]
    h.run()
    assert s.completion_token_ids[0] == 999 and len(s.completion_token_ids) == 3


def test_step_batch_covers_exactly_the_chunk():
    h = Harness(num_blocks=100, block_size=4, max_num_batched_tokens=6)
    prompt = list(range(1, 15))
    s = h.add(prompt, max_tokens=2)
    seen = []
    while s.num_computed_tokens < len(prompt):
        batch, is_prefill = h.sched.schedule()
        sb = StepBatch.from_sequences(batch, is_prefill)
        start = s.num_computed_tokens
        assert sb.start_positions == [start]
        assert sb.token_ids == [prompt[start : start + s.num_scheduled_tokens]]
        seen.extend(sb.token_ids[0])
        h.sched.postprocess(batch, [DUMMY if start + s.num_scheduled_tokens < 14 else 5], is_prefill)
    assert seen == prompt  # every prompt token computed once, in order, keys end at the chunk


def test_chunk_ending_just_before_the_last_prompt_token():
    """Prompt 17, budget 16: after the chunk only the last token lacks KV, which the next
    (decode) step computes at position 16 and samples from."""
    h = Harness(num_blocks=100, block_size=4, max_num_batched_tokens=16)
    s = h.add(list(range(1, 18)), max_tokens=2)
    batch, is_prefill, _ = h.step()
    assert is_prefill and s.num_computed_tokens == 16 and len(s) == 17
    batch, is_prefill = h.sched.schedule()
    assert batch == [s] and s.num_scheduled_tokens == 1
    sb = StepBatch.from_sequences(batch, is_prefill)
    assert sb.start_positions == [16]
    assert sb.token_ids == [[17]]
    h.compute(s)
    h.sched.postprocess(batch, [model(s.token_ids)], is_prefill)
    assert len(s.completion_token_ids) == 1
    h.run()
    h.check_done()


def test_prefill_goes_before_decode():
    h = Harness(num_blocks=100, block_size=4)
    a = h.add([1, 2, 3], max_tokens=10)
    h.step()
    assert len(a) == 4
    b = h.add([4, 5, 6, 7, 8], max_tokens=10)
    batch, is_prefill, _ = h.step()
    assert is_prefill and batch == [b]
    assert len(a) == 4, "the decode-ready sequence waits while a prefill runs"
    batch, is_prefill, _ = h.step()
    assert not is_prefill and batch == [a, b]
    h.run()
    h.check_done()


def test_decode_positions_are_zero_based_and_blocks_grow_at_boundaries():
    h = Harness(num_blocks=100, block_size=4)
    s = h.add([1, 2, 3], max_tokens=10)
    h.step()  # prefill 3 tokens, sample 1 -> len 4
    for _ in range(7):
        length = len(s)
        batch, is_prefill = h.sched.schedule()
        assert not is_prefill and batch == [s]
        sb = StepBatch.from_sequences(batch, is_prefill)
        assert sb.start_positions == [length - 1]  # positions are 0-based
        assert sb.token_ids == [[s.token_ids[-1]]]
        assert len(s.block_table) == cdiv(length, 4)
        h.compute(s)
        h.sched.postprocess(batch, [model(s.token_ids)], is_prefill)
    h.run()
    h.check_done()


# ======================================================================== preemption


def test_preemption_victim_is_newest_and_it_later_hits_its_own_blocks():
    h = Harness(num_blocks=5, block_size=4)
    a = h.add([1, 2, 3, 4], max_tokens=6)  # len 5 after prefill: needs a 2nd block to decode
    b = h.add([5, 6], max_tokens=2)  # finishes after one decode step
    c = h.add(list(range(10, 19)), max_tokens=4)  # 9 tokens: 2 full blocks + 1
    d = h.add([7, 7, 7, 7], max_tokens=2)  # does not fit at first
    batch, is_prefill, _ = h.step()
    assert is_prefill and batch == [a, b, c] and h.bm.num_free_blocks == 0
    c_blocks = list(c.block_table)
    assert c.num_hashed_blocks == 2

    batch, is_prefill, finished = h.step()  # a needs a block: the newest running (c) goes
    assert not is_prefill and batch == [a, b]
    assert h.sched.num_preemptions == 1
    assert c.status == SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert list(h.sched.waiting) == [c, d], "the victim goes to the front of the queue"
    assert len(c) == 10 and len(c.completion_token_ids) == 1, "generated tokens are kept"
    assert finished == [b]

    batch, is_prefill, _ = h.step()  # c comes back first and hits its own cached blocks
    assert is_prefill and batch == [c]
    assert c.block_table[:2] == c_blocks[:2]
    assert c.num_cached_tokens == 8
    assert len(c.completion_token_ids) == 2
    h.run()
    h.check_done()


def test_several_victims_keep_their_order_at_the_front_of_waiting():
    h = Harness(num_blocks=4, block_size=4)
    a = h.add([1, 2, 3, 4], max_tokens=3)
    b = h.add([5, 6, 7, 8], max_tokens=3)
    c = h.add([9, 9], max_tokens=3)
    d = h.add([8, 8], max_tokens=3)
    e = h.add([6, 6, 6, 6], max_tokens=3)
    batch, is_prefill, _ = h.step()
    assert batch == [a, b, c, d] and list(h.sched.waiting) == [e]
    batch, is_prefill, _ = h.step()  # a and b both cross a block boundary; d then c are evicted
    assert not is_prefill and batch == [a, b]
    assert h.sched.num_preemptions == 2
    assert list(h.sched.waiting) == [c, d, e]
    assert list(h.sched.running) == [a, b]
    h.run()
    h.check_done()


def test_preempting_a_sequence_that_shares_a_prefix_keeps_the_shared_blocks():
    h = Harness(num_blocks=6, block_size=2)
    a = h.add([1, 2, 3, 4, 5], max_tokens=6)
    h.step()  # a prefilled: blocks 0 and 1 are full and hashed
    b = h.add([1, 2, 3, 4, 9], max_tokens=6)
    batch, is_prefill, _ = h.step()
    assert is_prefill and batch == [b] and b.num_cached_tokens == 4
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared and all(h.bm.blocks[x].ref_count == 2 for x in shared)
    while h.sched.num_preemptions == 0:
        b_old = list(b.block_table)
        h.step()
    assert len(b_old) == 4 and b.num_tokens == 9  # b computed 8 tokens: 4 full hashed blocks
    # a ran out of blocks; b (the newest) was preempted, dropping only its references
    assert b.status == SequenceStatus.WAITING and b.block_table == []
    assert a.status == SequenceStatus.RUNNING and a.block_table[:2] == shared
    assert a.block_table[-1] == b_old[3], "the least recently freed block (b's tail) is reused first"
    for x in shared:
        assert h.bm.blocks[x].ref_count == 1 and h.bm.blocks[x].hash != -1
        assert x not in h.bm.free_block_ids
    while b.status == SequenceStatus.WAITING:
        batch, is_prefill, _ = h.step()
    assert is_prefill and b in batch
    # b's tail block went first (to a), so b hits the shared prefix plus its own third block
    assert b.block_table[:3] == b_old[:3] and b.num_cached_tokens == 6
    h.run()
    h.check_done()


def test_lone_sequence_that_cannot_get_a_block_terminates():
    h = Harness(num_blocks=2, block_size=4, max_model_len=64)
    s = h.add(list(range(1, 9)), max_tokens=5)  # 2 blocks; decoding needs a 3rd
    raised = None
    with deadline(5):
        for _ in range(50):
            if h.sched.is_finished():
                break
            try:
                h.step()
            except RuntimeError as e:
                raised = e
                break
        else:
            pytest.fail("the scheduler keeps stepping a sequence that can never get a block")
    assert raised is not None or s.is_finished
    if raised is not None:  # nothing leaked: the sequence is back in waiting without blocks
        assert "KV" in str(raised) or "block" in str(raised)
        assert list(h.sched.waiting) == [s] and s.block_table == []
        assert h.bm.num_free_blocks == 2
    else:
        assert h.bm.num_free_blocks == 2


def test_prompt_larger_than_the_cache_raises_instead_of_spinning():
    h = Harness(num_blocks=2, block_size=4)
    h.add(list(range(1, 10)), max_tokens=1)  # needs 3 blocks
    with deadline(5), pytest.raises(RuntimeError):
        h.sched.schedule()
    assert h.bm.num_free_blocks == 2


# ====================================================================== prefix caching


def test_resubmitted_prompt_hits_cache_and_computes_last_token():
    h = Harness(num_blocks=32, block_size=4)
    prompt = list(range(1, 13))  # 3 full blocks
    a = h.add(prompt, max_tokens=2)
    h.run()
    b = h.add(prompt, max_tokens=2)
    batch, is_prefill, _ = h.step()
    assert is_prefill and batch == [b]
    assert b.num_cached_tokens == 8  # 100% cached, yet the last block is computed
    assert len(b.completion_token_ids) == 1
    h.run()
    h.check_done()
    assert a.completion_token_ids == b.completion_token_ids


def test_identical_prompts_in_one_step_do_not_share_uncomputed_blocks():
    h = Harness(num_blocks=32, block_size=4)
    a = h.add(list(range(1, 10)), max_tokens=3)
    b = h.add(list(range(1, 10)), max_tokens=3)
    batch, _, _ = h.step()
    assert batch == [a, b]
    assert not set(a.block_table) & set(b.block_table)
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    h.run()
    h.check_done()


def test_chunked_prompt_blocks_become_shareable_between_chunks():
    h = Harness(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    prompt = list(range(1, 30))
    a = h.add(prompt, max_tokens=2)
    h.step()  # a computes 8 tokens: 2 full blocks
    b = h.add(prompt, max_tokens=2)
    for _ in range(2):
        batch, _, _ = h.step()  # a continues first and uses the whole budget
        assert batch == [a]
    assert a.num_computed_tokens == 24
    batch, _, _ = h.step()  # a's last 5 tokens, then b with the 3 left: 6 blocks cached
    assert batch == [a, b]
    assert b.num_cached_tokens == 24 and b.num_computed_tokens == 27
    h.run()
    h.check_done()


# =================================================================== stop conditions


def test_eos_stops_and_is_kept():
    h = Harness(num_blocks=16, block_size=4, eos=(7, 9))
    s = h.add([1, 2, 3], max_tokens=10)
    feed = iter([3, 9])
    while not h.sched.is_finished():
        h.step(tokens_for=lambda _: next(feed))
    assert s.completion_token_ids == [3, 9] and s.finish_reason == "stop"
    assert h.bm.num_free_blocks == 16


def test_every_eos_id_stops():
    for eos_tok in (7, 9):
        h = Harness(num_blocks=16, block_size=4, eos=(7, 9))
        s = h.add([1, 2, 3], max_tokens=10)
        h.step(tokens_for=lambda _, t=eos_tok: t)
        assert s.is_finished and s.completion_token_ids == [eos_tok]


def test_ignore_eos_runs_to_max_tokens():
    h = Harness(num_blocks=16, block_size=4, eos=(7,))
    s = h.add([1, 2, 3], max_tokens=5, ignore_eos=True)
    while not h.sched.is_finished():
        h.step(tokens_for=lambda _: 7)
    assert s.completion_token_ids == [7] * 5 and s.finish_reason == "length"


def test_stop_token_ids_stop_even_with_ignore_eos():
    h = Harness(num_blocks=16, block_size=4, eos=(7,))
    s = h.add([1, 2, 3], max_tokens=10, ignore_eos=True, stop_token_ids=[42])
    feed = iter([7, 5, 42, 1])
    while not h.sched.is_finished():
        h.step(tokens_for=lambda _: next(feed))
    assert s.completion_token_ids == [7, 5, 42] and s.finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 9])
def test_max_tokens_exact(max_tokens):
    h = Harness(num_blocks=16, block_size=4)
    s = h.add([1, 2, 3], max_tokens=max_tokens)
    h.run()
    assert len(s.completion_token_ids) == max_tokens and s.finish_reason == "length"
    h.check_done()


def test_max_model_len_caps_total_length():
    h = Harness(num_blocks=16, block_size=4, max_model_len=8)
    s = h.add([1, 2, 3, 4, 5], max_tokens=100)
    h.run()
    assert len(s) == 8 and len(s.completion_token_ids) == 3 and s.finish_reason == "length"
    h.check_done()


@pytest.mark.parametrize("max_model_len", [1, 8, 9])
def test_prompt_of_exactly_max_model_len_gets_one_token(max_model_len):
    h = Harness(num_blocks=8, block_size=4, max_model_len=max_model_len)
    s = h.add(list(range(1, max_model_len + 1)), max_tokens=50)
    batch, is_prefill, finished = h.step()
    assert finished == [s] and len(s.completion_token_ids) == 1
    assert s.finish_reason == "length"
    assert h.sched.is_finished() and h.bm.num_free_blocks == 8


# ====================================================================== full loops


def _workload(rng: random.Random, n: int, max_prompt: int, max_new: int) -> list[tuple[list[int], int]]:
    prefixes = [[rng.randrange(VOCAB) for _ in range(max_prompt)] for _ in range(3)]
    out = []
    for _ in range(n):
        length = rng.randrange(1, max_prompt + 1)
        shared = rng.randrange(0, length + 1) if rng.random() < 0.6 else 0
        prompt = rng.choice(prefixes)[:shared] + [rng.randrange(VOCAB) for _ in range(length - shared)]
        out.append((prompt, rng.randrange(1, max_new + 1)))
    return out


CONFIGS = {
    # name: (num_blocks, block_size, max_num_seqs, max_num_batched_tokens, prefix_caching)
    "roomy": (400, 4, 8, 64, True),
    "tight": (12, 4, 8, 64, True),
    "tight_no_prefix": (12, 4, 8, 64, False),
    "tiny_budget_7_seqs": (40, 2, 7, 7, True),
    "block_size_1": (40, 1, 5, 13, True),
    "block_size_16": (4, 16, 3, 40, True),
}
TIGHT = {"tight", "tight_no_prefix", "block_size_16", "block_size_1"}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_loop_loses_nothing(name, seed):
    num_blocks, bs, max_seqs, budget, prefix = CONFIGS[name]
    max_model_len = min(num_blocks * bs, 48)
    h = Harness(num_blocks, bs, max_seqs, budget, max_model_len, prefix_caching=prefix)
    rng = random.Random(seed)
    for prompt, max_tokens in _workload(rng, 14, max_prompt=30, max_new=18):
        h.add(prompt, max_tokens=max_tokens)
    h.run()
    h.check_done()
    if name in TIGHT:
        assert h.sched.num_preemptions > 0, "the tight configuration should preempt"
    if not prefix:
        assert h.prefix_hit_tokens == 0


def test_generate_loop_with_arrivals_between_steps():
    h = Harness(num_blocks=14, block_size=4, max_num_seqs=5, max_num_batched_tokens=20, max_model_len=40)
    rng = random.Random(5)
    pending = _workload(rng, 30, max_prompt=24, max_new=14)
    while pending or not h.sched.is_finished():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                prompt, max_tokens = pending.pop()
                h.add(prompt, max_tokens=max_tokens)
        if not h.sched.is_finished():
            h.step()
        assert h.num_steps < 10_000
    h.check_done()
    assert h.sched.num_preemptions > 0 and h.prefix_hit_tokens > 0


def test_preempted_sequences_hit_their_own_blocks_in_loops():
    total_readmit_hits = 0
    for seed in range(4):
        h = Harness(num_blocks=12, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=48)
        rng = random.Random(100 + seed)
        for _ in range(10):
            h.add([rng.randrange(VOCAB) for _ in range(rng.randrange(10, 25))], max_tokens=15)
        h.run()
        h.check_done()
        total_readmit_hits += h.readmitted_with_hit
    assert total_readmit_hits > 0
