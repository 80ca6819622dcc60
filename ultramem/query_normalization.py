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
    "running_center"  minus the running mean, in training too: the mean lags the component it removes while that
                      grows, and the layer collapses anyway
    "batch_norm"      PKM's BatchNorm without affine: each feature standardised (batch statistics in training)
    "batch_whiten"    each (head, query, Tucker part) block of the query whitened: (q - mean) C^(-1/2) with the block's
                      covariance C (the batch's in training, without a gradient through C^(-1/2); the running one at
                      inference), shrunk towards its median eigenvalue by `WHITENING_SHRINKAGE`
    "running_whiten"  the same whitening by the running statistics in training too: no token's query depends on the
                      rest of its batch, so micro-batches and adapters compute what training did, but the running
                      mean lags while the shared component grows, and at small scale retrieval collapsed (design.md)

At inference every mode is per token (the running statistics are constants), so cached generation equals
recomputation, and linear: the memory query folds it into its projection (`QueryNormalization.folded`), one GEMM.

When the statistics change: only in training. The model's training forward (train mode, gradients on) gathers each
layer's sums about its running mean (`collecting_statistics`, around its blocks only, so gradient checkpointing's
recomputation in the backward adds nothing); a forward under `no_grad` (`generate`, `pipeline`, evaluation, a sampling
callback) gathers nothing and normalises as inference does, in train mode too. The sums fold into the running
statistics right after the optimizer's step (a post-hook on every `torch.optim` optimizer), so the micro-batches of one
step fold together and every checkpoint, evaluation and health log between steps reads what training will use next.
The sums are float64, so their order (one process or several, one instruction set or another) does not change the
float32 statistics; with several processes they are summed over the default process group first (one all-reduce per
step for all layers), so every rank holds the statistics of the global batch, as one process would. They are no
buffers: DDP's buffer broadcast would overwrite the other ranks' with rank 0's.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
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

    Buffers: `running_mean` (G * P), `running_cov` (G, P, P), `whitening` = its shrunk inverse square root, and
    `batches_tracked`. The running statistics average the first 1/momentum steps cumulatively, then exponentially
    (BatchNorm's momentum, with its cumulative start). `pending`: the float64 sums gathered since the last fold.
    """

    def __init__(self, num_blocks: int, block_dim: int, mode: QueryNorm, momentum: float, eps: float):
        super().__init__()
        self.mode, self.momentum, self.eps = mode, momentum, eps
        self.num_blocks, self.block_dim = num_blocks, block_dim
        self.register_buffer("running_mean", torch.zeros(num_blocks * block_dim))
        for name in ("running_cov", "whitening"):
            self.register_buffer(name, torch.zeros(num_blocks, block_dim, block_dim))
        self.register_buffer("batches_tracked", torch.zeros((), dtype=torch.long))
        self.collecting = False  # set around the model's training forward (`collecting_statistics`)
        self.pending: torch.Tensor | None = None  # (G P + G P P + 1,) float64, `pending_sums`' layout
        self.init_ultramem()

    def init_ultramem(self) -> None:
        """No statistics yet: zero mean and identity covariance, so every mode starts as the identity at inference."""
        for name in ("running_mean", "batches_tracked"):
            init.zeros_(getattr(self, name))
        self.pending = None
        identity = torch.eye(self.block_dim).expand(self.num_blocks, -1, -1)
        init.copy_(self.running_cov, identity)
        init.copy_(self.whitening, identity)

    def forward(
        self, query: torch.Tensor, padding_mask: torch.Tensor | None = None, training_step: bool | None = None
    ) -> torch.Tensor:
        """query (..., G * P), e.g. (B, T, G * P); padding_mask (B, T), 0 at tokens the statistics leave out (padding).
        `training_step`: whether the model's forward is one of training (train mode, gradients on, decided where it
        starts: reentrant checkpointing runs the layers under no_grad, then again with gradients); None: grad mode."""
        training_step = torch.is_grad_enabled() if training_step is None else training_step
        batch_statistics = self.mode not in RUNNING_MODES and self.training and training_step
        if not (self.collecting or batch_statistics):  # inference, or a model left in train mode under no_grad
            return self._normalized(query, self.running_mean, self.running_cov, self.whitening)
        tokens = query.float().flatten(0, -2)  # (N, G * P)
        weight = torch.ones_like(tokens[:, :1]) if padding_mask is None else padding_mask.reshape(-1, 1).float()
        # Moments about the running mean (the same on every rank, so sums still add over ranks): raw moments lose the
        # spread to float32 cancellation when the component every token shares dwarfs it, as it does in a collapsing
        # residual stream (tiny-memoryplus after 120 steps: 93% of the memory input's variance on one direction).
        # Summed in float64, where each float32 product is exact: the order of the sums (one process or several, one
        # instruction set or another) no longer moves the statistics, which whitening amplifies
        shift = self.running_mean.float()
        exact_dtype = _exact(tokens.device)
        exact, weight = (tokens - shift).to(exact_dtype), weight.to(exact_dtype)
        blocks = exact.detach().unflatten(-1, (self.num_blocks, self.block_dim))  # (N, G, P)
        moment = torch.einsum("ngi,ngj->gij", blocks * weight.unsqueeze(-1), blocks)  # no gradient: see below
        linear, count = (exact * weight).sum(0), weight.sum().reshape(1)
        if self.collecting:
            self._gather(torch.cat([linear.detach(), moment.flatten(), count]))
        if not batch_statistics:  # the running modes: what inference computes, no token depends on its batch
            return self._normalized(query, self.running_mean, self.running_cov, self.whitening)
        # The batch is every rank's tokens, as with SyncBatchNorm: several processes compute what one would. Gradients
        # flow through the mean and squares (as through BatchNorm's statistics), not through the whitening matrix
        squares = [(exact.square() * weight).sum(0)] if self.mode == BATCH_NORM else []  # whitening uses `moment`
        sums = _summed_over_ranks(torch.cat([linear, *squares, count]))
        moment = _summed_over_ranks(moment.contiguous(), differentiable=False)
        count = sums[-1].clamp_min(1.0)
        offset = sums[: linear.numel()] / count  # the batch's mean - shift
        mean = shift + offset.float()
        # The batch's covariance is trusted N / (N + P) for N tokens: the running one weighs as P tokens more. A few
        # tokens span few of a block's P directions, and whitening by their covariance alone amplified the empty ones
        # (gradient norm 87,000 at 4 tokens against 12 unnormalised, tiny-ultramem); from 16 P tokens on (512 in the
        # main job's steps) the batch's is 94% or more of it
        trust = (count / (count + self.block_dim)).detach()
        if self.mode == BATCH_NORM:
            squares = sums[linear.numel() : -1] / count  # mean squared deviation from shift
            running_var = torch.diagonal(self.running_cov, dim1=-2, dim2=-1).flatten().to(squares.dtype)
            var = trust * (squares - offset.square()).clamp_min(0.0) + (1 - trust) * running_var
            return ((query.float() - mean) * torch.rsqrt(var + self.eps).float()).to(query.dtype)
        centre = offset.detach().view(self.num_blocks, -1)
        cov = moment / count.detach() - centre.unsqueeze(-1) * centre.unsqueeze(-2)
        cov = trust * cov + (1 - trust) * self.running_cov.to(cov.dtype)
        return self._normalized(query, mean, cov, inverse_square_root(cov, self.eps))

    def _gather(self, sums: torch.Tensor) -> None:
        """Add a forward's float64 sums (`pending_sums` layout, about the running mean, which stays put until the next
        fold) to the pending ones. Tensor arithmetic only: no host synchronisation."""
        self.pending = sums if self.pending is None else self.pending + sums
        _GATHERED[id(self)] = weakref.ref(self)

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
        """(G P + G P P + 1,) float64: the sum of the gathered tokens minus the running mean, of their blocks' outer
        products, and their count, which add up over ranks (zeros when nothing was gathered)."""
        if self.pending is not None:
            return self.pending
        size = self.running_mean.numel() + self.running_cov.numel() + 1
        return torch.zeros(size, dtype=_exact(self.running_mean.device), device=self.running_mean.device)

    @torch.no_grad()
    def fold(self, sums: torch.Tensor) -> None:
        """Fold summed statistics (`pending_sums` layout) into the running ones and empty the pending sums; no tokens
        change nothing. Tensor arithmetic only: no host synchronisation in the training step."""
        self.pending = None
        exact = _exact(self.running_mean.device)
        sums = sums.to(exact)
        seen = sums[-1] > 0
        count = sums[-1].clamp_min(1.0)
        features = self.running_mean.numel()
        offset = sums[:features] / count  # the mean minus the running mean the sums are about
        moment = sums[features:-1].view(self.running_cov.shape) / count
        # the spread about the mean the forward subtracted: the running one, whose lag behind a drifting component
        # then counts as spread (whitening shrinks it instead of amplifying it), or the batch's own
        blocks = offset.view(self.num_blocks, -1)
        cov = moment if self.mode in RUNNING_MODES else moment - blocks.unsqueeze(-1) * blocks.unsqueeze(-2)
        self.batches_tracked += seen.long()
        weight = torch.where(seen, (1.0 / self.batches_tracked.clamp_min(1)).clamp_min(self.momentum), 0.0)
        running_mean = self.running_mean.to(exact)
        self.running_mean.copy_(running_mean + weight * offset)  # lerp from the running mean to the mean
        self.running_cov.copy_(self.running_cov.to(exact).lerp(cov, weight))
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


@contextmanager
def collecting_statistics(norms: Iterable[QueryNormalization]) -> Iterator[None]:
    """Within it, the normalisations add the statistics of their queries to their pending sums (the model's training
    forward, around its blocks; `recalibrate_query_statistics`)."""
    norms = list(norms)
    before = [norm.collecting for norm in norms]
    for norm in norms:
        norm.collecting = True
    try:
        yield
    finally:
        for norm, collecting in zip(norms, before):
            norm.collecting = collecting


@torch.no_grad()
def update_running_statistics(norms: Iterable[QueryNormalization]) -> None:
    """Fold every layer's pending sums into its running statistics (after each optimizer step, `_fold_after_step`).

    With an initialised process group of several ranks the sums are added over it first, in one all-reduce for all
    layers: every rank then holds the statistics of the global batch. Every rank must call it with the same layers in
    the same order.
    """
    norms = list(norms)
    if not norms:
        return
    pending = [norm.pending_sums() for norm in norms]
    sums = torch.cat(pending)
    if _distributed():
        dist.all_reduce(sums)
    for norm, summed in zip(norms, sums.split([part.numel() for part in pending])):
        norm.fold(summed)


# The normalisations that gathered since the last optimizer step, in the order they first did (a training forward's
# layer order: the same on every rank, as the all-reduce needs)
_GATHERED: dict[int, weakref.ref[QueryNormalization]] = {}


def _fold_after_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    norms = [norm for norm in (ref() for ref in _GATHERED.values()) if norm is not None]
    _GATHERED.clear()
    update_running_statistics(norms)


# After every `torch.optim` optimizer's step in this process (DeepSpeed's and Accelerate's wrappers call one; the
# micro-steps Accelerate skips under gradient accumulation do not): the statistics change once a step, as the weights
register_optimizer_step_post_hook(_fold_after_step)


@torch.no_grad()
def recalibrate_query_statistics(model: nn.Module, batches: Iterable[torch.Tensor | Mapping[str, torch.Tensor]]) -> int:
    """Recompute every query normalisation's running statistics with the model's current weights: their plain average
    over `batches` (input ids (B, T), or mappings of the model's inputs, whose `attention_mask` leaves padding out),
    the weights untouched. Returns the number of layers.

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
            norm.pending = None
        model.train()
        for batch in batches:
            inputs = dict(batch) if isinstance(batch, Mapping) else {"input_ids": batch}
            with collecting_statistics(norms):
                model(**inputs, use_cache=False)
            update_running_statistics(norms)
    finally:
        for norm, momentum in zip(norms, momenta):
            norm.momentum = momentum
        model.train(was_training)
    return len(norms)


def normalises_by_batch_statistics(model: nn.Module) -> bool:
    """Whether any query normalisation of `model` uses batch statistics in training ("batch_norm", "batch_whiten"):
    then inference reads running statistics that training never used, which `recalibrate_query_statistics` brings up
    to date. The running modes need none: training computes with the statistics inference reads."""
    return any(isinstance(m, QueryNormalization) and m.mode not in RUNNING_MODES for m in model.modules())


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


def _exact(device: torch.device) -> torch.dtype:
    """float64 for the statistics' sums, where the device has it (Apple's MPS has not: float32 there)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
