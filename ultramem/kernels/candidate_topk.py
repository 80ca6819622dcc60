"""`tucker_candidate_topk` with the m x m scoring and top-m fused in Triton.

Same contract as `ultramem.memory_ops.tucker_candidate_topk` (the reference, and the fallback when
m exceeds what one program holds in registers). The kernel only returns the winners' indices;
their h per-core scores are recomputed here in PyTorch from (r, topk) gathered columns, which is
tiny and gives autograd w.r.t. row_scores, col_scores and cores for free.
"""

from __future__ import annotations

import torch

from ultramem.kernels._checks import FLOAT_DTYPES, check_dtype, check_same_device
from ultramem.kernels._device import require_launchable
from ultramem.memory_ops import tucker_candidate_topk as reference

MAX_CANDIDATES = 128  # the padded m x m grid (<= 128 x 128) of one program stays in registers


@torch.library.custom_op("ultramem::tucker_candidate_index", mutates_args=())
def _candidate_index_op(
    row_scores: torch.Tensor, col_scores: torch.Tensor, core_sum: torch.Tensor, topk: int
) -> torch.Tensor:
    from ultramem.kernels import _triton_candidate_topk  # lazy: see lookup_reduce._kernels

    return _triton_candidate_topk.candidate_index(row_scores, col_scores, core_sum, topk)


@_candidate_index_op.register_fake
def _(row_scores, col_scores, core_sum, topk):
    return row_scores.new_empty((row_scores.shape[0], topk), dtype=torch.int64)


def _check_inputs(row_scores: torch.Tensor, col_scores: torch.Tensor, cores: torch.Tensor, topk: int) -> None:
    for name, tensor in (("row_scores", row_scores), ("col_scores", col_scores), ("cores", cores)):
        check_dtype(name, tensor, FLOAT_DTYPES)
    check_same_device(row_scores=row_scores, col_scores=col_scores, cores=cores)
    if row_scores.dim() < 2 or col_scores.shape[-2:] != row_scores.shape[-2:]:
        raise ValueError(
            f"row_scores and col_scores must both be (..., r, m), got {tuple(row_scores.shape)} "
            f"and {tuple(col_scores.shape)}"
        )
    rank, num_candidates = row_scores.shape[-2:]
    if cores.dim() < 3 or cores.shape[-2:] != (rank, rank):
        raise ValueError(f"cores must be (..., h, r, r) with r = {rank}, got {tuple(cores.shape)}")
    if not isinstance(topk, int) or not 1 <= topk <= num_candidates**2:
        raise ValueError(f"topk must be an int in [1, {num_candidates**2}] (m * m), got {topk!r}")
    try:
        torch.broadcast_shapes(row_scores.shape[:-2], col_scores.shape[:-2], cores.shape[:-3])
    except RuntimeError as error:
        raise ValueError(
            f"the leading dims of row_scores {tuple(row_scores.shape[:-2])}, col_scores "
            f"{tuple(col_scores.shape[:-2])} and cores {tuple(cores.shape[:-3])} must broadcast"
        ) from error


def tucker_candidate_topk(
    row_scores: torch.Tensor,
    col_scores: torch.Tensor,
    cores: torch.Tensor,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact Tucker scores on the m x m candidates and the final top-m; see memory_ops for shapes."""
    _check_inputs(row_scores, col_scores, cores, topk)
    rank, num_candidates = row_scores.shape[-2:]
    if num_candidates > MAX_CANDIDATES:
        return reference(row_scores, col_scores, cores, topk)
    require_launchable(row_scores.device)
    lead = torch.broadcast_shapes(row_scores.shape[:-2], col_scores.shape[:-2], cores.shape[:-3])
    row_scores = row_scores.expand(*lead, rank, num_candidates)
    col_scores = col_scores.expand(*lead, rank, num_candidates)
    core_sum = cores.detach().sum(dim=-3).expand(*lead, rank, rank)
    flat_index = _candidate_index_op(
        row_scores.detach().reshape(-1, rank, num_candidates).contiguous(),
        col_scores.detach().reshape(-1, rank, num_candidates).contiguous(),
        core_sum.reshape(-1, rank, rank).contiguous(),
        topk,
    ).view(*lead, topk)
    return flat_index, winner_core_scores(row_scores, col_scores, cores, flat_index)


def fused_selection_outputs(
    index: torch.Tensor, scores: torch.Tensor, axis_scores: torch.Tensor, cores: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused selection's addresses (B, H, m) and per-core scores (B, H, m, h), computed without autograd, as
    `memory_ops.tucker_topk` returns them for `axis_scores` (..., 2, H, r, n): with its leading dims, and where a
    gradient is wanted (training) the winners' per-core scores recomputed with autograd (`winner_core_scores`)."""
    lead, num_heads, topk = axis_scores.shape[:-4], axis_scores.shape[-3], index.shape[-1]
    index = index.view(*lead, num_heads, topk)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (axis_scores, cores)):
        return index, winner_core_scores(*axis_scores.unbind(-4), cores, index)
    return index, scores.view(*lead, num_heads, topk, cores.shape[-3])


def winner_core_scores(
    row_scores: torch.Tensor, col_scores: torch.Tensor, cores: torch.Tensor, flat_index: torch.Tensor
) -> torch.Tensor:
    """Per-core scores (..., k, h) of the winners x * w + y (..., k) of the grid of row_scores and col_scores
    (..., r, w), recomputed from their r gathered rows and columns: tiny, and the autograd of the winners' scores
    w.r.t. the axis scores and the cores (..., h, r, r) for free."""
    rank, width = row_scores.shape[-2:]
    gather_shape = (*flat_index.shape[:-1], rank, flat_index.shape[-1])
    row_winners = row_scores.gather(-1, (flat_index // width).unsqueeze(-2).expand(gather_shape))  # (..., r, k)
    col_winners = col_scores.gather(-1, (flat_index % width).unsqueeze(-2).expand(gather_shape))  # (..., r, k)
    # S_row^T C^(i) S_col as two broadcast products, each summed over one rank index, the core index last so that the
    # scores come out (..., k, h) contiguous (as the reference): an einsum ran its two bmms in ~25 permutes, views and
    # copies, each an eager decode step's host time on the GPU
    col_parts = col_winners.view(*gather_shape[:-2], 1, rank, gather_shape[-1], 1)  # (..., 1, r, k, 1)
    core_times_col = (cores.movedim(-3, -1).unsqueeze(-2) * col_parts).sum(-3)  # (..., r, k, h): C^(i) S_col
    return (row_winners.unsqueeze(-1) * core_times_col).sum(-3)  # (..., k, h)
