"""`lookup_reduce` on Triton: a `torch.library` custom op with autograd, same contract as
`ultramem.memory_ops.lookup_reduce` (the reference it is tested against).

Registered as custom ops (`ultramem::lookup_reduce`, `ultramem::lookup_reduce_backward`) with fake
implementations, so `torch.compile(fullgraph=True)` traces a model that uses them without a graph
break; the kernels are opaque to Inductor.
"""

from __future__ import annotations

import torch

from ultramem.kernels._checks import check_lookup_inputs, check_range
from ultramem.kernels._device import require_launchable


def _kernels():
    """Imported on first launch so that TRITON_INTERPRET, read when kernels are decorated, is current."""
    from ultramem.kernels import _triton_lookup_reduce

    return _triton_lookup_reduce


@torch.library.custom_op("ultramem::lookup_reduce", mutates_args=())
def _lookup_reduce_op(
    values: torch.Tensor,
    rows: torch.Tensor,
    groups: torch.Tensor,
    scores: torch.Tensor,
    num_groups: int,
    deterministic: bool,
) -> torch.Tensor:
    # Index ranges are checked here, on real tensors, so that tracing never needs their values.
    check_range("rows", rows, values.shape[0])
    check_range("groups", groups, num_groups)
    return _kernels().forward(values, rows, groups, scores, num_groups)


@_lookup_reduce_op.register_fake
def _(values, rows, groups, scores, num_groups, deterministic):
    return values.new_empty((rows.shape[0], num_groups, values.shape[1]))


@torch.library.custom_op("ultramem::lookup_reduce_backward", mutates_args=())
def _lookup_reduce_backward_op(
    grad_out: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    groups: torch.Tensor,
    scores: torch.Tensor,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels().backward(grad_out.contiguous(), values, rows, groups, scores, deterministic)


@_lookup_reduce_backward_op.register_fake
def _(grad_out, values, rows, groups, scores, deterministic):
    return torch.empty_like(values), torch.empty_like(scores)


def _setup_context(ctx, inputs, output) -> None:
    values, rows, groups, scores, _, deterministic = inputs
    ctx.save_for_backward(values, rows, groups, scores)
    ctx.deterministic = deterministic


def _backward(ctx, grad_out):
    values, rows, groups, scores = ctx.saved_tensors
    grad_values, grad_scores = _lookup_reduce_backward_op(grad_out, values, rows, groups, scores, ctx.deterministic)
    return grad_values, None, None, grad_scores, None, None


_lookup_reduce_op.register_autograd(_backward, setup_context=_setup_context)


def lookup_reduce(
    values: torch.Tensor,
    rows: torch.Tensor,
    groups: torch.Tensor,
    scores: torch.Tensor,
    num_groups: int,
) -> torch.Tensor:
    """Fused gather + MCS weighting + IVE pooling: (T, E, Dv) in values' dtype, float32 accumulation.

    Same arguments and result as `ultramem.memory_ops.lookup_reduce`; differentiable w.r.t. values and
    scores. The value gradient is deterministic (sorted segments, identical bits every run) when
    `torch.are_deterministic_algorithms_enabled()`, and uses float32 atomics otherwise.
    """
    check_lookup_inputs(values, rows, groups, scores, num_groups)
    require_launchable(values.device)
    return _lookup_reduce_op(
        values.contiguous(),
        rows.contiguous(),
        groups.contiguous(),
        scores.contiguous(),
        num_groups,
        torch.are_deterministic_algorithms_enabled(),
    )
