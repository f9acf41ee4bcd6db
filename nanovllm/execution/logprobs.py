"""Log-probabilities of sampled tokens (or prompt tokens) and of each row's most likely ones."""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.scheduling.step import PromptLogprobsRequest, TokenLogprobs

_PROMPT_CHUNK = 1024  # positions whose full-vocabulary logits are held at once


@dataclass(slots=True)
class LogprobTensors:
    """A step's log-probabilities, row by row, from the model's raw logits (before
    temperature, penalties and filters, as vLLM reports them by default)."""

    sampled: torch.Tensor
    """``[rows]``: the log-probability of each row's sampled token (or prompt token)."""
    ranks: torch.Tensor
    """``[rows]``: its rank in the row's distribution, 1 for the most likely."""
    top_ids: torch.Tensor
    """``[rows, k]``: each row's ``k`` most likely token ids, most likely first."""
    top_logprobs: torch.Tensor
    """``[rows, k]``: their log-probabilities."""

    def to_host(self) -> "LogprobTensors":
        """A copy in pinned host memory, started without waiting for the device."""
        return LogprobTensors(*map(to_host, self.columns()))

    def columns(self) -> tuple[torch.Tensor, ...]:
        return self.sampled, self.ranks, self.top_ids, self.top_logprobs

    def tolist(self) -> list[TokenLogprobs]:
        """One entry per row."""
        return [TokenLogprobs(*entry) for entry in zip(*(c.tolist() for c in self.columns()))]


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in pinned host memory, copied without waiting for the device (as it is on CPU)."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def token_logprobs(logits: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobTensors:
    """``k`` (the largest top-k any row of the batch asks for) may be 0: the sampled token only."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], sampled[:, None][:, :0])
    # a row with no token (a negative marker) reads token 0's: its sequence ends without it
    chosen = logprobs.gather(1, sampled.clamp(min=0)[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    return LogprobTensors(chosen.squeeze(1), ranks, top_ids, top_logprobs)


def prompt_logprobs(
    hidden: torch.Tensor,
    num_tokens: list[int],
    requests: list[PromptLogprobsRequest],
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
) -> LogprobTensors | None:
    """Log-probabilities of the prompt tokens ``requests`` ask for, one entry per target in
    ``requests`` order, from the step's hidden states of every input token (``num_tokens`` per
    batch row). ``compute_logits`` may be collective (tensor parallelism): every rank calls
    it alike; ranks it gives no logits return None."""
    starts = np.concatenate(([0], np.cumsum(num_tokens)[:-1]))
    index = np.concatenate([starts[r.row] + np.arange(len(r.target_ids)) for r in requests])
    index = torch.from_numpy(index).to(hidden.device)
    targets = torch.tensor([t for r in requests for t in r.target_ids], device=hidden.device)
    k = max(r.k for r in requests)
    parts = []
    for i in range(0, len(index), _PROMPT_CHUNK):
        logits = compute_logits(hidden[index[i : i + _PROMPT_CHUNK]])
        if logits is not None:
            parts.append(token_logprobs(logits, targets[i : i + _PROMPT_CHUNK], k))
    if not parts:
        return None
    return LogprobTensors(*(torch.cat(column) for column in zip(*(p.columns() for p in parts))))
