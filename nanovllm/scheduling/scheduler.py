"""Which sequences run each step: continuous batching, chunked prefill, preemption."""

from collections import deque

from nanovllm.scheduling.block_manager import BlockManager
from nanovllm.scheduling.sequence import Sequence, SequenceStatus
from nanovllm.scheduling.step import ScheduledStep


class Scheduler:
    """Waiting and running queues over a :class:`BlockManager`. No torch here.

    A step is either a prefill step (new prompts, prompt chunks, recomputation after
    preemption) or a decode step (one token for every running sequence). Prefill goes
    first; a prompt larger than the remaining token budget is split over several steps.
    Each running sequence holds one of ``max_num_seqs`` rows, under which the executor
    keeps its per-sequence state (such as the block table) from step to step.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: list[int],
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> ScheduledStep:
        """Pick this step's sequences, set their ``num_scheduled_tokens`` and plan the step."""
        scheduled = self._schedule_prefill()
        if scheduled:
            return ScheduledStep.plan(scheduled, is_prefill=True)
        scheduled = self._schedule_decode()
        if not scheduled:
            raise RuntimeError("scheduler made no progress: no sequence fits the KV cache")
        return ScheduledStep.plan(scheduled, is_prefill=False)

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        for seq in self.running:
            if budget and seq.is_prefilling:
                budget -= self._take_chunk(seq, budget)
                scheduled.append(seq)
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.allocate(seq):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.row, seq.num_blocks_sent = self.free_rows.pop(), 0
            self.running.append(seq)
            budget -= self._take_chunk(seq, budget)
            scheduled.append(seq)
        return scheduled

    @staticmethod
    def _take_chunk(seq: Sequence, budget: int) -> int:
        seq.num_scheduled_tokens = min(len(seq) - seq.num_computed_tokens, budget)
        return seq.num_scheduled_tokens

    def _schedule_decode(self) -> list[Sequence]:
        """One token for each running sequence; when a block is short, the newest running
        sequence is preempted (possibly the one asking)."""
        scheduled: list[Sequence] = []
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            while not self.block_manager.append_slot(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
                i += 1
        return scheduled

    def schedule_ahead(self, in_flight: ScheduledStep) -> ScheduledStep | None:
        """Plan the decode step after ``in_flight`` (a decode step) before its tokens are known.

        Every running sequence that might not finish on the token in flight gets a slot for
        the token after it. Returns None when the next step needs the scheduler's full
        decision: prompts are waiting, a block is short, or nothing would continue.
        """
        if self.waiting or in_flight.is_prefill:
            return None
        in_flight_ids = {seq.seq_id for seq in in_flight.seqs}
        seqs = [seq for seq in self.running if not self._finishes_on_next_token(seq)]
        if not seqs or any(seq.seq_id not in in_flight_ids or seq.is_prefilling for seq in seqs):
            return None
        bm = self.block_manager
        if sum(not bm.has_slot(seq, lookahead=1) for seq in seqs) > bm.num_free_blocks:
            return None
        for seq in seqs:
            bm.append_slot(seq, lookahead=1)
        return ScheduledStep.plan_after(seqs, in_flight)

    def _finishes_on_next_token(self, seq: Sequence) -> bool:
        """True when the token in flight surely ends ``seq`` (by length, not by content)."""
        return seq.num_completion_tokens + 1 >= seq.params.max_tokens or len(seq) + 1 >= self.max_model_len

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if seq.row >= 0:
            self.free_rows.append(seq.row)
            seq.row = -1

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks; it is recomputed (hitting its own cached blocks) later."""
        self.num_preemptions += 1
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def postprocess(self, step: ScheduledStep, token_ids: list[int]) -> list[Sequence]:
        """Record computed KV, append sampled tokens, finish sequences; returns the finished."""
        finished = []
        for seq, token_id in zip(step.seqs, token_ids):
            if seq.status == SequenceStatus.FINISHED:
                continue  # it ended on the previous step's token; this one was planned ahead
            # a decode step computes one token, also when planned ahead of the step before it
            seq.num_computed_tokens += seq.num_scheduled_tokens if step.is_prefill else 1
            seq.num_scheduled_tokens = 0
            self.block_manager.commit_computed(seq)
            if seq.num_computed_tokens < len(seq):
                continue  # a prompt chunk: no token is sampled yet
            seq.token_ids.append(token_id)
            reason = self._finish_reason(seq, token_id)
            if reason:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self.running.remove(seq)
        self._release(seq)

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if token_id in params.stop_token_ids:
            return "stop"
        if seq.num_completion_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def abort_all(self) -> list[Sequence]:
        """End every waiting and running sequence ("abort") and take back every block and row,
        also those an interrupted step held without recording them."""
        aborted = [*self.running, *self.waiting]
        for seq in aborted:
            seq.block_table, seq.row, seq.num_scheduled_tokens = [], -1, 0
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self.running.clear()
        self.waiting.clear()
        self.block_manager.release_all()
        self.free_rows = list(range(self.max_num_seqs - 1, -1, -1))
        return aborted
