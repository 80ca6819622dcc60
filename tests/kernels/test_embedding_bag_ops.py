"""The fast CPU lookup (`embedding_bag_ops.lookup_reduce_embedding_bag`) against the reference `memory_ops.lookup_reduce`."""

import pytest
import torch
from model_support import assert_trains_like_the_reference

from ultramem import embedding_bag_ops, memory_ops
from ultramem.memory_implementations import EMBEDDING_BAG_MEMORY_OPS, TORCH_MEMORY_OPS, memory_ops_for

pytestmark = pytest.mark.numerics  # run again under a second CPU dispatch level (.ci/run)

# atol is relative to the largest expected magnitude: a bfloat16 value gradient sums ~50 rounded contributions per
# row here, in bfloat16 on both paths (the reference's is off by 0.12 at magnitude 10)
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=3e-2)}
LONG = embedding_bag_ops.EMBEDDING_BAG_MIN_TOKENS + 5  # runs embedding_bag
SHORT = 3  # falls back to the reference


def _inputs(num_tokens: int, num_groups: int, num_cores: int, dtype: torch.dtype, seed: int = 0):
    """Values, rows (with every token's first two slots on one row, and few distinct rows), groups, scores."""
    generator = torch.Generator().manual_seed(seed)
    num_values, value_dim, num_slots = 7, 4 * num_cores, 10
    values = torch.randn(num_values, value_dim, generator=generator).to(dtype)
    rows = torch.randint(0, num_values, (num_tokens, num_slots), generator=generator)
    rows[:, 1] = rows[:, 0]
    groups = torch.randint(0, num_groups, (num_tokens, num_slots), generator=generator)
    scores = torch.randn(num_tokens, num_slots, num_cores, generator=generator).to(dtype)
    return values, rows, groups, scores


def _output_and_grads(lookup, values, rows, groups, scores, num_groups):
    values, scores = values.detach().requires_grad_(), scores.detach().requires_grad_()
    out = lookup(values, rows, groups, scores, num_groups)
    weight = torch.linspace(-1, 1, out.numel()).view_as(out)  # a non-uniform output gradient
    grad_values, grad_scores = torch.autograd.grad((out.float() * weight).sum(), (values, scores))
    return out, grad_values, grad_scores


@pytest.mark.parametrize("num_tokens", [SHORT, LONG])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_groups", "num_cores"), [(1, 1), (1, 2), (4, 1), (4, 2), (9, 4)])
def test_embedding_bag_lookup_matches_reference(num_tokens, dtype, num_groups, num_cores):
    """Output, value gradient and score gradient of the fast path equal the reference's (computed in float32)."""
    values, rows, groups, scores = _inputs(num_tokens, num_groups, num_cores, dtype)
    fast = _output_and_grads(embedding_bag_ops.lookup_reduce_embedding_bag, values, rows, groups, scores, num_groups)
    reference = _output_and_grads(memory_ops.lookup_reduce, values.float(), rows, groups, scores.float(), num_groups)
    assert fast[0].dtype == dtype and fast[0].shape == (num_tokens, num_groups, values.shape[-1])
    for name, got, expected in zip(("output", "grad values", "grad scores"), fast, reference):
        assert got.dtype == dtype, name
        tolerance = TOLERANCE[dtype]
        scale = expected.abs().max().item()
        torch.testing.assert_close(
            got.float(), expected, rtol=tolerance["rtol"], atol=tolerance["atol"] * scale, msg=name
        )


def test_the_default_on_cpu_is_embedding_bag():
    cpu = torch.device("cpu")
    assert memory_ops_for(None, cpu) is EMBEDDING_BAG_MEMORY_OPS
    assert memory_ops_for("embedding_bag", cpu) is EMBEDDING_BAG_MEMORY_OPS
    assert memory_ops_for("torch", cpu) is TORCH_MEMORY_OPS


def test_model_trains_through_embedding_bag():
    """UltraMemForCausalLM with memory_implementation='embedding_bag' gives the loss and every gradient of 'torch'."""
    assert_trains_like_the_reference("embedding_bag", torch.randint(0, 97, (2, LONG)))


def test_value_gradient_in_fresh_pages_accumulates_like_the_reference():
    """Two backwards into one `.grad` (the second adds to the first) equal the reference's, zero on unread rows."""
    values, rows, groups, scores = _inputs(LONG, 4, 2, torch.float32)
    values = torch.cat([values, torch.randn(4096, values.shape[-1])])  # rows 7.. are never selected
    grads = []
    for lookup in (embedding_bag_ops.lookup_reduce_embedding_bag, memory_ops.lookup_reduce):
        table = values.clone().requires_grad_()
        for weight in (1.0, -0.5):
            (lookup(table, rows, groups, scores, 4) * weight).square().sum().backward()
        grads.append(table.grad)
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[0][7:].count_nonzero() == 0


@pytest.mark.parametrize("dense", [True, False])
def test_value_gradient_pages_chosen_by_how_densely_rows_are_written(dense):
    """Rows written densely (most 4 KB pages of a 2 MB block) take huge pages, sparse ones small pages; either way
    the gradient equals the reference's (`index_add_` into `torch.zeros`), zero on every unwritten row."""
    generator = torch.Generator().manual_seed(0)
    num_values, value_dim = 65536, 64  # 16 MB, 256 B rows: 16 rows a 4 KB page, 8192 a 2 MB block
    step = 3 if dense else 8192  # a third of the rows, or one row per 2 MB block
    rows = torch.arange(0, num_values, step)
    assert embedding_bag_ops._worth_huge_pages(rows, value_dim * 4) is dense
    grad_rows = torch.randn(rows.numel(), value_dim, generator=generator)
    grad = embedding_bag_ops.zeros_in_fresh_pages((num_values, value_dim), torch.float32, torch.device("cpu"), rows)
    grad.index_copy_(0, rows, grad_rows)
    torch.testing.assert_close(grad, torch.zeros(num_values, value_dim).index_add_(0, rows, grad_rows), rtol=0, atol=0)


@pytest.mark.parametrize("num_tokens", [SHORT, LONG])
@pytest.mark.parametrize(("num_groups", "num_cores"), [(1, 1), (4, 1), (4, 2)])
@pytest.mark.parametrize("ops", [TORCH_MEMORY_OPS, EMBEDDING_BAG_MEMORY_OPS], ids=["torch", "embedding_bag"])
def test_a_lookup_prepared_on_its_table_equals_the_lookup(ops, num_tokens, num_groups, num_cores):
    """`lookup_reduce_on` (a decode step's, the table's one-hot groups taken once, the scores as the chunks' weights)
    gives the implementation's `lookup_reduce`, bit for bit, on either side of embedding_bag's token threshold."""
    values, rows, groups, scores = _inputs(num_tokens, num_groups, num_cores, torch.float32)
    prepared = ops.lookup_reduce_on(values, num_groups)
    with torch.no_grad():
        got = prepared(rows, groups, memory_ops.chunk_weights(scores))
        expected = ops.lookup_reduce(values, rows, groups, scores, num_groups)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
