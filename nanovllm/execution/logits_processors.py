"""Per-request logits processing before sampling: allowed tokens, logit bias, min_tokens and
repetition / frequency / presence penalties, batched over the rows that use each.

Penalties need each row's tokens, which a step planned ahead may only have on the device, so
rows that penalise repeats keep their token ids by position in a device table: the prompt
(and, after preemption, the tokens generated before) is written when a sequence takes the
row, every sampled token at its position right after sampling. A batch row computing
``context_len`` tokens reads positions ``[0, context_len)``; the completion starts at the
row's ``num_prompt_tokens``. A row taken over thus starts with an empty history, unwritten.
"""

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.scheduling.step import NewRow

_NO_IDS = np.empty(0, dtype=np.int64)


@dataclass(slots=True)
class LogitsTensors:
    """One batch's logits processing on the logits' device; a part no row uses is None.

    Rows are batch rows; ``(x_batch, x_ids)`` pairs name one token of one row.
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
    history: torch.Tensor | None = None
    """``[rows, max_model_len]`` token ids by position, of the rows that penalise repeats."""
    history_rows: torch.Tensor | None = None
    """Known tokens of rows taken this step, to write into ``history`` before reading it."""
    history_pos: torch.Tensor | None = None
    history_tokens: torch.Tensor | None = None
    penalized: torch.Tensor | None = None
    """Batch rows with a penalty, their table rows, prompt lengths and context lengths."""
    penalized_rows: torch.Tensor | None = None
    prompt_lens: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    width: int = 0
    """Largest of ``context_lens``: the table columns a batch reads."""
    repetition: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    record_batch: torch.Tensor | None = None
    """Batch rows whose sample is a real next token (not a prompt chunk's), and where it goes."""
    record_rows: torch.Tensor | None = None
    record_pos: torch.Tensor | None = None


def process_logits(logits: torch.Tensor, lt: LogitsTensors) -> torch.Tensor:
    """float32 logits after allowed_token_ids, logit_bias, min_tokens, then the penalties;
    ``logits`` itself is left as it is."""
    logits = logits.to(torch.float32, copy=True)
    if lt.history_rows is not None:
        lt.history.index_put_((lt.history_rows, lt.history_pos), lt.history_tokens)
    if lt.allowed_batch is not None:
        keep = torch.zeros(len(lt.allowed_batch), logits.shape[1], dtype=torch.bool, device=logits.device)
        keep[lt.allowed_of, lt.allowed_ids] = True
        logits[lt.allowed_batch] = logits[lt.allowed_batch].masked_fill_(~keep, float("-inf"))
    if lt.bias_batch is not None:
        logits.index_put_((lt.bias_batch, lt.bias_ids), lt.bias_values, accumulate=True)
    if lt.banned_batch is not None:
        logits[lt.banned_batch, lt.banned_ids] = float("-inf")
    if lt.penalized is not None:
        logits[lt.penalized] = _penalize(logits[lt.penalized], lt)
    return logits


def _penalize(logits: torch.Tensor, lt: LogitsTensors) -> torch.Tensor:
    """Penalties on the penalised rows' logits; positions a row does not use go to a spare
    column ``vocab``, dropped after the scatter."""
    vocab = logits.shape[1]
    tokens = lt.history[lt.penalized_rows, : lt.width].long()
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
        values = sampled[lt.record_batch].to(lt.history.dtype)
        lt.history.index_put_((lt.record_rows, lt.record_pos), values)


def _ragged(lengths: np.ndarray, rows: np.ndarray, batch: np.ndarray, *per_row: np.ndarray):
    """``(batch row of each entry, *entries)`` of batch rows ``batch`` (table rows ``rows[batch]``),
    None when they have none."""
    counts = lengths[rows[batch]]
    if not counts.any():
        return None
    batch = batch[counts > 0]
    return np.repeat(batch, counts[counts > 0]), *(np.concatenate(t[rows[batch]]) for t in per_row)


class LogitsRows:
    """Each row's logits-processing parameters (host) and the token table of the rows that
    penalise repeats (device, allocated when a row first needs it)."""

    def __init__(self, num_rows: int, max_model_len: int, eos_token_ids: tuple[int, ...], device):
        self.max_model_len, self.device = max_model_len, device
        self.eos = np.asarray(eos_token_ids, dtype=np.int64)
        self.uses = np.zeros(num_rows, dtype=bool)
        self.any_use = False
        self.num_prompt_tokens = np.zeros(num_rows, dtype=np.int64)
        self.num_known = np.zeros(num_rows, dtype=np.int64)
        """Tokens written into the table when the row was taken: a prompt chunk ending
        before them samples nothing real."""
        self.repetition = np.ones(num_rows, dtype=np.float32)
        self.frequency = np.zeros(num_rows, dtype=np.float32)
        self.presence = np.zeros(num_rows, dtype=np.float32)
        self.min_tokens = np.zeros(num_rows, dtype=np.int64)
        self.banned, self.num_banned = self._ragged_table(num_rows)
        self.allowed, self.num_allowed = self._ragged_table(num_rows)
        self.bias_ids, self.num_bias = self._ragged_table(num_rows)
        self.bias_values = self._ragged_table(num_rows)[0]
        self.history: torch.Tensor | None = None
        self.pending: list[tuple[int, list[int]]] = []

    @staticmethod
    def _ragged_table(num_rows: int) -> tuple[np.ndarray, np.ndarray]:
        per_row = np.empty(num_rows, dtype=object)
        per_row[:] = [_NO_IDS] * num_rows
        return per_row, np.zeros(num_rows, dtype=np.int64)

    def update(self, new_rows: list[NewRow]) -> None:
        """Keep the parameters of the sequences that took rows this step. A row that uses
        none is only marked so: every other array is read through ``uses``."""
        for r in new_rows:
            p, row = r.params, r.row
            penalized = p.penalizes_repeats
            self.uses[row] = penalized or p.min_tokens > 0 or bool(p.allowed_token_ids or p.logit_bias)
            if not self.uses[row]:
                continue
            if penalized:
                if r.token_ids is None:
                    raise ValueError(f"row {row} penalises repeats but was sent no token ids")
                self.pending.append((row, r.token_ids))
            self.num_prompt_tokens[row] = r.num_prompt_tokens
            self.num_known[row] = len(r.token_ids) if penalized else r.num_prompt_tokens
            self.repetition[row] = p.repetition_penalty
            self.frequency[row], self.presence[row] = p.frequency_penalty, p.presence_penalty
            self.min_tokens[row] = p.min_tokens
            stop = np.asarray(p.stop_token_ids, dtype=np.int64)
            self._set(self.banned, self.num_banned, row, stop if p.ignore_eos else np.union1d(self.eos, stop))
            self._set(self.allowed, self.num_allowed, row, p.allowed_token_ids or ())
            self._set(self.bias_ids, self.num_bias, row, list(p.logit_bias or ()))
            self.bias_values[row] = np.fromiter((p.logit_bias or {}).values(), dtype=np.float32)
        if new_rows:
            self.any_use = bool(self.uses.any())

    @staticmethod
    def _set(per_row: np.ndarray, lengths: np.ndarray, row: int, ids) -> None:
        per_row[row] = np.asarray(ids, dtype=np.int64)
        lengths[row] = len(per_row[row])

    def arrays(self, rows: np.ndarray, context_lens: np.ndarray) -> dict[str, np.ndarray]:
        """The batch's host arrays (names start with ``lp_``); empty when no row uses any."""
        if not self.any_use:
            return {}
        out: dict[str, np.ndarray] = {}
        batch = np.flatnonzero(self.uses[rows])
        if not batch.size:
            return out
        if self.pending:
            self._write_pending(out)
        pairs = _ragged(self.num_allowed, rows, batch, self.allowed)
        if pairs is not None:
            allowed, out["lp_allowed_of"] = np.unique(pairs[0], return_inverse=True)
            out["lp_allowed_batch"], out["lp_allowed_ids"] = allowed, pairs[1]
        pairs = _ragged(self.num_bias, rows, batch, self.bias_ids, self.bias_values)
        if pairs is not None:
            out["lp_bias_batch"], out["lp_bias_ids"], out["lp_bias_values"] = pairs
        generated = context_lens - self.num_prompt_tokens[rows]
        held = batch[generated[batch] < self.min_tokens[rows[batch]]]
        pairs = _ragged(self.num_banned, rows, held, self.banned)
        if pairs is not None:
            out["lp_banned_batch"], out["lp_banned_ids"] = pairs
        self._penalty_arrays(out, rows, context_lens, batch)
        return out

    def _write_pending(self, out: dict[str, np.ndarray]) -> None:
        if self.history is None:
            num_rows = len(self.uses)
            self.history = torch.zeros(num_rows, self.max_model_len, dtype=torch.int32, device=self.device)
        lengths = np.fromiter((len(t) for _, t in self.pending), dtype=np.int64, count=len(self.pending))
        out["lp_history_rows"] = np.repeat([row for row, _ in self.pending], lengths)
        out["lp_history_pos"] = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        out["lp_history_tokens"] = np.concatenate([t for _, t in self.pending]).astype(np.int32)
        self.pending = []

    def _penalty_arrays(self, out, rows: np.ndarray, context_lens: np.ndarray, batch: np.ndarray) -> None:
        table_rows = rows[batch]
        repetition = self.repetition[table_rows]
        frequency, presence = self.frequency[table_rows], self.presence[table_rows]
        keep = (repetition != 1) | (frequency != 0) | (presence != 0)
        if not keep.any():
            return
        batch, table_rows = batch[keep], table_rows[keep]
        lens = context_lens[batch]
        out.update(lp_penalized=batch, lp_penalized_rows=table_rows, lp_context_lens=lens)
        out["lp_prompt_lens"] = self.num_prompt_tokens[table_rows]
        if (repetition[keep] != 1).any():
            out["lp_repetition"] = repetition[keep]
        if (frequency[keep] != 0).any() or (presence[keep] != 0).any():
            out["lp_frequency"], out["lp_presence"] = frequency[keep], presence[keep]
        real = (lens >= self.num_known[table_rows]) & (lens < self.max_model_len)
        if real.any():
            out["lp_record_batch"], out["lp_record_rows"] = batch[real], table_rows[real]
            out["lp_record_pos"] = lens[real]

    def tensors(self, dev: dict[str, torch.Tensor], host: dict[str, np.ndarray]) -> LogitsTensors | None:
        """The batch's :class:`LogitsTensors` from its uploaded arrays; None when it has none."""
        if not any(name.startswith("lp_") for name in host):
            return None
        lt = LogitsTensors(**{name[3:]: t for name, t in dev.items() if name.startswith("lp_")})
        lt.history = self.history
        if "lp_context_lens" in host:
            lt.width = int(host["lp_context_lens"].max())
        return lt
