"""Log-probabilities of sampled tokens and of each row's most likely ones."""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class TokenLogprobs:
    """A step's log-probabilities, row by row, from the model's raw logits (before
    temperature, penalties and filters, as vLLM reports them by default)."""

    sampled: torch.Tensor
    """``[rows]``: the log-probability of each row's sampled token."""
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
