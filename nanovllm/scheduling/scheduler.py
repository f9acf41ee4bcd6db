"""Which sequences run each step: continuous batching, chunked prefill, preemption."""

from collections import deque

from nanovllm.scheduling.block_manager import BlockManager
from nanovllm.scheduling.sequence import Sequence, SequenceStatus
from nanovllm.scheduling.step import ScheduledStep


class Scheduler:
    """Waiting and running queues over a :class:`BlockManager`. No torch here.

    Each step spends a token budget: first one token for every running sequence that
    decodes, then prompt chunks (prompts under way, recomputation after preemption, newly
    admitted prompts); a prompt larger than what is left of the budget is split over steps.
    With ``mixed_steps`` off, prompt work runs in steps of its own, before any decode.
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
        mixed_steps: bool = True,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.mixed_steps = mixed_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> ScheduledStep:
        """Plan the next step with every token known (no step in flight); may preempt."""
        step = self._plan(None)
        if step is None:
            raise RuntimeError("scheduler made no progress: no sequence fits the KV cache")
        return step

    def schedule_ahead(self, in_flight: ScheduledStep) -> ScheduledStep | None:
        """Plan the step after ``in_flight`` before its sampled tokens are known.

        A sequence whose next token is in flight decodes it, unless that token surely ends it;
        a prompt goes on after its chunk in flight. Returns None when the step needs the
        scheduler's full decision (a block is short: someone must be preempted) or when
        nothing would run.
        """
        return self._plan(in_flight)

    def _plan(self, in_flight: ScheduledStep | None) -> ScheduledStep | None:
        from_previous, decodes, continuing = self._classify_running(in_flight)
        budget = self.max_num_batched_tokens
        if not self.mixed_steps:  # prompt work first, in steps of its own
            chunks = self._prompt_chunks(continuing, budget, admit=True)
            if chunks:
                return ScheduledStep.plan([], [], chunks)
            continuing = []
        if len(from_previous) + len(decodes) > budget:
            from_previous = from_previous[:budget]
            decodes = decodes[: budget - len(from_previous)]
        preempted = False
        if in_flight is not None:
            if not self._reserve_ahead(from_previous, decodes):
                return None
        else:
            num_preemptions = self.num_preemptions
            decodes = self._append_slots_preempting(decodes)
            preempted = self.num_preemptions > num_preemptions
            if preempted:
                continuing = [
                    (seq, start) for seq, start in continuing if seq.status == SequenceStatus.RUNNING
                ]
        budget -= len(from_previous) + len(decodes)
        # without mixed steps admission was tried above, and decode slots only take blocks
        chunks = self._prompt_chunks(continuing, budget, admit=self.mixed_steps and not preempted)
        if not from_previous and not decodes and not chunks:
            return None
        return ScheduledStep.plan(from_previous, decodes, chunks)

    def _classify_running(
        self, in_flight: ScheduledStep | None
    ) -> tuple[list[tuple[Sequence, int]], list[Sequence], list[tuple[Sequence, int]]]:
        """Split the running sequences by what they compute next: ``(seq, row in flight)``
        for a token in flight, a known last token, ``(seq, start)`` for more prompt."""
        in_flight_rows, in_flight_tokens = {}, []
        if in_flight is not None:
            in_flight_rows = {seq.seq_id: i for i, seq in enumerate(in_flight.seqs)}
            in_flight_tokens = in_flight.batch.num_tokens
        from_previous, decodes, continuing = [], [], []
        max_model_len = self.max_model_len
        for seq in self.running:
            row = in_flight_rows.get(seq.seq_id, -1)
            length = len(seq.token_ids)
            start = seq.num_computed_tokens + (in_flight_tokens[row] if row >= 0 else 0)
            if start == length:  # its next token is in flight; skip it if that token surely ends it
                if length - seq.num_prompt_tokens + 1 < seq.params.max_tokens and length + 1 < max_model_len:
                    from_previous.append((seq, row))
            elif start == length - 1:
                decodes.append(seq)
            else:
                continuing.append((seq, start))
        return from_previous, decodes, continuing

    def _reserve_ahead(self, from_previous: list[tuple[Sequence, int]], decodes: list[Sequence]) -> bool:
        """Slots for every decode while a step is in flight; False when a block is short."""
        bm = self.block_manager
        return bm.append_slots([seq for seq, _ in from_previous], lookahead=1) and bm.append_slots(decodes)

    def _append_slots_preempting(self, decodes: list[Sequence]) -> list[Sequence]:
        """A slot for each decode; when a block is short, the newest running sequence is
        preempted (possibly the one asking). Returns the decodes still running."""
        kept, append_slot = [], self.block_manager.append_slot
        for seq in decodes:
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted for an older sequence's block
            while not append_slot(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                kept.append(seq)
        return kept

    def _prompt_chunks(
        self, continuing: list[tuple[Sequence, int]], budget: int, admit: bool
    ) -> list[tuple[Sequence, int, int]]:
        """``(seq, start, num_tokens)`` for prompts under way, then for admitted ones, while
        the token budget lasts."""
        chunks = []
        for seq, start in continuing:
            if not budget:
                return chunks
            n = min(len(seq) - start, budget)
            chunks.append((seq, start, n))
            budget -= n
        while admit and self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._prompt_source_pending(seq) or not self.block_manager.allocate(seq):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.row, seq.num_blocks_sent = self.free_rows.pop(), 0
            self.running.append(seq)
            n = min(len(seq) - seq.num_computed_tokens, budget)
            chunks.append((seq, seq.num_computed_tokens, n))
            budget -= n
        return chunks

    def _prompt_source_pending(self, seq: Sequence) -> bool:
        """A parallel sample waits until its first sibling has computed the prompt, so that it
        finds the prompt's full blocks in the prefix cache instead of computing them again
        (when it can share them)."""
        source = seq.prompt_source
        if source is None or source.is_finished or not self.block_manager.shares_blocks(seq):
            return False
        return source.num_computed_tokens < source.num_prompt_tokens

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
        for seq, n, token_id in zip(step.seqs, step.batch.num_tokens, token_ids):
            if seq.status == SequenceStatus.FINISHED:
                continue  # it ended on the previous step's token; this one was planned ahead
            seq.num_computed_tokens += n
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
            seq.stop_reason = token_id
            return "stop"
        if seq.num_completion_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def stop(self, seq: Sequence, stop_reason: str) -> None:
        """End ``seq`` ("stop") for a reason found outside the scheduler (a stop string); one
        that just ended for another reason (its length) takes this reason instead."""
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self._release(seq)
            seq.status = SequenceStatus.FINISHED
        elif not seq.is_finished:
            self._finish(seq, "stop")
        seq.finish_reason, seq.stop_reason = "stop", stop_reason

    def abort_all(self) -> list[Sequence]:
        """End every waiting and running sequence ("abort") and take back every block and row,
        also those an interrupted step held without recording them."""
        aborted = [*self.running, *self.waiting]
        for seq in aborted:
            seq.block_table, seq.row = [], -1
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self.running.clear()
        self.waiting.clear()
        self.block_manager.release_all()
        self.free_rows = list(range(self.max_num_seqs - 1, -1, -1))
        return aborted
