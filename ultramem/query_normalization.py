"""Across-token normalisation of a memory layer's query, which keeps retrieval spread over the whole table.

Why: as training starts, a component shared by all tokens grows in the residual stream (on `tiny-ultramem`, from an
rms of 0.02 to 4.3 within 5 steps, from the blocks' outputs). The memory layer's pre-norm and the query's LayerNorm are
per token, so it survives into every query: the inputs of every memory layer but the first reach a mean cosine of
0.8-0.95 across tokens, and every token reads the same few rows. Removing the batch's mean is not enough: what varies
between tokens is then concentrated in a few directions (the top 3 of each 32-dim query part hold 75% of the variance,
against 41% in the first memory layer), and the layer still reads 0.2 of what uniform picks would. Whitening each
query part, as decorrelated batch normalisation does, spreads it again (0.57). Product Key Memory (Lample et al. 2019)
met the same collapse and put BatchNorm on the query. The measurements are in docs/design.md.

Modes (`UltraMemConfig.query_norm`), on the projected query before its per-part LayerNorm:
    "none"            the paper's query (and every checkpoint saved before the field existed)
    "batch_center"    minus the batch's mean in training, minus the running mean at inference
    "running_center"  minus the running mean in training too: no token's query depends on the rest of its batch, but
                      the mean lags the component it removes while that grows, and the layer collapses anyway
    "batch_norm"      PKM's BatchNorm without affine: each feature standardised (batch statistics in training)
    "batch_whiten"    each (head, query, Tucker part) block of the query whitened: (q - mean) C^(-1/2) with the block's
                      covariance C (the batch's in training, without a gradient through C^(-1/2); the running one at
                      inference), shrunk towards its median eigenvalue by `WHITENING_SHRINKAGE`

At inference every mode is per token (the running statistics are constants), so cached generation equals
recomputation, and linear: the memory query folds it into its projection (`QueryNormalization.folded`), one GEMM. Running statistics are updated from the statistics of the previous training forward, at the start of the
next one (`UltraMemModel.forward` calls `update_running_statistics`, for the layers whose query projection is trained:
a frozen one, as under LoRA, keeps the statistics it was saved with), never inside a forward: a layer that gradient
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

from .configuration_ultramem import BATCH_NORM, BATCH_WHITEN, RUNNING_CENTER, RUNNING_WHITEN, QueryNorm

# Whitening divides by the square root of (1 - s) C + s median_eigenvalue(C) I: directions with almost no variance are
# amplified at most 1/sqrt(s) times the typical one, not without bound (noise, and a running mean's small lag). The
# median, not the mean: one massive direction sets the mean and would flatten every other one (tiny-memoryplus: the
# query was rank one and its layers read 0.04 of what uniform picks would, 0.49 and 0.54 with the median)
WHITENING_SHRINKAGE = 0.01
RUNNING_MODES = (RUNNING_CENTER, RUNNING_WHITEN)  # the same computation in training and at inference
WHITENING_MODES = (BATCH_WHITEN, RUNNING_WHITEN)


class QueryNormalization(nn.Module):
    """Removes what the queries of all tokens share: (..., G * P) -> (..., G * P), G blocks of P features each (one
    block per head, query and Tucker part; `mode` says how, see the module docstring).

    Buffers: `running_mean` (G * P), `running_cov` (G, P, P), `whitening` = its shrunk inverse square root
    ("batch_whiten"), `batches_tracked`; `pending_mean`, `pending_moment` (G, P, P) and `pending_count`: the last
    training forward's mean, second moment about the running mean and token count, not yet folded into the running
    statistics (the count is an integer buffer, so a model cast to bfloat16 still weighs ranks exactly). The running statistics average the first
    1/momentum batches cumulatively, then exponentially (BatchNorm's momentum, with its cumulative start).
    """

    def __init__(self, num_blocks: int, block_dim: int, mode: QueryNorm, momentum: float, eps: float):
        super().__init__()
        self.mode, self.momentum, self.eps = mode, momentum, eps
        self.num_blocks, self.block_dim = num_blocks, block_dim
        for name in ("running_mean", "pending_mean"):
            self.register_buffer(name, torch.zeros(num_blocks * block_dim))
        for name in ("running_cov", "whitening", "pending_moment"):
            self.register_buffer(name, torch.zeros(num_blocks, block_dim, block_dim))
        self.register_buffer("batches_tracked", torch.zeros((), dtype=torch.long))
        self.register_buffer("pending_count", torch.zeros((), dtype=torch.long))
        self.init_ultramem()

    def init_ultramem(self) -> None:
        """No statistics yet: zero mean and identity covariance, so every mode starts as the identity at inference."""
        for name in ("running_mean", "pending_mean", "pending_moment", "batches_tracked", "pending_count"):
            init.zeros_(getattr(self, name))
        identity = torch.eye(self.block_dim).expand(self.num_blocks, -1, -1)
        init.copy_(self.running_cov, identity)
        init.copy_(self.whitening, identity)

    def forward(self, query: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """query (..., G * P), e.g. (B, T, G * P); padding_mask (B, T), 0 at padded tokens, which statistics leave out."""
        if not self.training:
            return self._normalized(query, self.running_mean, self.running_cov, self.whitening)
        tokens = query.float().flatten(0, -2)  # (N, G * P)
        weight = torch.ones_like(tokens[:, :1]) if padding_mask is None else padding_mask.reshape(-1, 1).float()
        # Moments about the running mean (the same on every rank, so sums still add over ranks): raw moments lose the
        # spread to float32 cancellation when the component every token shares dwarfs it, as it does in a collapsing
        # residual stream (tiny-memoryplus after 120 steps: 93% of the memory input's variance on one direction)
        shift = self.running_mean.float()
        shifted = tokens - shift
        # This rank's sums: shifted tokens, their squares (gradients flow through them, as through BatchNorm's
        # statistics), the count; and the blocks' outer products (no gradient: the whitening is a constant of the step)
        sums = torch.cat([(shifted * weight).sum(0), (shifted.square() * weight).sum(0), weight.sum().reshape(1)])
        blocks = shifted.detach().unflatten(-1, (self.num_blocks, self.block_dim))  # (N, G, P)
        moment = torch.einsum("ngi,ngj->gij", blocks * weight.unsqueeze(-1), blocks)
        local_count = sums[-1].detach().clamp_min(1.0)
        self.pending_mean.copy_(shift + sums[: tokens.shape[-1]].detach() / local_count)
        self.pending_moment.copy_(moment / local_count)
        self.pending_count.copy_(sums[-1].detach().long())
        if self.mode in RUNNING_MODES:  # what inference computes: no token's query depends on the rest of its batch
            return self._normalized(query, self.running_mean, self.running_cov, self.whitening)
        # The batch is every rank's tokens, as with SyncBatchNorm: several processes compute what one would
        sums, moment = _summed_over_ranks(sums), _summed_over_ranks(moment.contiguous(), differentiable=False)
        count = sums[-1].clamp_min(1.0)
        offset, squares = sums[:-1].view(2, -1) / count  # the batch's mean - shift, mean squared deviation from shift
        mean = shift + offset
        if self.mode == BATCH_NORM:
            var = (squares - offset.square()).clamp_min(0.0)
            return ((query.float() - mean) * torch.rsqrt(var + self.eps)).to(query.dtype)
        centre = offset.detach().view(self.num_blocks, -1)
        cov = moment / count.detach() - centre.unsqueeze(-1) * centre.unsqueeze(-2)
        return self._normalized(query, mean, cov, inverse_square_root(cov, self.eps))

    def _normalized(
        self, query: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor, whitening: torch.Tensor
    ) -> torch.Tensor:
        if self.mode == RUNNING_CENTER:
            return query - mean.to(query.dtype)
        return self._scaled(query.float() - mean.float(), cov, whitening).to(query.dtype)

    def _scaled(self, centred: torch.Tensor, cov: torch.Tensor, whitening: torch.Tensor) -> torch.Tensor:
        """The linear part of the normalisation, on float32 (..., G * P): each feature's 1/std, or each block times its
        whitening matrix."""
        if self.mode == BATCH_NORM:
            var = torch.diagonal(cov, dim1=-2, dim2=-1).flatten().float()
            return centred * torch.rsqrt(var + self.eps)
        if self.mode == RUNNING_CENTER:
            return centred
        blocks = centred.unflatten(-1, (self.num_blocks, self.block_dim))  # (..., G, P)
        return torch.einsum("...gi,gij->...gj", blocks, whitening.float()).flatten(-2)

    def statistics(self) -> tuple[torch.Tensor, ...]:
        """The buffers inference reads: what a linear map folded with this normalisation depends on."""
        return self.running_mean, self.running_cov, self.whitening

    def folded(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The inference normalisation folded into the linear map before it: W (G * P, D) -> (W', b) in W's dtype, with
        F.linear(x, W', b) = self(F.linear(x, W)) in eval mode. One GEMM then computes the normalised query at
        inference, and the bias is added before the GEMM's output is rounded, after the common component is removed."""
        scaled_weight = self._scaled(weight.float().T, self.running_cov, self.whitening).T  # (G * P, D)
        bias = self._scaled(-self.running_mean.float(), self.running_cov, self.whitening)
        return scaled_weight.to(weight.dtype), bias.to(weight.dtype)

    def pending_sums(self) -> torch.Tensor:
        """(G P + G P P + 1,) float32: the pending sum, sum of outer products about the running mean and token count,
        which add up over ranks."""
        count = self.pending_count.float()
        sums = (self.pending_mean.float() * count, self.pending_moment.float().flatten() * count, count[None])
        return torch.cat(sums)

    @torch.no_grad()
    def fold(self, sums: torch.Tensor) -> None:
        """Fold summed statistics (`pending_sums` layout) of the last training batch into the running ones; a batch of
        no tokens changes nothing. Tensor arithmetic only: no host synchronisation in the training step."""
        self.pending_count.zero_()
        seen = sums[-1] > 0
        count = sums[-1].clamp_min(1.0)
        features = self.running_mean.numel()
        mean = sums[:features] / count
        moment = sums[features:-1].view_as(self.running_cov) / count  # about the running mean (the forwards' shift)
        # the spread about the mean the forward subtracted: the running one, whose lag behind a drifting component
        # then counts as spread (whitening shrinks it instead of amplifying it), or the batch's own
        offset = (mean - self.running_mean.float()).view(self.num_blocks, -1)
        cov = moment if self.mode in RUNNING_MODES else moment - offset.unsqueeze(-1) * offset.unsqueeze(-2)
        self.batches_tracked += seen.long()
        weight = torch.where(seen, (1.0 / self.batches_tracked.clamp_min(1)).clamp_min(self.momentum), 0.0)
        self.running_mean.copy_(self.running_mean.float().lerp(mean, weight))
        self.running_cov.copy_(self.running_cov.float().lerp(cov, weight))
        if self.mode in WHITENING_MODES:
            self.whitening.copy_(inverse_square_root(self.running_cov.float(), self.eps))


def inverse_square_root(cov: torch.Tensor, eps: float) -> torch.Tensor:
    """((1 - s) C + s m I + eps I)^(-1/2) of symmetric (..., P, P) covariances, m the median eigenvalue, s the
    shrinkage: the symmetric (ZCA) whitening matrix, which rotates the query least."""
    eigenvalues, eigenvectors = torch.linalg.eigh(cov.double())
    eigenvalues = eigenvalues.clamp_min(0.0)
    typical = eigenvalues.median(-1, keepdim=True).values
    scale = ((1 - WHITENING_SHRINKAGE) * eigenvalues + WHITENING_SHRINKAGE * typical + eps).rsqrt()
    return ((eigenvectors * scale.unsqueeze(-2)) @ eigenvectors.transpose(-1, -2)).to(cov.dtype)


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
    sums = torch.stack([norm.pending_sums() for norm in norms])  # (L, G P + G P P + 1)
    if _distributed():
        dist.all_reduce(sums)
    for norm, summed in zip(norms, sums):
        norm.fold(summed)


@torch.no_grad()
def recalibrate_query_statistics(model: nn.Module, batches: Iterable[torch.Tensor]) -> int:
    """Recompute every query normalisation's running statistics with the model's current weights: their plain average
    over `batches` of input ids (B, T), in training mode, the weights untouched. Returns the number of layers.

    Why: the running statistics average batches seen while the weights moved, and the component they remove grows
    while training; with batch statistics in training ("batch_norm", "batch_whiten") inference then subtracts a stale
    mean, which whitening amplifies (measured on tiny-ultramem after 30 steps: the second memory layer reads 0.18 of
    what uniform picks would with the running statistics, 0.57 after recomputing them on 8 unseen training batches).
    BatchNorm's "precise statistics" (pycls, fvcore's `update_bn_stats`, `torch.optim.swa_utils.update_bn`) do the same.
    Collective with several ranks: every rank must call it with as many batches.
    """
    norms = [module for module in model.modules() if isinstance(module, QueryNormalization)]
    batches = list(batches)
    if not norms or not batches:
        return 0
    momenta = [norm.momentum for norm in norms]
    was_training = model.training
    try:
        for norm in norms:
            norm.momentum = 0.0  # weights 1, 1/2, 1/3, ...: the plain average
            norm.batches_tracked.zero_()
            norm.pending_count.zero_()
        model.train()
        for batch in batches:
            model(input_ids=batch, use_cache=False)
            update_running_statistics(norms)
    finally:
        for norm, momentum in zip(norms, momenta):
            norm.momentum = momentum
        model.train(was_training)
    return len(norms)


def _summed_over_ranks(tensor: torch.Tensor, differentiable: bool = True) -> torch.Tensor:
    """`tensor` summed over the default process group (itself in one process); its gradient flows back to every rank's
    part when `differentiable`."""
    if not _distributed():
        return tensor
    if differentiable:
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(tensor)
    tensor = tensor.clone()
    dist.all_reduce(tensor)
    return tensor


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
