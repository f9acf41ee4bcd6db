"""A scheduler test harness: a real BlockManager driven by a fake model. Pure Python.

The fake model's next token is a fixed function of the whole context, so the expected
completion of every request is known without the scheduler; a fake KV cache records, for
every slot, a fingerprint of the context its KV was computed from, and every step checks
that a sequence only ever reads KV of its own prefix (prefix hits, preemption and chunking
included) and only writes into blocks nobody else holds. A fake executor keeps each slot's
block table from the steps' deltas alone and checks it against the sequences' tables. The
engine's own :class:`OutputProcessor` applies each step's tokens and ends sequences.
"""

import contextlib
import signal
from collections import deque

from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.sampling_params import SamplingParams
from nanovllm.scheduling.block_manager import BlockManager
from nanovllm.scheduling.scheduler import Scheduler
from nanovllm.scheduling.sequence import Sequence, SequenceStatus
from nanovllm.scheduling.step import ScheduledStep, StepOutput

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
        mixed: bool = False,
    ) -> None:
        self.bs = block_size
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.sched = Scheduler(
            self.bm, max_num_seqs, max_num_batched_tokens, max_model_len, mixed_steps=mixed
        )
        self.output_processor = OutputProcessor(self.sched, eos, max_model_len)
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.seqs: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.num_steps = 0
        self.prefix_hit_tokens = 0
        self.preempted_ids: set[int] = set()
        self.readmitted_with_hit = 0
        self.slot_tables: dict[int, list[int]] = {}  # the fake executor's block tables, by slot
        self.slot_prompt_lens: dict[int, int] = {}

    def add(self, tokens, **params) -> Sequence:
        seq = Sequence(len(self.seqs), list(tokens), SamplingParams(**params))
        self.sched.add(seq)
        self.seqs.append(seq)
        return seq

    def step(self, tokens_for=None) -> tuple[list[Sequence], bool, list[Sequence]]:
        """One engine step; ``tokens_for(seq)`` overrides the fake model's token."""
        waiting_before = {s.seq_id for s in self.sched.waiting}
        running_before = {s.seq_id for s in self.sched.running}
        step = self.sched.schedule()
        seqs = step.seqs
        self.num_steps += 1
        for s in self.seqs:
            if s.seq_id in running_before and s.status == SequenceStatus.WAITING:
                self.preempted_ids.add(s.seq_id)
        for s in seqs:
            if s.seq_id in waiting_before:
                self.prefix_hit_tokens += s.num_cached_tokens
                if s.seq_id in self.preempted_ids and s.num_cached_tokens:
                    self.readmitted_with_hit += 1
        self.check(step)
        self.apply_batch(step)
        tokens = [self.compute(s, start, n) for s, start, n in self.rows(step)]
        if tokens_for is not None:
            tokens = [tokens_for(s) if t != DUMMY else t for s, t in zip(seqs, tokens)]
        finished = self.update(step, tokens)
        self.finished.extend(finished)
        self.check_blocks()
        return seqs, not step.batch.is_decode, finished

    def update(self, step: ScheduledStep, tokens: list[int]) -> list[Sequence]:
        """What the engine does with a step's tokens: record them, end the sequences they end."""
        return self.output_processor.process(step, StepOutput(tokens)).finished

    @staticmethod
    def rows(step: ScheduledStep) -> list[tuple[Sequence, int, int]]:
        """``(seq, start, num_tokens)`` of each batch row."""
        return list(zip(step.seqs, step.batch.start_positions, step.batch.num_tokens))

    def run(self, max_steps: int = 20_000) -> None:
        with deadline(30):
            while not self.sched.is_finished():
                assert self.num_steps < max_steps, "the scheduler does not terminate"
                self.step()

    def run_async(self, max_steps: int = 20_000) -> int:
        """Run as the engine does with async scheduling: while a decode step is in flight,
        the next is planned ahead of its tokens. Returns how many steps were planned ahead."""
        in_flight: deque[ScheduledStep] = deque()
        ahead = 0
        with deadline(30):
            while in_flight or not self.sched.is_finished():
                assert self.num_steps < max_steps, "the scheduler does not terminate"
                if not in_flight:
                    step = self.sched.schedule()
                    self.check(step)
                    self.apply_batch(step)
                    in_flight.append(step)
                if len(in_flight) == 1:
                    planned = self.sched.schedule_ahead(in_flight[0])
                    if planned is not None:
                        self.check(planned)
                        self.apply_batch(planned)
                        in_flight.append(planned)
                        ahead += 1
                step = in_flight.popleft()
                self.num_steps += 1
                # a planned-ahead input token is known now: the step before appended it
                tokens = [
                    DUMMY if s.is_finished else self.compute(s, start, n) for s, start, n in self.rows(step)
                ]
                self.finished.extend(self.update(step, tokens))
                self.check_blocks()
        return ahead

    # ------------------------------------------------------------------ fake executor

    def apply_batch(self, step: ScheduledStep) -> None:
        """Keep each slot's block table and prompt length from what the batch carries, as the
        executor does, and check them against the sequences."""
        b = step.batch
        assert len(set(b.slots)) == len(b.slots), "two batch rows share an executor slot"
        running_slots = [s.slot for s in self.sched.running]
        assert len(set(running_slots)) == len(running_slots), "two running sequences share a slot"
        for new in b.new_slots:
            self.slot_tables[new.slot] = []
            self.slot_prompt_lens[new.slot] = new.num_prompt_tokens
        for u in b.block_table_updates:
            table = self.slot_tables[u.slot]
            assert len(table) == u.start, "an update that does not continue its slot's table"
            table += u.block_ids
        assert len(b.num_tokens) == len(b.start_positions) == len(step.seqs)
        for seq, slot in zip(step.seqs, b.slots):
            assert 0 <= slot < self.sched.max_num_seqs and seq.slot == slot
            assert self.slot_tables[slot] == seq.block_table, f"slot {slot} drifted from seq {seq.seq_id}"
            assert self.slot_prompt_lens[slot] == seq.num_prompt_tokens

    def compute(self, seq: Sequence, start: int, n: int) -> int:
        """Fake KV for ``n`` tokens from ``start``, checking what is read; returns the next
        token, or DUMMY for a chunk that ends inside the prompt."""
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

    def check(self, step: ScheduledStep) -> None:
        sched, b, seqs = self.sched, step.batch, step.seqs
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
        for s in sched.waiting:
            assert s.status == SequenceStatus.WAITING and s.block_table == []
        assert sum(b.num_tokens) <= sched.max_num_batched_tokens and len(seqs) <= sched.max_num_seqs
        num_previous = len(b.previous_sample_rows)
        assert num_previous <= step.num_decodes <= b.num_single_token_rows
        assert sched.mixed_steps or not num_previous or b.is_decode, "mixed steps are off"
        for i, (s, start, n) in enumerate(self.rows(step)):
            assert n >= 1 and (i < b.num_single_token_rows) == (n == 1), "single-token rows go first"
            if num_previous <= i < step.num_decodes:  # a decode's input is its newest generated token
                assert start == len(s) - 1 >= s.num_prompt_tokens
            if i < num_previous:  # its input is the token in flight, at position len(s)
                assert start == len(s)
            else:
                assert start + n <= len(s)
            assert len(s.block_table) == cdiv(max(len(s), start + n), self.bs)
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
                    assert s.token_ids[i * self.bs : (i + 1) * self.bs] == block.token_ids
                    assert (i + 1) * self.bs <= s.num_computed_tokens

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
