"""Vocabulary-parallel embedding and LM head."""

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.parallel import TPGroup, copy_weight, divide, shard_of


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary; other ids embed to zero."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup = TPGroup()):
        super().__init__()
        self.tp = tp
        self.num_per_rank = divide(num_embeddings, tp.size)
        self.vocab_start = self.num_per_rank * tp.rank
        self.weight = nn.Parameter(torch.empty(self.num_per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_weight(param.data, shard_of(loaded, 0, self.tp, self.num_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(x, self.weight)
        local = x - self.vocab_start
        mask = (local >= 0) & (local < self.num_per_rank)
        y = F.embedding(local.clamp(0, self.num_per_rank - 1), self.weight) * mask.unsqueeze(-1)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the given hidden states; the full vocabulary is assembled on rank 0."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup = TPGroup()):
        super().__init__(num_embeddings, embedding_dim, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.tp.gather_to_first(F.linear(x, self.weight))
