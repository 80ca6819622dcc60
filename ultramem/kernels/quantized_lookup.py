"""`quantized_lookup_reduce` on Triton: the lookup-reduce over an int8 / int4 table, decoded in registers.

Same contract as `ultramem.quantized.ops.lookup_reduce_quantized` (its reference, dequantize-then-pool, is what the
tests compare with): rows, groups (T, K), scores (T, K, h) -> (T, E, Dv) float32, differentiable w.r.t. the scores
only (quantized tables are frozen). Registered as custom ops (`ultramem::quantized_lookup_reduce` and its backward)
with fake implementations, so `torch.compile(fullgraph=True)` traces it without a graph break.
"""

from __future__ import annotations

import torch

from ultramem.kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, check_dtype, check_ndim, check_range, check_same_device
from ultramem.kernels._device import require_launchable

FORMAT_GROUP_OVERHEAD = {"int8": 8, "int4": 4}  # scale + bias bytes per group (fp32 pair / fp16 pair)


def _kernels():
    """Imported on first launch so that TRITON_INTERPRET, read when kernels are decorated, is current."""
    from ultramem.kernels import _triton_quantized_lookup

    return _triton_quantized_lookup


def group_bytes(format: str, group_size: int) -> int:
    """Bytes of one quantized group of `group_size` columns: payload (1 byte a column for int8, half a byte for int4),
    scale and bias. The one definition: `ultramem.quantized.format` lays tables out by it."""
    payload = group_size if format == "int8" else group_size // 2
    return payload + FORMAT_GROUP_OVERHEAD[format]


@torch.library.custom_op("ultramem::quantized_lookup_reduce", mutates_args=())
def _quantized_lookup_reduce_op(
    weight: torch.Tensor,
    rows: torch.Tensor,
    groups: torch.Tensor,
    scores: torch.Tensor,
    num_groups: int,
    format: str,
    group_size: int,
) -> torch.Tensor:
    # Index ranges are checked here, on real tensors, so that tracing never needs their values.
    check_range("rows", rows, weight.shape[0])
    check_range("groups", groups, num_groups)
    return _kernels().forward(weight, rows, groups, scores, num_groups, format, group_size)


@_quantized_lookup_reduce_op.register_fake
def _(weight, rows, groups, scores, num_groups, format, group_size):
    value_dim = weight.shape[1] // group_bytes(format, group_size) * group_size
    return weight.new_empty((rows.shape[0], num_groups, value_dim), dtype=torch.float32)


@torch.library.custom_op("ultramem::quantized_lookup_reduce_backward", mutates_args=())
def _quantized_lookup_reduce_backward_op(
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    groups: torch.Tensor,
    scores: torch.Tensor,
    format: str,
    group_size: int,
) -> torch.Tensor:
    return _kernels().score_grad(grad_out.float().contiguous(), weight, rows, groups, scores, format, group_size)


@_quantized_lookup_reduce_backward_op.register_fake
def _(grad_out, weight, rows, groups, scores, format, group_size):
    return torch.empty_like(scores)


def _setup_context(ctx, inputs, output) -> None:
    weight, rows, groups, scores, _, format, group_size = inputs
    ctx.save_for_backward(weight, rows, groups, scores)
    ctx.format, ctx.group_size = format, group_size


def _backward(ctx, grad_out):
    weight, rows, groups, scores = ctx.saved_tensors
    grad_scores = None
    if ctx.needs_input_grad[3]:
        grad_scores = _quantized_lookup_reduce_backward_op(
            grad_out, weight, rows, groups, scores, ctx.format, ctx.group_size
        )
    return None, None, None, grad_scores, None, None, None


_quantized_lookup_reduce_op.register_autograd(_backward, setup_context=_setup_context)


def _check_inputs(
    weight: torch.Tensor,
    rows: torch.Tensor,
    groups: torch.Tensor,
    scores: torch.Tensor,
    num_groups: int,
    format: str,
    group_size: int,
) -> None:
    """Shapes, dtypes and the format's geometry, one line each, before any launch."""
    check_ndim("weight", weight, 2, "(N, quantized row bytes)")
    check_ndim("rows", rows, 2, "(T, K)")
    check_ndim("scores", scores, 3, "(T, K, h)")
    check_dtype("weight", weight, (torch.uint8,))
    check_dtype("scores", scores, FLOAT_DTYPES)
    check_dtype("rows", rows, INDEX_DTYPES)
    check_dtype("groups", groups, INDEX_DTYPES)
    check_same_device(weight=weight, rows=rows, groups=groups, scores=scores)
    if format not in FORMAT_GROUP_OVERHEAD:
        raise ValueError(f"format={format!r} is invalid: must be one of {tuple(FORMAT_GROUP_OVERHEAD)}")
    if not isinstance(group_size, int) or group_size < 1 or (format == "int4" and group_size % 2):
        raise ValueError(f"group_size={group_size!r} must be a positive int (even for int4)")
    if groups.shape != rows.shape:
        raise ValueError(f"groups must have the shape of rows {tuple(rows.shape)}, got {tuple(groups.shape)}")
    if scores.shape[:2] != rows.shape:
        raise ValueError(
            f"scores must have shape (T, K, h) with (T, K) = {tuple(rows.shape)}, got {tuple(scores.shape)}"
        )
    per_group = group_bytes(format, group_size)
    if weight.shape[1] % per_group:
        raise ValueError(
            f"weight rows of {weight.shape[1]} bytes are not whole {format} groups of {group_size} columns "
            f"({per_group} bytes each): the format or group size does not match the table"
        )
    groups_per_row, num_cores = weight.shape[1] // per_group, scores.shape[-1]
    if num_cores < 1 or groups_per_row % num_cores:
        raise ValueError(
            f"scores.shape[-1] (h = {num_cores}) must be >= 1 and divide the table's {groups_per_row} groups per row"
        )
    if not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"num_groups must be an int >= 1, got {num_groups!r}")


def quantized_lookup_reduce(
    weight: torch.Tensor,
    rows: torch.Tensor,
    groups: torch.Tensor,
    scores: torch.Tensor,
    num_groups: int,
    format: str,
    group_size: int,
) -> torch.Tensor:
    """Fused gather + dequantize + MCS weighting + IVE pooling over the quantized table `weight` (N, W) uint8.

    Returns (T, E, Dv) float32; differentiable w.r.t. `scores` (their gradient in their dtype), never the table.
    """
    _check_inputs(weight, rows, groups, scores, num_groups, format, group_size)
    require_launchable(weight.device)
    return _quantized_lookup_reduce_op(
        weight.contiguous(), rows.contiguous(), groups.contiguous(), scores.contiguous(), num_groups, format, group_size
    )
