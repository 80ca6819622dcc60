"""PEER's inner product `lookup_dot` on every path: the reference against a float64 loop, the CPU embedding_bag path
and the Triton kernels (in the interpreter on CPU) against the reference, forward and both gradients."""

from __future__ import annotations

import pytest
import torch

from ultramem import memory_ops
from ultramem.memory_implementations import EMBEDDING_BAG_MEMORY_OPS, TORCH_MEMORY_OPS

# atol is relative to the largest expected magnitude: a bfloat16 table gradient sums dozens of rounded contributions
# per row, in bfloat16 (as in test_embedding_bag_ops)
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=3e-2)}
LONG = memory_ops.EMBEDDING_BAG_MIN_TOKENS + 5  # runs embedding_bag
SHORT = 3  # falls back to the reference


def _inputs(num_tokens: int, dtype: torch.dtype, num_rows: int = 7, dim: int = 12, num_slots: int = 10, seed: int = 0):
    """Table, rows (every token's first two slots on one row, few distinct rows: duplicates within and across tokens),
    query."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(num_rows, dim, generator=generator).to(dtype)
    rows = torch.randint(0, num_rows, (num_tokens, num_slots), generator=generator)
    rows[:, 1] = rows[:, 0]
    query = torch.randn(num_tokens, dim, generator=generator).to(dtype)
    return table, rows, query


def _output_and_grads(lookup_dot, table, rows, query):
    table, query = table.detach().requires_grad_(), query.detach().requires_grad_()
    out = lookup_dot(table, rows, query)
    weight = torch.linspace(-1, 1, out.numel()).view_as(out)  # a non-uniform output gradient
    grad_table, grad_query = torch.autograd.grad((out.float() * weight).sum(), (table, query))
    return out, grad_table, grad_query


def _assert_close_to(got, expected, dtype):
    for name, tensor, reference in zip(("output", "grad table", "grad query"), got, expected):
        assert tensor.dtype == dtype, name
        scale = reference.abs().max().item()
        tolerance = TOLERANCE[dtype]
        torch.testing.assert_close(
            tensor.float(), reference, rtol=tolerance["rtol"], atol=tolerance["atol"] * scale, msg=name
        )


def test_reference_equals_a_float64_loop():
    """out[t, k] = <table[rows[t, k]], query[t]>, and the gradients autograd takes through it, against a loop."""
    table, rows, query = _inputs(LONG, torch.float32)
    out, grad_table, grad_query = _output_and_grads(memory_ops.lookup_dot, table, rows, query)
    weight = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
    expected = torch.zeros(rows.shape, dtype=torch.float64)
    expected_grad_table = torch.zeros(table.shape, dtype=torch.float64)
    expected_grad_query = torch.zeros(query.shape, dtype=torch.float64)
    for t in range(rows.shape[0]):
        for k in range(rows.shape[1]):
            row = rows[t, k]
            expected[t, k] = sum(table[row, d].double() * query[t, d].double() for d in range(table.shape[1]))
            expected_grad_table[row] += weight[t, k] * query[t].double()
            expected_grad_query[t] += weight[t, k] * table[row].double()
    assert out.dtype == torch.float32 and out.shape == rows.shape
    for got, reference in ((out, expected), (grad_table, expected_grad_table), (grad_query, expected_grad_query)):
        torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_tokens", [SHORT, LONG])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_embedding_bag_path_matches_reference(num_tokens, dtype):
    """Output, table and query gradients of the fast path equal the reference's (computed in float32)."""
    table, rows, query = _inputs(num_tokens, dtype)
    fast = _output_and_grads(memory_ops.lookup_dot_embedding_bag, table, rows, query)
    reference = _output_and_grads(memory_ops.lookup_dot, table.float(), rows, query.float())
    assert fast[0].shape == rows.shape
    _assert_close_to(fast, reference, dtype)


def test_embedding_bag_table_gradient_accumulates_and_leaves_unread_rows_zero():
    """Two backwards into one `.grad` equal the reference's, zero on rows no token selected."""
    table, rows, query = _inputs(LONG, torch.float32)
    table = torch.cat([table, torch.randn(4096, table.shape[-1])])  # rows 7.. are never selected
    grads = []
    for lookup_dot in (memory_ops.lookup_dot_embedding_bag, memory_ops.lookup_dot):
        leaf = table.clone().requires_grad_()
        for weight in (1.0, -0.5):
            (lookup_dot(leaf, rows, query) * weight).square().sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[0][7:].count_nonzero() == 0


def test_every_pytorch_implementation_has_lookup_dot():
    assert TORCH_MEMORY_OPS.lookup_dot is memory_ops.lookup_dot
    assert EMBEDDING_BAG_MEMORY_OPS.lookup_dot is memory_ops.lookup_dot_embedding_bag
