"""`lookup_dot` on Triton: a `torch.library` custom op with autograd, same contract as
`ultramem.memory_ops.lookup_dot` (the reference it is tested against).

Registered as custom ops (`ultramem::lookup_dot`, `ultramem::lookup_dot_table_grad`,
`ultramem::lookup_dot_query_grad`) with fake implementations, so `torch.compile(fullgraph=True)` traces a model that
uses them without a graph break, as `lookup_reduce`. Each gradient is its own op, launched only when needed (a frozen
table takes no table gradient).
"""

from __future__ import annotations

import torch

from ultramem.kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, check_dtype, check_ndim, check_range, check_same_device
from ultramem.kernels._device import require_launchable


def _kernels():
    """Imported on first launch so that TRITON_INTERPRET, read when kernels are decorated, is current."""
    from ultramem.kernels import _triton_lookup_dot

    return _triton_lookup_dot


@torch.library.custom_op("ultramem::lookup_dot", mutates_args=())
def _lookup_dot_op(table: torch.Tensor, rows: torch.Tensor, query: torch.Tensor, deterministic: bool) -> torch.Tensor:
    check_range("rows", rows, table.shape[0])  # on real tensors, so that tracing never needs their values
    return _kernels().forward(table, rows, query)


@_lookup_dot_op.register_fake
def _(table, rows, query, deterministic):
    return table.new_empty(rows.shape)


@torch.library.custom_op("ultramem::lookup_dot_table_grad", mutates_args=())
def _table_grad_op(
    grad: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, query: torch.Tensor, deterministic: bool
) -> torch.Tensor:
    return _kernels().table_grad(grad.contiguous(), table, rows, query, deterministic)


@_table_grad_op.register_fake
def _(grad, table, rows, query, deterministic):
    return torch.empty_like(table)


@torch.library.custom_op("ultramem::lookup_dot_query_grad", mutates_args=())
def _query_grad_op(grad: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    return _kernels().query_grad(grad.contiguous(), table, rows, query)


@_query_grad_op.register_fake
def _(grad, table, rows, query):
    return torch.empty_like(query)


def _setup_context(ctx, inputs, output) -> None:
    table, rows, query, deterministic = inputs
    ctx.save_for_backward(table, rows, query)
    ctx.deterministic = deterministic


def _backward(ctx, grad):
    table, rows, query = ctx.saved_tensors
    grad_table = _table_grad_op(grad, table, rows, query, ctx.deterministic) if ctx.needs_input_grad[0] else None
    grad_query = _query_grad_op(grad, table, rows, query) if ctx.needs_input_grad[2] else None
    return grad_table, None, grad_query, None


_lookup_dot_op.register_autograd(_backward, setup_context=_setup_context)


def check_lookup_dot_inputs(table: torch.Tensor, rows: torch.Tensor, query: torch.Tensor) -> None:
    """Shapes and dtypes of `lookup_dot`'s arguments (see memory_ops for the contract); the row range is checked by
    the op itself, on real tensors."""
    check_ndim("table", table, 2, "(N, Dp)")
    check_ndim("rows", rows, 2, "(T, K)")
    check_ndim("query", query, 2, "(T, Dp)")
    check_dtype("table", table, FLOAT_DTYPES)
    check_dtype("query", query, FLOAT_DTYPES)
    check_dtype("rows", rows, INDEX_DTYPES)
    check_same_device(table=table, rows=rows, query=query)
    if query.shape != (rows.shape[0], table.shape[1]):
        raise ValueError(
            f"query must have shape (T, Dp) = {(rows.shape[0], table.shape[1])} (T from rows, Dp from table), "
            f"got {tuple(query.shape)}"
        )


def lookup_dot(table: torch.Tensor, rows: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """out[t, k] = <table[rows[t, k]], query[t]>: (T, K) in the table's dtype, float32 accumulation.

    Same arguments and result as `ultramem.memory_ops.lookup_dot`; differentiable w.r.t. table and query. The table
    gradient is deterministic (sorted segments) when `torch.are_deterministic_algorithms_enabled()`, and uses float32
    atomics otherwise, as `lookup_reduce`'s value gradient.
    """
    check_lookup_dot_inputs(table, rows, query)
    require_launchable(table.device)
    return _lookup_dot_op(
        table.contiguous(), rows.contiguous(), query.contiguous(), torch.are_deterministic_algorithms_enabled()
    )
