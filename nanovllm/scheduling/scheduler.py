"""Which sequences run each step: continuous batching, chunked prefill, preemption."""

from collections import deque

from nanovllm.scheduling.block_manager import BlockManager
from nanovllm.scheduling.sequence import Sequence, SequenceStatus
from nanovllm.scheduling.step import (
    BlockTableUpdate,
    NewSlot,
    PromptLogprobsRequest,
    ScheduledStep,
    StepBatch,
)


class Scheduler:
    """Waiting and running queues over a :class:`BlockManager`. No torch here.

    Each step spends a token budget: first one token for every running sequence that
    decodes, then prompt chunks (prompts under way, recomputation after preemption, newly
    admitted prompts); a prompt larger than what is left of the budget is split over steps.
    With ``mixed_steps`` off, prompt work runs in steps of its own, before any decode.
    Each running sequence holds one of ``max_num_seqs`` slots, under which the executor
    keeps its per-sequence state (such as the block table) from step to step.

    The scheduler is the one owner of a sequence's status, slot, computed-token count and
    what the executor has been sent; the engine decides when a sequence ends (:meth:`finish`).
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        mixed_steps: bool = True,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.mixed_steps = mixed_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
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
                return self._build_step([], [], chunks)
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
            decodes = self._make_room_preempting(decodes)
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
        return self._build_step(from_previous, decodes, chunks)

    def _classify_running(
        self, in_flight: ScheduledStep | None
    ) -> tuple[list[tuple[Sequence, int]], list[Sequence], list[tuple[Sequence, int]]]:
        """Split the running sequences by what they compute next: ``(seq, row in flight)``
        for a generated token in flight, a generated last token (a decode), ``(seq, start)``
        for more prompt (or, after preemption, more of the tokens to recompute)."""
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
            elif start == length - 1 and start >= seq.num_prompt_tokens:
                decodes.append(seq)
            else:
                continuing.append((seq, start))
        return from_previous, decodes, continuing

    def _reserve_ahead(self, from_previous: list[tuple[Sequence, int]], decodes: list[Sequence]) -> bool:
        """KV room for every decode while a step is in flight; False when a block is short."""
        bm = self.block_manager
        in_flight = [seq for seq, _ in from_previous]
        return bm.make_room_for_all(in_flight, lookahead=1) and bm.make_room_for_all(decodes)

    def _make_room_preempting(self, decodes: list[Sequence]) -> list[Sequence]:
        """KV room for each decode's token; when a block is short, the newest running sequence
        is preempted (possibly the one asking). Returns the decodes still running."""
        kept, make_room = [], self.block_manager.make_room
        for seq in decodes:
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted for an older sequence's block
            while not make_room(seq):
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
            if self._prompt_source_pending(seq):
                break
            num_cached = self.block_manager.allocate(seq)
            if num_cached is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_cached_tokens = seq.num_computed_tokens = num_cached
            seq.slot, seq.num_blocks_sent = self.free_slots.pop(), 0
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
        seq.num_computed_tokens = 0
        self.free_slots.append(seq.slot)
        seq.slot = -1

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks; it is recomputed (hitting its own cached blocks) later."""
        self.num_preemptions += 1
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def update_from_output(self, step: ScheduledStep, token_ids: list[int]) -> list[int]:
        """Record the step's computed KV and append its sampled tokens; returns the rows whose
        sequence was due a new token (not a prompt chunk's, nor a sequence that ended meanwhile),
        whether or not the row had one to give."""
        rows = []
        for row, (seq, n) in enumerate(zip(step.seqs, step.batch.num_tokens)):
            if seq.status == SequenceStatus.FINISHED:
                continue  # it ended on the previous step's token; this one was planned ahead
            seq.num_computed_tokens += n
            self.block_manager.commit_computed(seq)
            if seq.num_computed_tokens < len(seq):
                continue  # a prompt chunk: no token is sampled yet
            if token_ids[row] >= 0:  # a negative id marks a row that had no token to give
                seq.token_ids.append(token_ids[row])
            rows.append(row)
        return rows

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End running ``seq`` (``finish_reason`` "stop" or "length"); its blocks and slot go back."""
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
        self.running.remove(seq)
        self._release(seq)

    def forget_cached_prefixes(self) -> None:
        """No cached block may be hit again (the KV cache's contents were lost)."""
        self.block_manager.forget_cached()

    def abort_all(self) -> list[Sequence]:
        """End every waiting and running sequence ("abort") and take back every block and slot,
        also those an interrupted step held without recording them."""
        aborted = [*self.running, *self.waiting]
        for seq in aborted:
            seq.block_table, seq.num_shared_blocks, seq.num_computed_tokens, seq.slot = [], 0, 0, -1
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self.running.clear()
        self.waiting.clear()
        self.block_manager.release_all()
        self.free_slots = list(range(self.max_num_seqs - 1, -1, -1))
        return aborted

    def _build_step(
        self,
        from_previous: list[tuple[Sequence, int]],
        decodes: list[Sequence],
        chunks: list[tuple[Sequence, int, int]],
    ) -> ScheduledStep:
        """A step of ``from_previous`` rows ``(seq, row in the step in flight)``, whose input is
        the token in flight; of ``decodes``, whose input is their last token; and of prompt
        ``chunks`` ``(seq, start, num_tokens)``. Rows of one token go first. What the executor
        does not hold yet is sent, once."""
        single = [c for c in chunks if c[2] == 1]
        if single:
            chunks = single + [c for c in chunks if c[2] > 1]
        seqs = [s for s, _ in from_previous] + decodes + [s for s, _, _ in chunks]
        token_ids = [s.token_ids[-1] for s in decodes]
        for s, start, n in chunks:
            token_ids += s.token_ids[start : start + n]
        new_slots, updates = [], []
        for s in seqs:
            sent = s.num_blocks_sent
            if sent == 0:
                history = list(s.token_ids) if s.params.needs_token_history else None
                new_slots.append(NewSlot(s.slot, s.num_prompt_tokens, s.params, history))
            if len(s.block_table) > sent:
                updates.append(BlockTableUpdate(s.slot, sent, s.block_table[sent:]))
                s.num_blocks_sent = len(s.block_table)
        num_decodes = len(from_previous) + len(decodes)
        # rows that sample under a structured-output constraint: every decode, a chunk that ends
        # its sequence's tokens
        structured_rows = [r for r, s in enumerate(seqs[:num_decodes]) if s.params.structured_outputs]
        prompt_logprobs = []
        for row, (s, start, n) in enumerate(chunks, start=num_decodes):
            if s.params.prompt_logprobs is not None and start + 1 < s.num_prompt_tokens:
                targets = s.token_ids[start + 1 : min(start + n + 1, s.num_prompt_tokens)]
                k = s.params.prompt_logprobs
                prompt_logprobs.append(PromptLogprobsRequest(row, start + 1, targets, k))
            if s.params.structured_outputs is not None and start + n == len(s):
                structured_rows.append(row)
        num_single = num_decodes + len(single)
        batch = StepBatch(
            slots=[s.slot for s in seqs],
            num_tokens=[1] * num_single + [n for _, _, n in chunks[len(single) :]],
            token_ids=token_ids,
            start_positions=[len(s.token_ids) for s, _ in from_previous]
            + [len(s.token_ids) - 1 for s in decodes]
            + [start for _, start, _ in chunks],
            num_single_token_rows=num_single,
            new_slots=new_slots,
            block_table_updates=updates,
            previous_sample_rows=[row for _, row in from_previous],
            prompt_logprobs=prompt_logprobs,
            structured_rows=structured_rows,
        )
        return ScheduledStep(seqs, batch, num_decodes)
