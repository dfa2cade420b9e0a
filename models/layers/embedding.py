"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks.

Rank r holds rows [r*n, (r+1)*n) of the (vocab, hidden) table, n = ceil(vocab / size); the last
rank's tail past the vocabulary is zero. With size 1 the table is the checkpoint's, unpadded, and
forward is one F.embedding (one F.linear for the head), as the traced graph had before. A tied head
shares the embedding's Parameter (and so its weight_loader).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.parallel import SINGLE, ParallelInfo, all_gather, all_reduce
from models.quant.base import set_weight_attrs


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: ParallelInfo = SINGLE):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.parallel = num_embeddings, embedding_dim, parallel
        self.rows_per_rank = -(-num_embeddings // parallel.size)
        self.vocab_start = parallel.rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"an embedding table has no shards (got shard id {shard_id!r})")
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"has shape {tuple(loaded.shape)}, the model expects {expected}")
        n = max(0, self.vocab_end - self.vocab_start)
        param.data[:n].copy_(loaded[self.vocab_start : self.vocab_start + n])
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.size == 1:
            return F.embedding(input_ids, self.weight)
        # ids outside this rank's rows look up row 0 and are zeroed: the ranks' sum is the lookup
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_end - self.vocab_start)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(self.parallel, rows.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over this rank's vocabulary slice (TP: gathered and trimmed to the vocabulary)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight).float()
        if self.parallel.size == 1:
            return logits
        return all_gather(self.parallel, logits, -1)[..., : self.num_embeddings]  # the last rank's pad rows off

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("ParallelLMHead computes logits: call compute_logits(hidden)")
