"""Which sequences run each step: continuous batching, chunked prefill, preemption."""

from collections import deque

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    """Waiting and running queues over a :class:`BlockManager`. No torch here.

    A step is either a prefill step (new prompts, prompt chunks, recomputation after
    preemption) or a decode step (one token for every running sequence). Prefill goes
    first; a prompt larger than the remaining token budget is split over several steps.
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
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Pick this step's sequences and set their ``num_scheduled_tokens``."""
        scheduled = self._schedule_prefill()
        if scheduled:
            return scheduled, True
        scheduled = self._schedule_decode()
        if not scheduled:
            raise RuntimeError("scheduler made no progress: no sequence fits the KV cache")
        return scheduled, False

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        for seq in self.running:
            if budget and seq.is_prefilling:
                budget -= self._take_chunk(seq, budget)
                scheduled.append(seq)
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= self._take_chunk(seq, budget)
            scheduled.append(seq)
        return scheduled

    @staticmethod
    def _take_chunk(seq: Sequence, budget: int) -> int:
        seq.num_scheduled_tokens = min(len(seq) - seq.num_computed_tokens, budget)
        return seq.num_scheduled_tokens

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.append_slot(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        self.running.extend(scheduled)
        return scheduled

    def schedule_ahead(self, in_flight: list[Sequence]) -> list[Sequence] | None:
        """Plan the decode step after ``in_flight`` (a decode step) before its tokens are known.

        Every running sequence that might not finish on the token in flight gets a slot for
        the token after it; its input comes from the in-flight step's output (row index in
        ``in_flight``). Returns None when the next step needs the scheduler's full decision:
        prompts are waiting, a block is short, or nothing would continue.
        """
        if self.waiting:
            return None
        in_flight_ids = {seq.seq_id for seq in in_flight}
        seqs = [seq for seq in self.running if not self._finishes_on_next_token(seq)]
        if not seqs or any(seq.seq_id not in in_flight_ids or seq.is_prefilling for seq in seqs):
            return None
        bm = self.block_manager
        if sum(not bm.has_slot(seq, lookahead=1) for seq in seqs) > bm.num_free_blocks:
            return None
        for seq in seqs:
            bm.append_slot(seq, lookahead=1)
        return seqs

    def _finishes_on_next_token(self, seq: Sequence) -> bool:
        """True when the token in flight surely ends ``seq`` (by length, not by content)."""
        return (
            seq.num_completion_tokens + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= self.max_model_len
        )

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks; it is recomputed (hitting its own cached blocks) later."""
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.block_manager.free(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], is_prefill: bool) -> list[Sequence]:
        """Record computed KV, append sampled tokens, finish sequences; returns the finished."""
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            if seq.status == SequenceStatus.FINISHED:
                continue  # it ended on the previous step's token; this one was planned ahead
            # a decode step computes one token, also when planned ahead of the step before it
            seq.num_computed_tokens += seq.num_scheduled_tokens if is_prefill else 1
            seq.num_scheduled_tokens = 0
            self.block_manager.commit_computed(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prompt chunk: no token is sampled yet
            seq.append_token(token_id)
            reason = self._finish_reason(seq, token_id)
            if reason:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
                self.block_manager.free(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if token_id in params.stop_token_ids:
            return "stop"
        if (
            seq.num_tokens - seq.num_prompt_tokens >= params.max_tokens
            or seq.num_tokens >= self.max_model_len
        ):
            return "length"
        return None
