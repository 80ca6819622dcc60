"""PEER's inner product `lookup_dot` on every path: the reference against a float64 loop, the CPU embedding_bag path
and the Triton kernels (in the interpreter on CPU) against the reference, forward and both gradients."""

from __future__ import annotations

import os

import pytest
import torch

from ultramem import embedding_bag_ops, kernels, memory_ops
from ultramem.memory_implementations import EMBEDDING_BAG_MEMORY_OPS, TORCH_MEMORY_OPS, memory_ops_for

pytestmark = pytest.mark.numerics  # run again under a second CPU dispatch level (.ci/run)

# atol is relative to the largest expected magnitude: a bfloat16 table gradient sums dozens of rounded contributions
# per row, in bfloat16 (as in test_embedding_bag_ops)
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=3e-2)}
LONG = embedding_bag_ops.EMBEDDING_BAG_MIN_TOKENS + 5
SHORT = 3  # embedding_bag with autograd, the reference without (decoding)


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
    fast = _output_and_grads(embedding_bag_ops.lookup_dot_embedding_bag, table, rows, query)
    reference = _output_and_grads(memory_ops.lookup_dot, table.float(), rows, query.float())
    assert fast[0].shape == rows.shape
    _assert_close_to(fast, reference, dtype)
    with torch.no_grad():
        _assert_close_to([embedding_bag_ops.lookup_dot_embedding_bag(table, rows, query)], reference[:1], dtype)


def test_embedding_bag_table_gradient_accumulates_and_leaves_unread_rows_zero():
    """Two backwards into one `.grad` equal the reference's, zero on rows no token selected."""
    table, rows, query = _inputs(LONG, torch.float32)
    table = torch.cat([table, torch.randn(4096, table.shape[-1])])  # rows 7.. are never selected
    grads = []
    for lookup_dot in (embedding_bag_ops.lookup_dot_embedding_bag, memory_ops.lookup_dot):
        leaf = table.clone().requires_grad_()
        for weight in (1.0, -0.5):
            (lookup_dot(leaf, rows, query) * weight).square().sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[0][7:].count_nonzero() == 0


def test_every_implementation_has_lookup_dot():
    cpu = torch.device("cpu")
    assert TORCH_MEMORY_OPS.lookup_dot is memory_ops.lookup_dot
    assert EMBEDDING_BAG_MEMORY_OPS.lookup_dot is embedding_bag_ops.lookup_dot_embedding_bag
    assert memory_ops_for("triton", cpu).lookup_dot is kernels.lookup_dot


# The Triton kernels run in Triton's interpreter on CPU: tests/conftest.py sets TRITON_INTERPRET=1 before anything
# imports triton on a machine without CUDA.
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton cases run on CPU tensors in Triton's interpreter"
)


def _triton_output_and_grads(table, rows, query, deterministic: bool):
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        return _output_and_grads(kernels.lookup_dot, table, rows, query)
    finally:
        torch.use_deterministic_algorithms(previous)


# (T, K, Dp, N): Dp not a power of two, and above the 128-column tile (several column blocks and passes)
SHAPES = [(5, 7, 12, 11), (6, 16, 200, 9), (40, 3, 1, 50)]


@interpreted
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-K{}-Dp{}-N{}".format(*s))
def test_triton_matches_reference(shape, dtype, deterministic, poison):  # noqa: F811
    """Forward, table gradient (sorted segments or atomics) and query gradient against the reference in float32."""
    num_tokens, num_slots, dim, num_rows = shape
    table, rows, query = _inputs(num_tokens, dtype, num_rows, dim, num_slots, seed=sum(shape))
    got = _triton_output_and_grads(table, rows, query, deterministic)
    reference = _output_and_grads(memory_ops.lookup_dot, table.float(), rows, query.float())
    assert got[0].shape == rows.shape
    _assert_close_to(got, reference, dtype)


@interpreted
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic"])
def test_triton_table_gradient_with_heavy_duplicates(deterministic):
    """24 tokens x 16 slots all on 3 rows of 50 (row segments span several tiles of the sorted kernel)."""
    table, rows, query = _inputs(24, torch.float32, num_rows=50, dim=20, num_slots=16, seed=3)
    rows = rows % 3
    got = _triton_output_and_grads(table, rows, query, deterministic)
    reference = _output_and_grads(memory_ops.lookup_dot, table, rows, query)
    assert reference[1][:3].abs().min() > 0 and reference[1][3:].abs().max() == 0
    for tensor, expected in zip(got, reference):
        torch.testing.assert_close(tensor, expected, rtol=1e-5, atol=1e-5)


@interpreted
def test_triton_deterministic_mode_gives_identical_bits():
    table, rows, query = _inputs(24, torch.bfloat16, num_rows=5, dim=8, num_slots=12, seed=11)
    first, second = (_triton_output_and_grads(table, rows, query, deterministic=True) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@interpreted
def test_triton_mixed_dtypes_int32_rows_and_a_frozen_table():
    """A bf16 table with a float32 query (as under autocast) and int32 rows: out and the table gradient in bf16, the
    query gradient in float32; a table that does not require grad gets none, the query still does."""
    table, rows, query = _inputs(6, torch.float32, dim=20, seed=4)
    table = table.to(torch.bfloat16)
    got = _triton_output_and_grads(table, rows.int(), query, deterministic=False)
    reference = _output_and_grads(memory_ops.lookup_dot, table.float(), rows, query)
    assert [t.dtype for t in got] == [torch.bfloat16, torch.bfloat16, torch.float32]
    for tensor, expected in zip(got, reference):
        torch.testing.assert_close(tensor.float(), expected, **TOLERANCE[torch.bfloat16])
    query = query.clone().requires_grad_()
    kernels.lookup_dot(table, rows, query).float().mul(
        torch.linspace(-1, 1, rows.numel()).view(rows.shape)
    ).sum().backward()
    assert table.grad is None
    torch.testing.assert_close(query.grad, got[2], rtol=0, atol=0)


@interpreted
def test_triton_empty_and_slotless_inputs():
    table = torch.randn(4, 6, requires_grad=True)
    for num_tokens, num_slots in ((0, 3), (2, 0)):
        rows = torch.zeros(num_tokens, num_slots, dtype=torch.int64)
        query = torch.randn(num_tokens, 6, requires_grad=True)
        out = kernels.lookup_dot(table, rows, query)
        assert out.shape == (num_tokens, num_slots)
        grad_table, grad_query = torch.autograd.grad(out.sum(), (table, query))
        assert torch.equal(grad_table, torch.zeros_like(table)) and torch.equal(grad_query, torch.zeros_like(query))


@interpreted
@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(table=torch.zeros(5, 6, dtype=torch.int32)), TypeError, "table has dtype torch.int32"),
        (dict(rows=torch.zeros(3, 4)), TypeError, "rows has dtype torch.float32"),
        (dict(query=torch.zeros(3, 6, 1)), ValueError, r"query must have 2 dims \(T, Dp\)"),
        (dict(query=torch.zeros(3, 5)), ValueError, r"query must have shape \(T, Dp\) = \(3, 6\)"),
        (dict(rows=torch.full((3, 4), 5)), IndexError, r"rows contains 5; allowed range is \[0, 4\]"),
        (dict(rows=torch.full((3, 4), -1)), IndexError, r"rows contains -1; allowed range is \[0, 4\]"),
    ],
)
def test_triton_rejects_bad_input(change, error, message):
    arguments = dict(table=torch.zeros(5, 6), rows=torch.zeros(3, 4, dtype=torch.int64), query=torch.zeros(3, 6))
    arguments.update(change)
    with pytest.raises(error, match=message):
        kernels.lookup_dot(**arguments)


@interpreted
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic"])
def test_custom_ops_pass_opcheck(deterministic):
    """Schema, fake (meta) implementations, autograd registration and AOT dispatch of the three custom ops."""
    table, rows, query = _inputs(4, torch.float32, dim=12, num_slots=5, seed=5)
    grad = torch.randn(rows.shape)
    ops = torch.ops.ultramem
    torch.library.opcheck(ops.lookup_dot, (table.requires_grad_(), rows, query.requires_grad_(), deterministic))
    torch.library.opcheck(ops.lookup_dot_table_grad, (grad, table.detach(), rows, query.detach(), deterministic))
    torch.library.opcheck(ops.lookup_dot_query_grad, (grad, table.detach(), rows, query.detach()))


@interpreted
def test_torch_compile_traces_the_kernels_without_graph_breaks():
    """fullgraph=True fails on any graph break; aot_eager runs the custom ops' fake and real kernels."""
    table, rows, query = _inputs(6, torch.float32, dim=12, seed=6)

    def gate(table, query):
        return (kernels.lookup_dot(table, rows, query * 2).sigmoid() * rows).sum()

    leaves = [table.requires_grad_(), query.requires_grad_()]
    compiled_grads = torch.autograd.grad(torch.compile(gate, backend="aot_eager", fullgraph=True)(*leaves), leaves)
    for got, expected in zip(compiled_grads, torch.autograd.grad(gate(*leaves), leaves)):
        torch.testing.assert_close(got, expected)
