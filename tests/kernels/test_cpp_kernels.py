"""The C++ CPU kernels (`ultramem.cpp_kernels`, the memory implementation "cpp") against their references in
`memory_ops`: TDQKR's whole selection and the lookup-reduce, built on first use with this machine's compiler; where
they hand over to the reference (signed candidates, gradients); their one-line errors; a model generating with them."""

from __future__ import annotations

import pytest
import torch
from model_support import small_config
from selection_inputs import random_inputs, tie_free_inputs

from ultramem import UltraMemForCausalLM, cpp_kernels, memory_ops


@pytest.fixture(scope="module", autouse=True)
def built():
    """The kernels are built (or loaded from this machine's build) once; a machine that cannot build them fails here."""
    cpp_kernels.load_cpp_kernels()


def _selected_by_kernel(profile: torch.profiler.profile) -> bool:
    return "ultramem_cpu::tucker_topk" in {event.key for event in profile.key_averages()}


@pytest.mark.numerics  # run again under a second CPU dispatch level (.ci/run)
@pytest.mark.parametrize(
    "batch, heads, rank, num_keys, num_cores, topk",
    [(3, 2, 2, 12, 2, 4), (2, 1, 3, 37, 3, 7), (2, 2, 1, 20, 1, 1), (1, 2, 2, 9, 2, 9), (4, 2, 2, 512, 2, 16)],
    ids=["paper-like", "rank3-h3", "rank1", "topk=n", "tiny-preset"],
)
def test_selection_matches_the_reference(batch, heads, rank, num_keys, num_cores, topk):
    """float32: the reference's addresses in its order and its per-core scores, bit for bit (the same products and
    sums in the same order, no fused multiply-add)."""
    inputs = random_inputs(batch, heads, rank, num_keys, num_cores)
    with torch.no_grad(), torch.profiler.profile() as profile:
        index, scores = cpp_kernels.tucker_topk(*inputs, topk)
    assert _selected_by_kernel(profile)
    expected_index, expected_scores = memory_ops.tucker_topk(*inputs, topk)
    assert index.shape == (batch, heads, topk) and scores.shape == (batch, heads, topk, num_cores)
    torch.testing.assert_close(index, expected_index, rtol=0, atol=0)
    torch.testing.assert_close(scores, expected_scores, rtol=0, atol=0)


def test_selection_reads_the_scores_as_the_keys_gemm_lays_them_out():
    """The axis scores as the model has them, (B, T, 2, H, r, n) views of one GEMM's (H*r, B*T, 2n) output, with a
    token in the (bottom, bottom) quadrant: no copy needed, the reference's result."""
    axis_scores, cores, vectors = random_inputs(6, 2, 2, 30, 2, seed=3)
    for axis in range(2):  # a and b drop far below zero for token 0
        axis_scores[0, axis, 0, 0] -= 10 * vectors[axis, 0, 0, 0].sign()
    gemm_output = axis_scores.view(2, 3, 2, 2, 2, 30).permute(3, 4, 0, 1, 2, 5).contiguous()  # (H, r, B, T, 2, n)
    strided = gemm_output.permute(2, 3, 4, 0, 1, 5)  # (B, T, 2, H, r, n), not contiguous
    with torch.no_grad():
        index, scores = cpp_kernels.tucker_topk(strided, cores, vectors, 5)
    expected_index, expected_scores = memory_ops.tucker_topk(strided.contiguous(), cores, vectors, 5)
    assert index.shape == (2, 3, 2, 5) and scores.shape == (2, 3, 2, 5, 2)
    torch.testing.assert_close(index, expected_index, rtol=0, atol=0)
    torch.testing.assert_close(scores, expected_scores, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_rounds_as_the_reference(dtype):
    """16-bit inputs: every intermediate rounded where the reference rounds it, so (with no ties among the rank-1
    projections) the same candidates, and winners whose rounded Tucker scores are the reference's in its order; where
    two cells tie in 16 bits either may win (the kernel takes the lower cell), so the addresses agree where the
    scores do not tie."""
    inputs = tie_free_inputs(2, 2, 2, 50, 2, dtype)
    with torch.no_grad():
        index, scores = cpp_kernels.tucker_topk(*inputs, 8)
    expected_index, expected_scores = memory_ops.tucker_topk(*inputs, 8)
    assert scores.dtype == dtype
    totals, expected_totals = scores.sum(-1), expected_scores.sum(-1)
    torch.testing.assert_close(totals, expected_totals, rtol=0, atol=0)
    tied = (totals.unsqueeze(-1) == expected_totals.unsqueeze(-2)).sum(-1) > 1
    assert (index == expected_index)[~tied].all() and (~tied).sum() > index.numel() // 2


def test_mixed_dtypes_are_promoted_as_the_reference_promotes_them():
    axis_scores, cores, vectors = random_inputs(2, 2, 2, 40, 2, seed=5)
    with torch.no_grad():
        index, scores = cpp_kernels.tucker_topk(axis_scores, cores.double(), vectors, 6)
    expected_index, expected_scores = memory_ops.tucker_topk(axis_scores, cores.double(), vectors, 6)
    assert scores.dtype == torch.float64
    torch.testing.assert_close(index, expected_index, rtol=0, atol=0)
    torch.testing.assert_close(scores, expected_scores)


def test_training_takes_the_kernels_addresses_and_the_references_gradients():
    """A gradient wanted: the kernel picks the addresses, and the winners' per-core scores, recomputed from their
    gathered axis scores, carry the reference's gradients to the axis scores and the cores."""
    axis_scores, cores, vectors = random_inputs(2, 2, 2, 16, 2)
    leaves = [tensor.requires_grad_() for tensor in (axis_scores, cores)]
    with torch.profiler.profile() as profile:
        index, scores = cpp_kernels.tucker_topk(axis_scores, cores, vectors, 4)
    assert _selected_by_kernel(profile)
    expected_index, expected_scores = memory_ops.tucker_topk(axis_scores, cores, vectors, 4)
    torch.testing.assert_close(index, expected_index, rtol=0, atol=0)
    grads = torch.autograd.grad(scores.sum(), leaves)
    expected_grads = torch.autograd.grad(expected_scores.sum(), leaves)
    for grad, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected)


def test_signed_candidates_take_the_reference():
    inputs = random_inputs(2, 2, 2, 20, 2)
    with torch.no_grad(), torch.profiler.profile() as profile:
        index, scores = cpp_kernels.tucker_topk(*inputs, 4, signed=True)
    assert not _selected_by_kernel(profile)
    expected_index, expected_scores = memory_ops.tucker_topk(*inputs, 4, signed=True)
    torch.testing.assert_close(index, expected_index, rtol=0, atol=0)
    torch.testing.assert_close(scores, expected_scores, rtol=0, atol=0)


def _lookup_inputs(num_rows, value_dim, tokens, slots, groups, cores, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(num_rows, value_dim, generator=generator).to(dtype)
    rows = torch.randint(0, num_rows, (tokens, slots), generator=generator)
    group_index = torch.randint(0, groups, (tokens, slots), generator=generator)
    scores = torch.randn(tokens, slots, cores, generator=generator)
    return values, rows, group_index, scores, groups


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups, cores", [(1, 1), (4, 2), (9, 3)], ids=["E1-h1", "E4-h2", "E9-h3"])
def test_lookup_reduce_matches_the_reference(dtype, groups, cores):
    """The selected rows, weighted chunk by chunk by their cores' scores and pooled into their IVE groups, summed in
    float32 and rounded once to the table's dtype (the order of the float32 sum is the kernel's own)."""
    inputs = _lookup_inputs(300, 24, 5, 16, groups, cores, dtype)
    with torch.no_grad():
        pooled = cpp_kernels.lookup_reduce(*inputs)
    expected = memory_ops.lookup_reduce(*inputs)
    assert pooled.dtype == dtype and pooled.shape == (5, groups, 24)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(pooled, expected, **tolerance)


def test_lookup_reduce_reads_a_table_with_strided_rows_in_place():
    """A table that is a view of a wider one (its rows strided, read where they are): the reference's result."""
    values, rows, groups, scores, num_groups = _lookup_inputs(300, 40, 4, 12, 4, 2, torch.float32)
    view = values[:, 8:32]  # (300, 24), rows 40 apart
    with torch.no_grad():
        pooled = cpp_kernels.lookup_reduce(view, rows, groups, scores, num_groups)
    torch.testing.assert_close(pooled, memory_ops.lookup_reduce(view, rows, groups, scores, num_groups))


def test_lookup_reduce_with_a_gradient_takes_the_embedding_bag_path():
    values, rows, groups, scores, num_groups = _lookup_inputs(50, 8, 3, 6, 2, 2, torch.float32)
    leaves = [tensor.requires_grad_() for tensor in (values, scores)]
    with torch.profiler.profile() as profile:
        pooled = cpp_kernels.lookup_reduce(values, rows, groups, scores, num_groups)
    assert "ultramem_cpu::lookup_reduce" not in {event.key for event in profile.key_averages()}
    expected = memory_ops.lookup_reduce(values, rows, groups, scores, num_groups)
    grads = torch.autograd.grad(pooled.sum(), leaves)
    expected_grads = torch.autograd.grad(expected.sum(), leaves)
    for grad, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, want)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: cpp_kernels.lookup_reduce(*_lookup_inputs(10, 4, 1, 2, 1, 1, torch.float32)[:1],
                                           torch.tensor([[0, 10]]), torch.zeros(1, 2, dtype=torch.long),
                                           torch.ones(1, 2, 1), 1),
         IndexError, "rows contains 10; allowed range is [0, 9]"),
        (lambda: cpp_kernels.lookup_reduce(torch.randn(10, 4), torch.zeros(1, 2, dtype=torch.long),
                                           torch.full((1, 2), 3), torch.ones(1, 2, 1), 2),
         IndexError, "groups contains 3; allowed range is [0, 1]"),
        (lambda: cpp_kernels.lookup_reduce(torch.randn(10, 4), torch.zeros(1, 2, dtype=torch.long),
                                           torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, 3), 1),
         ValueError, "scores.shape[-1] (h = 3) must be >= 1 and divide the value dim 4"),
        (lambda: cpp_kernels.tucker_topk(torch.randn(1, 2, 2, 2, 8), torch.randn(2, 2, 2), torch.randn(2, 2, 2, 1), 3),
         ValueError, "cores must be (H, h, r, r) with H = 2, r = 2, got [2, 2, 2]"),
        (lambda: cpp_kernels.tucker_topk(torch.randn(1, 2, 2, 2, 8), torch.randn(2, 1, 2, 2), torch.randn(2, 2, 2, 1), 9),
         ValueError, "topk must be in [1, 8] (n), got 9"),
    ],
    ids=["row-range", "group-range", "cores-divide-dv", "cores-shape", "topk-range"],
)  # fmt: skip
def test_bad_input_is_one_line_naming_the_argument(call, error, message):
    with torch.no_grad(), pytest.raises(error) as raised:
        call()
    assert str(raised.value).splitlines()[0] == message


def test_a_machine_that_cannot_build_them_gets_one_line(monkeypatch):
    monkeypatch.setattr(cpp_kernels.ops, "_build", lambda: "no C++ compiler (c++) or no ninja on PATH")
    with pytest.raises(
        RuntimeError,
        match=r"^memory_implementation='cpp' builds its C\+\+ kernels on first use and could "
        r"not: no C\+\+ compiler \(c\+\+\) or no ninja on PATH\. Install",
    ):
        cpp_kernels.load_cpp_kernels()


def test_a_model_generates_the_same_tokens_with_the_kernels():
    """The small model (every improvement of the paper on) with the "cpp" implementation: the decode steps run both
    kernels, and greedy generation gives the reference's tokens, its logits to float32 rounding, and recomputation's
    tokens."""
    torch.manual_seed(0)
    model = UltraMemForCausalLM(small_config()).eval()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 7))
    outputs = {}
    for implementation in ("torch", "cpp"):
        model.set_memory_implementation(implementation)
        with torch.no_grad(), torch.profiler.profile() as profile:
            outputs[implementation] = model.generate(
                input_ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
        ran = {event.key for event in profile.key_averages()}
        assert ({"ultramem_cpu::tucker_topk", "ultramem_cpu::lookup_reduce"} <= ran) == (implementation == "cpp")
    torch.testing.assert_close(outputs["cpp"].sequences, outputs["torch"].sequences, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(outputs["cpp"].logits), torch.stack(outputs["torch"].logits))
    with torch.no_grad():
        recomputed = model.generate(input_ids, max_new_tokens=6, do_sample=False, use_cache=False)
    torch.testing.assert_close(recomputed, outputs["cpp"].sequences, rtol=0, atol=0)
