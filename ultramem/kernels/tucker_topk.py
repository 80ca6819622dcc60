"""`tucker_topk`, TDQKR's whole selection, fused into one Triton kernel where it is switched on.

Same contract as `ultramem.memory_ops.tucker_topk` (the reference). With the one-kernel selection on and unsigned
candidates, one kernel per memory layer does the rank-1 projections, both axes' top-m, the exact m x m candidate
scores, the final top-m and the winners' per-core scores (`ultramem::tucker_topk`); where a gradient is wanted
(training), the winners' per-core scores are recomputed from their gathered axis scores, which carries autograd.
Otherwise the reference composition runs with the fused candidate kernel (`tucker_candidate_topk`).

The one-kernel selection is opt-in until a GPU has timed it against the unfused path (kernels/README.md): turn it on
for the process with `ULTRAMEM_FUSED_SELECTION=1`, or for a block with `with fused_selection(): ...`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from ultramem.kernels._checks import FLOAT_DTYPES, check_dtype, check_same_device
from ultramem.kernels._device import require_launchable
from ultramem.kernels.candidate_topk import MAX_CANDIDATES, fused_selection_outputs, tucker_candidate_topk
from ultramem.memory_ops import tucker_topk as reference


@torch.library.custom_op("ultramem::tucker_topk", mutates_args=())
def _tucker_topk_op(
    row_scores: torch.Tensor,
    col_scores: torch.Tensor,
    u: torch.Tensor,
    t: torch.Tensor,
    cores: torch.Tensor,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    from ultramem.kernels import _triton_tucker_topk  # lazy: see lookup_reduce._kernels

    return _triton_tucker_topk.tucker_topk_index(row_scores, col_scores, u, t, cores, topk)


@_tucker_topk_op.register_fake
def _(row_scores, col_scores, u, t, cores, topk):
    batch, num_heads = row_scores.shape[:2]
    index = row_scores.new_empty((batch, num_heads, topk), dtype=torch.int64)
    dtype = torch.promote_types(row_scores.dtype, cores.dtype)
    return index, row_scores.new_empty((batch, num_heads, topk, cores.shape[1]), dtype=dtype)


def _check_inputs(axis_scores: torch.Tensor, cores: torch.Tensor, leading_vectors: torch.Tensor, topk: int) -> None:
    for name, tensor in (("axis_scores", axis_scores), ("cores", cores), ("leading_vectors", leading_vectors)):
        check_dtype(name, tensor, FLOAT_DTYPES)
    check_same_device(axis_scores=axis_scores, cores=cores, leading_vectors=leading_vectors)
    if axis_scores.dim() < 4 or axis_scores.shape[-4] != 2:
        raise ValueError(f"axis_scores must be (..., 2, H, r, n), got {tuple(axis_scores.shape)}")
    num_heads, rank, num_keys = axis_scores.shape[-3:]
    if cores.dim() != 4 or cores.shape[0] != num_heads or cores.shape[-2:] != (rank, rank):
        raise ValueError(f"cores must be (H, h, r, r) with H = {num_heads}, r = {rank}, got {tuple(cores.shape)}")
    if leading_vectors.shape != (2, num_heads, rank, 1):
        raise ValueError(
            f"leading_vectors must be (2, H, r, 1) = {(2, num_heads, rank, 1)}, got {tuple(leading_vectors.shape)}"
        )
    if not isinstance(topk, int) or not 1 <= topk <= num_keys:
        raise ValueError(f"topk must be an int in [1, {num_keys}] (n), got {topk!r}")


_fused_selection = os.environ.get("ULTRAMEM_FUSED_SELECTION", "0") == "1"


@contextlib.contextmanager
def fused_selection(enabled: bool = True) -> Iterator[None]:
    """Run `tucker_topk` through the one-kernel selection where it applies (`fuses`) inside the block; off by default
    (`ULTRAMEM_FUSED_SELECTION=1` turns it on for the process). torch.compile guards on the switch: a compiled model
    recompiles when it flips."""
    global _fused_selection
    previous, _fused_selection = _fused_selection, enabled
    try:
        yield
    finally:
        _fused_selection = previous


def fuses(topk: int, signed: bool) -> bool:
    """Whether the one-kernel selection runs: switched on (`fused_selection`), unsigned candidates, an m x m grid it
    holds in registers."""
    return _fused_selection and not signed and topk <= MAX_CANDIDATES


def tucker_topk(
    axis_scores: torch.Tensor,
    cores: torch.Tensor,
    leading_vectors: torch.Tensor,
    topk: int,
    signed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Virtual addresses x * n + y (..., H, m) and per-core scores (..., H, m, h); see memory_ops for the contract."""
    _check_inputs(axis_scores, cores, leading_vectors, topk)
    if not fuses(topk, signed):
        return reference(axis_scores, cores, leading_vectors, topk, signed, tucker_candidate_topk)
    require_launchable(axis_scores.device)
    num_heads, rank, num_keys = axis_scores.shape[-3:]
    row_scores, col_scores = axis_scores.unbind(-4)  # (..., H, r, n) each
    u, t = leading_vectors.detach().squeeze(-1)  # (H, r) each
    index, scores = _tucker_topk_op(
        row_scores.detach().reshape(-1, num_heads, rank, num_keys),  # views of one GEMM's output stay views
        col_scores.detach().reshape(-1, num_heads, rank, num_keys),
        u.contiguous(),
        t.contiguous(),
        cores.detach().contiguous(),
        topk,
    )
    return fused_selection_outputs(index, scores, axis_scores, cores)
