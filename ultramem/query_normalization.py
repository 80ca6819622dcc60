"""Across-token normalisation of a memory layer's query, which keeps retrieval spread over the whole table.

Why: a component shared by all tokens grows in the residual stream as training starts. The memory layer's pre-norm and
the query's LayerNorm are per token, so that component survives into every query; the queries of all tokens then point
the same way and every token reads the same few rows (measured on `tiny-ultramem` after 120 steps: the second memory
layer reads 2.7% of its rows, the inputs' mean cosine across tokens is 0.54; docs/design.md). Product Key Memory
(Lample et al. 2019) met the same collapse and put BatchNorm on the query.

Modes (`UltraMemConfig.query_norm`):
    "none"            the paper's query (and every checkpoint saved before the field existed)
    "running_center"  q - mu, mu a running mean of the queries over training batches. The same subtraction in training
                      and inference, so no token's query depends on other tokens of its batch (causal; the decode cache
                      stays exact) and training computes what inference computes.
    "batch_norm"      PKM's BatchNorm without affine: each feature standardised by the batch's mean and variance in
                      training (a token's query then depends on the whole batch), by running ones at inference.

Running statistics are updated from the batch statistics of the previous training forward, at the start of the next
one (`UltraMemModel.forward` calls `update_running_statistics`), never inside a forward: a layer that gradient
checkpointing recomputes in the backward sees the statistics its forward saw. The pending statistics are buffers, so a
checkpoint saved between two steps resumes exactly; with several processes they are summed over the default process
group first (one all-reduce per training forward for all layers), so every rank holds the statistics of the global
batch, as one process would.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from transformers import initialization as init

from .configuration_ultramem import BATCH_NORM, RUNNING_CENTER, QueryNorm


class QueryNormalization(nn.Module):
    """Removes what the queries of all tokens share: (..., F) -> (..., F), F = heads x queries x key dim.

    Buffers: `running_mean`, `running_var` (F,) and `batches_tracked`; `pending_mean`, `pending_square` (F,) and
    `pending_count`: the last training forward's statistics, not yet folded into the running ones (the count is an
    integer buffer, so a model cast to bfloat16 still weighs ranks exactly). The running statistics average the first
    1/momentum batches cumulatively, then exponentially (BatchNorm's momentum, with its cumulative start), so the first
    steps are not pulled towards the zero they start from.
    """

    def __init__(self, features: int, mode: QueryNorm, momentum: float, eps: float):
        super().__init__()
        self.mode = mode
        self.momentum = momentum
        self.eps = eps
        for name in ("running_mean", "running_var", "pending_mean", "pending_square"):
            self.register_buffer(name, torch.zeros(features))
        self.register_buffer("batches_tracked", torch.zeros((), dtype=torch.long))
        self.register_buffer("pending_count", torch.zeros((), dtype=torch.long))
        self.init_ultramem()

    def init_ultramem(self) -> None:
        """No statistics yet: the identity for "running_center", unit variance for "batch_norm" at inference."""
        for name in ("running_mean", "pending_mean", "pending_square", "batches_tracked", "pending_count"):
            init.zeros_(getattr(self, name))
        init.ones_(self.running_var)

    def forward(self, query: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """query (B, T, F); padding_mask (B, T), 0 at padded tokens, which the statistics leave out."""
        if not self.training:
            return self._normalized(query, self.running_mean, self.running_var)
        tokens = query.float().flatten(0, -2)  # (B*T, F)
        weight = torch.ones_like(tokens[:, :1]) if padding_mask is None else padding_mask.reshape(-1, 1).float()
        count = weight.sum().clamp_min(1.0)
        mean = (tokens * weight).sum(0) / count  # gradients flow through the batch's statistics, as BatchNorm's do
        square = (tokens.detach().square() * weight).sum(0) / count
        self.pending_mean.copy_(mean.detach())
        self.pending_square.copy_(square)
        self.pending_count.copy_(weight.sum().long())
        if self.mode == RUNNING_CENTER:
            return self._normalized(query, self.running_mean, None)
        var = ((tokens - mean).square() * weight).sum(0) / count if self.mode == BATCH_NORM else None
        return self._normalized(query, mean, var)

    def _normalized(self, query: torch.Tensor, mean: torch.Tensor, var: torch.Tensor | None) -> torch.Tensor:
        if self.mode != BATCH_NORM:
            return query - mean.to(query.dtype)
        return ((query.float() - mean.float()) * torch.rsqrt(var.float() + self.eps)).to(query.dtype)

    def pending_sums(self) -> torch.Tensor:
        """(2F + 1,) float32: the pending sum, sum of squares and token count, which add up across ranks."""
        count = self.pending_count.float()
        return torch.cat([self.pending_mean.float() * count, self.pending_square.float() * count, count[None]])

    @torch.no_grad()
    def fold(self, sums: torch.Tensor) -> None:
        """Fold summed statistics (`pending_sums` layout) of the last training batch into the running ones."""
        features = self.running_mean.numel()
        count = float(sums[-1])
        self.pending_count.zero_()
        if count <= 0:
            return
        mean = sums[:features] / count
        var = (sums[features:-1] / count - mean.square()).clamp_min(0.0)
        self.batches_tracked += 1
        weight = max(self.momentum, 1.0 / float(self.batches_tracked))
        self.running_mean.copy_(self.running_mean.float().lerp(mean, weight))
        self.running_var.copy_(self.running_var.float().lerp(var, weight))


@torch.no_grad()
def update_running_statistics(norms: Iterable[QueryNormalization]) -> None:
    """Fold every layer's pending statistics into its running ones: at the start of a training forward.

    With an initialised process group of several ranks the pending statistics are summed over it first, in one
    all-reduce for all layers: every rank then holds the statistics of the global batch. Every rank must call it
    (the model's training forward does, on every rank).
    """
    norms = list(norms)
    if not norms:
        return
    sums = torch.stack([norm.pending_sums() for norm in norms])  # (L, 2F + 1)
    if _distributed():
        dist.all_reduce(sums)
    for norm, summed in zip(norms, sums):
        norm.fold(summed)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
