"""`lookup_dot` on the lookup-reduce kernels (`_triton_lookup_reduce`): three launchers, no kernel of its own.

Reference: `ultramem.memory_ops.lookup_dot`, out[t, k] = <table[rows[t, k]], query[t]>. Read as a lookup-reduce
with one IVE group and one MCS core (E = h = 1), the query is the pooled output's gradient and out is the score
gradient, so every pass already exists:

    forward     out = einsum("tkd,td->tk", table[rows], query)          the score-gradient pass, query as grad_out
    query grad  dq  = einsum("tk,tkd->td", grad, table[rows])           the lookup-reduce forward, scores := grad
    table grad  dT  = zeros.index_add_(0, rows.flatten(),                the value gradient, scores := grad and
                          (grad[..., None] * query[:, None]).flatten(0, 1))   grad_out := query (atomic or sorted)

All accumulate in float32 and return their input's dtype. Imported lazily, as `_triton_lookup_reduce`.
"""

from __future__ import annotations

import torch

from ultramem.kernels import _triton_lookup_reduce as lookup_reduce


def forward(table: torch.Tensor, rows: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """(T, K) in the table's dtype, on contiguous validated inputs."""
    out = torch.empty((*rows.shape, 1), dtype=table.dtype, device=table.device)  # (T, K, h = 1)
    if out.numel():
        lookup_reduce.score_and_value_grad_pass(query.unsqueeze(1), table, rows, None, None, grad_scores=out)
    return out.squeeze(-1)


def query_grad(grad: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """(T, Dp) in the query's dtype: each token's selected rows weighted by the output gradient."""
    pooled = lookup_reduce.forward(table, rows, None, grad.unsqueeze(-1), 1, out_dtype=query.dtype)  # (T, 1, Dp)
    return pooled.squeeze(1)


def table_grad(
    grad: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, query: torch.Tensor, deterministic: bool
) -> torch.Tensor:
    """(N, Dp) in the table's dtype: every row gets the queries of the slots that selected it, weighted by the output
    gradient. deterministic: the sorted-segment kernel (identical bits every run); else float32 atomics, unless the
    sorted kernel is the faster one here (`sorted_value_grad_is_faster`)."""
    if rows.numel() == 0:
        return torch.zeros_like(table)
    grad_out, scores = query.unsqueeze(1), grad.unsqueeze(-1)  # (T, E = 1, Dp), (T, K, h = 1)
    if deterministic or lookup_reduce.sorted_value_grad_is_faster(table, rows):
        return lookup_reduce.segment_value_grad(grad_out, table, rows, None, scores)
    value_acc = torch.zeros(table.shape, dtype=torch.float32, device=table.device)
    lookup_reduce.score_and_value_grad_pass(grad_out, None, rows, None, scores, value_acc=value_acc)
    return value_acc.to(table.dtype)
