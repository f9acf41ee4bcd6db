"""Per-request logits processing before sampling: allowed tokens, logit bias, min_tokens, bad
words and repetition / frequency / presence penalties, batched over the rows that use each.

Penalties and bad words need each row's tokens, which a step planned ahead may only have on the
device, so slots that read them keep their token ids by position in a device table: the prompt
(and, after preemption, the tokens generated before) is written when a sequence takes the
slot, every sampled token at its position right after sampling. A batch row computing
``context_len`` tokens reads positions ``[0, context_len)``; the completion starts at the
row's ``num_prompt_tokens``. A row taken over thus starts with an empty history, unwritten.
"""

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.scheduling.step import NewSlot

_NO_IDS = np.empty(0, dtype=np.int64)
_MIN_HISTORY = 256  # token table positions at first


@dataclass(slots=True)
class LogitsTensors:
    """One batch's logits processing on the logits' device (built as host arrays that
    :func:`~nanovllm.execution.upload.upload` moves there); a part no row uses is None.

    ``x_batch`` fields hold batch rows; ``(x_batch, x_ids)`` pairs name one token of one row.
    """

    allowed_batch: torch.Tensor | None = None
    """Rows that may only sample their allowed ids; ``allowed_of`` indexes into it."""
    allowed_of: torch.Tensor | None = None
    allowed_ids: torch.Tensor | None = None
    bias_batch: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    banned_batch: torch.Tensor | None = None
    """Tokens held back by min_tokens (EOS and stop token ids)."""
    banned_ids: torch.Tensor | None = None
    never_batch: torch.Tensor | None = None
    """One-token bad words, held back always."""
    never_ids: torch.Tensor | None = None
    words_batch: torch.Tensor | None = None
    """Bad words of several tokens, one per entry: the row, its slot, where the word's prefix
    would start (``width`` tokens, ``prefix_lens`` of them real) and its last token, held back
    where the completion so far ends with the prefix."""
    words_slots: torch.Tensor | None = None
    words_starts: torch.Tensor | None = None
    words_prefixes: torch.Tensor | None = None
    words_prefix_lens: torch.Tensor | None = None
    words_last: torch.Tensor | None = None
    history: torch.Tensor | None = None
    """``[slots, positions]`` token ids by position, of the slots that read them (positions grow
    with the contexts, up to ``max_model_len``)."""
    history_slots: torch.Tensor | None = None
    """Known tokens of slots taken this step, to write into ``history`` before reading it."""
    history_pos: torch.Tensor | None = None
    history_tokens: torch.Tensor | None = None
    penalized: torch.Tensor | None = None
    """Batch rows with a penalty, their slots, prompt lengths and context lengths."""
    penalized_slots: torch.Tensor | None = None
    prompt_lens: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    width: int = 0
    """Largest of ``context_lens``: the table columns a batch reads."""
    repetition: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    record_batch: torch.Tensor | None = None
    """Batch rows whose sample is a real next token (not a prompt chunk's), and where it goes."""
    record_slots: torch.Tensor | None = None
    record_pos: torch.Tensor | None = None


def process_logits(logits: torch.Tensor, lt: LogitsTensors) -> torch.Tensor:
    """float32 logits after allowed_token_ids, logit_bias, min_tokens, then the penalties;
    ``logits`` itself is left as it is."""
    logits = logits.to(torch.float32, copy=True)
    if lt.history_slots is not None:
        lt.history.index_put_((lt.history_slots, lt.history_pos), lt.history_tokens)
    if lt.allowed_batch is not None:
        keep = torch.zeros(len(lt.allowed_batch), logits.shape[1], dtype=torch.bool, device=logits.device)
        keep[lt.allowed_of, lt.allowed_ids] = True
        logits[lt.allowed_batch] = logits[lt.allowed_batch].masked_fill_(~keep, float("-inf"))
    if lt.bias_batch is not None:
        logits.index_put_((lt.bias_batch, lt.bias_ids), lt.bias_values, accumulate=True)
    if lt.banned_batch is not None:
        logits[lt.banned_batch, lt.banned_ids] = float("-inf")
    if lt.never_batch is not None:
        logits[lt.never_batch, lt.never_ids] = float("-inf")
    if lt.words_batch is not None:
        _hold_back_bad_words(logits, lt)
    if lt.penalized is not None:
        logits[lt.penalized] = _penalize(logits[lt.penalized], lt)
    return logits


def _hold_back_bad_words(logits: torch.Tensor, lt: LogitsTensors) -> None:
    """-inf on a bad word's last token where the row's tokens end with the word's prefix; added
    (0 elsewhere), so no mask is read back on the host."""
    width = lt.words_prefixes.shape[1]
    offsets = torch.arange(width, device=logits.device)
    positions = (lt.words_starts.unsqueeze(1) + offsets).clamp(max=lt.history.shape[1] - 1)
    seen = lt.history[lt.words_slots.unsqueeze(1), positions].long()
    real = offsets < lt.words_prefix_lens.unsqueeze(1)
    matches = ((seen == lt.words_prefixes) | ~real).all(dim=1)
    held = torch.zeros(len(matches), device=logits.device).masked_fill_(matches, float("-inf"))
    logits.index_put_((lt.words_batch, lt.words_last), held, accumulate=True)


def _penalize(logits: torch.Tensor, lt: LogitsTensors) -> torch.Tensor:
    """Penalties on the penalised rows' logits; positions a row does not use go to a spare
    column ``vocab``, dropped after the scatter."""
    vocab = logits.shape[1]
    tokens = lt.history[lt.penalized_slots, : lt.width].long()
    pos = torch.arange(lt.width, device=logits.device).unsqueeze(0)
    known = pos < lt.context_lens.unsqueeze(1)
    if lt.repetition is not None:  # Hugging Face's: prompt and completion tokens alike
        seen = torch.zeros(len(tokens), vocab + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, tokens.masked_fill(~known, vocab), True)
        penalty = lt.repetition.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen[:, :vocab], penalized, logits)
    if lt.frequency is not None:  # OpenAI's: completion tokens only
        completion = known & (pos >= lt.prompt_lens.unsqueeze(1))
        counts = torch.zeros(len(tokens), vocab + 1, dtype=torch.float32, device=logits.device)
        counts.scatter_add_(1, tokens.masked_fill(~completion, vocab), completion.float())
        counts = counts[:, :vocab]
        logits = logits - lt.frequency.unsqueeze(1) * counts - lt.presence.unsqueeze(1) * (counts > 0)
    return logits


def record_samples(lt: LogitsTensors, sampled: torch.Tensor) -> None:
    """Write the rows' sampled tokens into the history, for the next steps' penalties."""
    if lt.record_batch is not None:
        # a row with no token (a negative marker) ends its sequence; a step planned ahead may
        # still read the entry, which must stay a valid token id
        values = sampled[lt.record_batch].clamp(min=0).to(lt.history.dtype)
        lt.history.index_put_((lt.record_slots, lt.record_pos), values)


def _ragged(lengths: np.ndarray, slots: np.ndarray, batch: np.ndarray, *per_slot: np.ndarray):
    """``(batch row of each entry, *entries)`` of batch rows ``batch`` (slots ``slots[batch]``),
    None when they have none."""
    counts = lengths[slots[batch]]
    if not counts.any():
        return None
    batch = batch[counts > 0]
    return np.repeat(batch, counts[counts > 0]), *(np.concatenate(t[slots[batch]]) for t in per_slot)


class LogitsSlots:
    """Each slot's logits-processing parameters (host) and the token table of the slots that
    penalise repeats (device, allocated when a slot first needs it)."""

    def __init__(self, num_slots: int, max_model_len: int, eos_token_ids: tuple[int, ...], device):
        self.max_model_len, self.device = max_model_len, device
        self.eos = np.asarray(eos_token_ids, dtype=np.int64)
        self.uses = np.zeros(num_slots, dtype=bool)
        self.any_use = False
        self.num_known = np.zeros(num_slots, dtype=np.int64)
        """Tokens written into the table when the slot was taken: a prompt chunk ending
        before them samples nothing real."""
        self.repetition = np.ones(num_slots, dtype=np.float32)
        self.frequency = np.zeros(num_slots, dtype=np.float32)
        self.presence = np.zeros(num_slots, dtype=np.float32)
        self.min_tokens = np.zeros(num_slots, dtype=np.int64)
        self.banned, self.num_banned = self._ragged_table(num_slots)
        self.allowed, self.num_allowed = self._ragged_table(num_slots)
        self.bias_ids, self.num_bias = self._ragged_table(num_slots)
        self.bias_values = self._ragged_table(num_slots)[0]
        self.never, self.num_never = self._ragged_table(num_slots)
        self.words: list[list[list[int]]] = [[] for _ in range(num_slots)]
        """Each slot's bad words of several tokens."""
        self.keeps_history = np.zeros(num_slots, dtype=bool)
        self.history: torch.Tensor | None = None
        self.pending: list[tuple[int, list[int]]] = []

    @staticmethod
    def _ragged_table(num_slots: int) -> tuple[np.ndarray, np.ndarray]:
        per_slot = np.empty(num_slots, dtype=object)
        per_slot[:] = [_NO_IDS] * num_slots
        return per_slot, np.zeros(num_slots, dtype=np.int64)

    def assign(self, new: NewSlot) -> None:
        """Keep the parameters of the sequence that took a slot. A slot that uses none is only
        marked so: every other array is read through ``uses``."""
        p, slot = new.params, new.slot
        keeps_history = p.needs_token_history
        self.keeps_history[slot] = keeps_history
        self.uses[slot] = (
            keeps_history
            or p.min_tokens > 0
            or bool(p.allowed_token_ids or p.logit_bias or p.bad_words_token_ids)
        )
        if not self.uses[slot]:
            self.any_use = self.any_use and bool(self.uses.any())
            return
        self.any_use = True
        if keeps_history:
            if new.token_ids is None:
                raise ValueError(f"slot {slot} reads the tokens seen so far but was sent no token ids")
            self.pending.append((slot, new.token_ids))
        self.num_known[slot] = len(new.token_ids) if keeps_history else new.num_prompt_tokens
        words = p.bad_words_token_ids or []
        self._set(self.never, self.num_never, slot, [ids[0] for ids in words if len(ids) == 1])
        self.words[slot] = [ids for ids in words if len(ids) > 1]
        self.repetition[slot] = p.repetition_penalty
        self.frequency[slot], self.presence[slot] = p.frequency_penalty, p.presence_penalty
        self.min_tokens[slot] = p.min_tokens
        stop = np.asarray(p.stop_token_ids, dtype=np.int64)
        self._set(self.banned, self.num_banned, slot, stop if p.ignore_eos else np.union1d(self.eos, stop))
        self._set(self.allowed, self.num_allowed, slot, p.allowed_token_ids or ())
        self._set(self.bias_ids, self.num_bias, slot, list(p.logit_bias or ()))
        self.bias_values[slot] = np.fromiter((p.logit_bias or {}).values(), dtype=np.float32)

    @staticmethod
    def _set(per_slot: np.ndarray, lengths: np.ndarray, slot: int, ids) -> None:
        per_slot[slot] = np.asarray(ids, dtype=np.int64)
        lengths[slot] = len(per_slot[slot])

    def gather(
        self, slots: np.ndarray, context_lens: np.ndarray, prompt_lens: np.ndarray
    ) -> LogitsTensors | None:
        """The batch's logits processing as host arrays; None when no row uses any.
        ``prompt_lens``: each row's prompt length."""
        if not self.any_use:
            return None
        batch = np.flatnonzero(self.uses[slots])
        if not batch.size:
            return None
        lt = LogitsTensors()
        if self.pending or self.keeps_history[slots[batch]].any():
            # written up to each pending history and each row's context, read below the context
            width = max([len(t) for _, t in self.pending] + [int(context_lens[batch].max()) + 1])
            lt.history = self._history_for(min(width, self.max_model_len))
        if self.pending:
            self._write_pending(lt)
        pairs = _ragged(self.num_allowed, slots, batch, self.allowed)
        if pairs is not None:
            allowed, lt.allowed_of = np.unique(pairs[0], return_inverse=True)
            lt.allowed_batch, lt.allowed_ids = allowed, pairs[1]
        pairs = _ragged(self.num_bias, slots, batch, self.bias_ids, self.bias_values)
        if pairs is not None:
            lt.bias_batch, lt.bias_ids, lt.bias_values = pairs
        generated = context_lens - prompt_lens
        held = batch[generated[batch] < self.min_tokens[slots[batch]]]
        pairs = _ragged(self.num_banned, slots, held, self.banned)
        if pairs is not None:
            lt.banned_batch, lt.banned_ids = pairs
        pairs = _ragged(self.num_never, slots, batch, self.never)
        if pairs is not None:
            lt.never_batch, lt.never_ids = pairs
        self._bad_words(lt, slots, context_lens, generated, batch)
        self._penalties(lt, slots, context_lens, prompt_lens, batch)
        self._records(lt, slots, context_lens, batch)
        return lt

    def _bad_words(self, lt: LogitsTensors, slots, context_lens, generated, batch) -> None:
        """The batch's bad words of several tokens whose prefix fits in the completion so far."""
        rows, prefixes, last = [], [], []
        for row in batch:
            for ids in self.words[slots[row]]:
                if len(ids) - 1 <= generated[row]:  # vLLM's: the completion's tokens only
                    rows.append(row)
                    prefixes.append(ids[:-1])
                    last.append(ids[-1])
        if not rows:
            return
        rows = np.asarray(rows, dtype=np.int64)
        lens = np.fromiter(map(len, prefixes), dtype=np.int64, count=len(prefixes))
        table = np.zeros((len(prefixes), int(lens.max())), dtype=np.int64)
        for i, prefix in enumerate(prefixes):
            table[i, : len(prefix)] = prefix
        lt.words_batch, lt.words_slots, lt.words_last = rows, slots[rows], np.asarray(last, dtype=np.int64)
        lt.words_starts, lt.words_prefixes, lt.words_prefix_lens = context_lens[rows] - lens, table, lens

    def _history_for(self, width: int) -> torch.Tensor:
        """The token table, at least ``width`` positions wide: it grows with the contexts
        (doubling, up to ``max_model_len``) instead of holding ``max_model_len`` for every slot
        from the start. A step in flight still writes the old table: the copy runs after it."""
        old = self.history
        if old is not None and old.shape[1] >= width:
            return old
        columns = min(
            self.max_model_len, max(width, _MIN_HISTORY, 2 * old.shape[1] if old is not None else 0)
        )
        self.history = torch.zeros(len(self.uses), columns, dtype=torch.int32, device=self.device)
        if old is not None:
            self.history[:, : old.shape[1]] = old
        return self.history

    def _write_pending(self, lt: LogitsTensors) -> None:
        lengths = np.fromiter((len(t) for _, t in self.pending), dtype=np.int64, count=len(self.pending))
        lt.history_slots = np.repeat([slot for slot, _ in self.pending], lengths)
        lt.history_pos = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        lt.history_tokens = np.concatenate([t for _, t in self.pending]).astype(np.int32)
        self.pending = []

    def _penalties(
        self,
        lt: LogitsTensors,
        slots: np.ndarray,
        context_lens: np.ndarray,
        prompt_lens: np.ndarray,
        batch: np.ndarray,
    ) -> None:
        batch_slots = slots[batch]
        repetition = self.repetition[batch_slots]
        frequency, presence = self.frequency[batch_slots], self.presence[batch_slots]
        keep = (repetition != 1) | (frequency != 0) | (presence != 0)
        if not keep.any():
            return
        batch, batch_slots = batch[keep], batch_slots[keep]
        lens = context_lens[batch]
        lt.penalized, lt.penalized_slots, lt.context_lens = batch, batch_slots, lens
        lt.prompt_lens = prompt_lens[batch]
        lt.width = int(lens.max())
        if (repetition[keep] != 1).any():
            lt.repetition = repetition[keep]
        if (frequency[keep] != 0).any() or (presence[keep] != 0).any():
            lt.frequency, lt.presence = frequency[keep], presence[keep]

    def _records(
        self, lt: LogitsTensors, slots: np.ndarray, context_lens: np.ndarray, batch: np.ndarray
    ) -> None:
        """Where the rows that keep a history write their samples: real next tokens only."""
        batch = batch[self.keeps_history[slots[batch]]]
        batch_slots, lens = slots[batch], context_lens[batch]
        real = (lens >= self.num_known[batch_slots]) & (lens < self.max_model_len)
        if real.any():
            lt.record_batch, lt.record_slots = batch[real], batch_slots[real]
            lt.record_pos = lens[real]
