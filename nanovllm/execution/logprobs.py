"""Log-probabilities of sampled tokens (or prompt tokens) and of each row's most likely ones."""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.scheduling.step import PromptLogprobsRow

_PROMPT_CHUNK = 1024  # positions whose full-vocabulary logits are held at once


@dataclass(slots=True)
class TokenLogprobs:
    """A step's log-probabilities, row by row, from the model's raw logits (before
    temperature, penalties and filters, as vLLM reports them by default)."""

    sampled: torch.Tensor
    """``[rows]``: the log-probability of each row's sampled token (or prompt token)."""
    top_ids: torch.Tensor
    """``[rows, k]``: each row's ``k`` most likely token ids, most likely first."""
    top_logprobs: torch.Tensor
    """``[rows, k]``: their log-probabilities."""

    def tolist(self) -> list[tuple[float, list[int], list[float]]]:
        """Per row: (sampled token's log-probability, top ids, their log-probabilities)."""
        return list(zip(self.sampled.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist()))


def token_logprobs(logits: torch.Tensor, sampled: torch.Tensor, k: int) -> TokenLogprobs:
    """``k`` (the largest top-k any row of the batch asks for) may be 0: the sampled token only."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], sampled[:, None][:, :0])
    return TokenLogprobs(logprobs.gather(1, sampled[:, None]).squeeze(1), top_ids, top_logprobs)


def prompt_logprobs(
    hidden: torch.Tensor,
    num_tokens: list[int],
    rows: list[PromptLogprobsRow],
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
) -> TokenLogprobs | None:
    """Log-probabilities of the prompt tokens ``rows`` ask for, one entry per target in
    ``rows`` order, from the step's hidden states of every input token (``num_tokens`` per
    batch row). ``compute_logits`` may be collective (tensor parallelism): every rank calls
    it alike; ranks it gives no logits return None."""
    starts = np.concatenate(([0], np.cumsum(num_tokens)[:-1]))
    index = np.concatenate([starts[r.batch_row] + np.arange(len(r.target_ids)) for r in rows])
    index = torch.from_numpy(index).to(hidden.device)
    targets = torch.tensor([t for r in rows for t in r.target_ids], device=hidden.device)
    k = max(r.k for r in rows)
    parts = []
    for i in range(0, len(index), _PROMPT_CHUNK):
        logits = compute_logits(hidden[index[i : i + _PROMPT_CHUNK]])
        if logits is not None:
            parts.append(token_logprobs(logits, targets[i : i + _PROMPT_CHUNK], k))
    if not parts:
        return None
    columns = zip(*((p.sampled, p.top_ids, p.top_logprobs) for p in parts))
    return TokenLogprobs(*(torch.cat(column) for column in columns))
