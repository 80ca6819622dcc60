"""The Triton lookup-reduce over quantized tables (`ultramem.kernels.quantized_lookup`) against the dequantize-then-pool
reference (`ultramem.quantized.ops.lookup_reduce_quantized_reference`): forward and score gradients.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before anything imports
triton where no GPU is present); on a CUDA machine they run compiled on the GPU.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from ultramem.kernels._device import interpreting, triton_available
from ultramem.kernels.quantized_lookup import _quantized_lookup_reduce_op, quantized_lookup_reduce
from ultramem.quantized import lookup_reduce_quantized_reference, quantize
from ultramem.quantized import ops as quantized_ops

pytestmark = pytest.mark.skipif(
    not triton_available(), reason="needs triton with a CUDA device or TRITON_INTERPRET=1 set before triton's import"
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not interpreting() else "cpu")
# (format, group size) on Dv = 24: every size divides the chunk for h = 1 (24) and h = 2 (12). int8 with 6 columns
# (14-byte groups) and int4 with 6 (7-byte groups) put scales and biases at unaligned offsets.
CASES = [("int8", 12), ("int8", 6), ("int4", 12), ("int4", 6)]
VALUE_DIM = 24
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def case(format, group_size, cores, num_groups, dtype=torch.float32, tokens=5, slots=7, rows=30, value_dim=VALUE_DIM):
    """A quantized table and a lookup into it: duplicate rows within a token, one token reading a single row."""
    generator = torch.Generator().manual_seed(tokens * 100 + slots + group_size)
    table = torch.randn(rows, value_dim, generator=generator) * 2 + 0.5
    quantized = quantize(table, format, cores, group_size)
    selected = torch.randint(0, rows, (tokens, slots), generator=generator)
    selected[:, 1] = selected[:, 0]
    selected[-1] = selected[-1, 0]
    groups = torch.randint(0, num_groups, (tokens, slots), generator=generator)
    scores = torch.randn(tokens, slots, cores, generator=generator).to(dtype)
    grad_out = torch.randn(tokens, num_groups, value_dim, generator=generator)
    return [t.to(DEVICE) for t in (quantized, selected, groups, scores, grad_out)]


def pooled_and_grad(fn, quantized, rows, groups, scores, num_groups, format, group_size, grad_out):
    leaf = scores.clone().requires_grad_(True)
    out = fn(quantized, rows, groups, leaf, num_groups, format, group_size)
    (grad,) = torch.autograd.grad(out, leaf, grad_out)
    return out.detach(), grad


def assert_relative(actual, expected, rtol=0.0):
    """|actual - expected| <= 1e-5 max|expected| (+ rtol |expected|): the issue's 1e-5 relative error."""
    torch.testing.assert_close(
        actual.double(), expected.double(), rtol=rtol, atol=1e-5 * expected.abs().max().item() + 1e-30
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cores, num_groups", [(1, 1), (2, 4), (2, 1), (1, 4)], ids=lambda v: str(v))
@pytest.mark.parametrize("format, group_size", CASES, ids=lambda v: str(v))
def test_kernel_equals_the_reference_forward_and_score_gradients(format, group_size, cores, num_groups, dtype):
    quantized, rows, groups, scores, grad_out = case(format, group_size, cores, num_groups, dtype)
    args = (quantized, rows, groups, scores, num_groups, format, group_size, grad_out)
    out, grad = pooled_and_grad(quantized_lookup_reduce, *args)
    ref_out, ref_grad = pooled_and_grad(lookup_reduce_quantized_reference, *args)
    assert out.shape == (5, num_groups, VALUE_DIM) and out.dtype == torch.float32 and grad.dtype == dtype
    assert_relative(out, ref_out)
    # bfloat16 score gradients: both round float32 sums once, so they may differ by one bfloat16 step
    assert_relative(grad, ref_grad, rtol=0.0 if dtype == torch.float32 else 2**-7)


@pytest.mark.parametrize("format, group_size", [("int8", 136), ("int4", 136)])
def test_wide_groups_and_many_slots_span_several_tiles(format, group_size):
    """136-column groups: two column blocks of 128 (the second mostly masked); 40 slots: several slot blocks."""
    quantized, rows, groups, scores, grad_out = case(format, group_size, 2, 4, tokens=3, slots=40, value_dim=272)
    args = (quantized, rows, groups, scores, 4, format, group_size, grad_out)
    for got, expected in zip(pooled_and_grad(quantized_lookup_reduce, *args), pooled_and_grad(
        lookup_reduce_quantized_reference, *args)):  # fmt: skip
        assert_relative(got, expected)


def test_the_kernel_fails_a_wrong_table():
    """The comparisons above can fail: the same values quantized in the other format pool to other vectors, and one
    group's scale changed in one selected row (int4: 10-byte groups, fp16 scale at byte 6) fails `assert_relative`."""
    quantized, rows, groups, scores, _ = case("int8", 12, 2, 4)
    other, *_ = case("int4", 12, 2, 4)
    out = quantized_lookup_reduce(quantized, rows, groups, scores, 4, "int8", 12)
    wrong = lookup_reduce_quantized_reference(other, rows, groups, scores, 4, "int4", 12)
    assert not torch.allclose(out, wrong, atol=1e-3)
    corrupted = other.clone()
    corrupted[rows[0, 0], 10 + 6 : 10 + 8] = torch.tensor([0, 0x3C], dtype=torch.uint8)  # group 1's scale := 1.0
    with pytest.raises(AssertionError):
        assert_relative(quantized_lookup_reduce(corrupted, rows, groups, scores, 4, "int4", 12), wrong)


def test_empty_lookups_give_zeros():
    quantized, *_ = case("int4", 6, 2, 4)
    for tokens, slots in ((0, 3), (2, 0)):
        rows = torch.zeros(tokens, slots, dtype=torch.int64, device=DEVICE)
        scores = torch.zeros(tokens, slots, 2, device=DEVICE, requires_grad=True)
        out = quantized_lookup_reduce(quantized, rows, rows, scores, 4, "int4", 6)
        assert torch.equal(out, torch.zeros(tokens, 4, VALUE_DIM, device=DEVICE))
        out.sum().backward()
        assert torch.equal(scores.grad, torch.zeros_like(scores))


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(weight=torch.zeros(5, 40)), TypeError, "weight has dtype torch.float32"),
        (dict(format="int2"), ValueError, "format='int2' is invalid"),
        (dict(group_size=5, format="int4"), ValueError, "group_size=5 must be a positive int"),
        (dict(group_size=8), ValueError, "weight rows of 40 bytes are not whole int8 groups of 8 columns"),
        (dict(scores=torch.zeros(3, 4, 3)), ValueError, "h = 3"),
        (dict(rows=torch.full((3, 4), 5)), IndexError, "rows contains 5; allowed range is [0, 4]"),
        (dict(groups=torch.full((3, 4), 4)), IndexError, "groups contains 4; allowed range is [0, 3]"),
        (dict(num_groups=0), ValueError, "num_groups must be an int >= 1"),
    ],
)
def test_bad_input_is_one_clear_error(change, error, message):
    arguments = dict(
        weight=torch.zeros(5, 40, dtype=torch.uint8),  # int8, 12-column groups: 2 groups of 20 bytes a row
        rows=torch.zeros(3, 4, dtype=torch.int64),
        groups=torch.zeros(3, 4, dtype=torch.int64),
        scores=torch.zeros(3, 4, 2),
        num_groups=4,
        format="int8",
        group_size=12,
    )
    arguments.update(change)
    arguments = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in arguments.items()}
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        quantized_lookup_reduce(**arguments)


def test_custom_op_registration_passes_opcheck():
    quantized, rows, groups, scores, _ = case("int4", 6, 2, 4, tokens=2, slots=3)
    torch.library.opcheck(
        _quantized_lookup_reduce_op, (quantized, rows, groups, scores.requires_grad_(True), 4, "int4", 6)
    )


def test_torch_compile_fullgraph_forward_and_score_backward_equal_eager():
    quantized, rows, groups, scores, grad_out = case("int8", 6, 2, 4)
    compiled = torch.compile(quantized_lookup_reduce, fullgraph=True, backend="aot_eager")
    eager = pooled_and_grad(quantized_lookup_reduce, quantized, rows, groups, scores, 4, "int8", 6, grad_out)
    traced = pooled_and_grad(compiled, quantized, rows, groups, scores, 4, "int8", 6, grad_out)
    for got, expected in zip(traced, eager):
        torch.testing.assert_close(got, expected)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="checks the CPU dispatch")
def test_cpu_tables_keep_the_quantized_embedding_bag_op(monkeypatch):
    """With the interpreter on, `lookup_reduce_quantized` on CPU still takes PyTorch's quantized op, not Triton."""

    def fail(*args):
        raise AssertionError("the Triton kernel ran on a CPU table")

    monkeypatch.setattr(quantized_ops, "quantized_lookup_reduce", fail)
    quantized, rows, groups, scores, _ = case("int8", 12, 2, 4)
    out = quantized_ops.lookup_reduce_quantized(quantized, rows, groups, scores, 4, "int8", 12)
    assert_relative(out, lookup_reduce_quantized_reference(quantized, rows, groups, scores, 4, "int8", 12))


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the script's CPU mode (the GPU campaign runs it on the device)")
def test_bandwidth_benchmark_measures_every_format(monkeypatch):
    """benchmarks/bench_kernels.py's quantized_lookup_reduce: one row per format, the stored row bytes of each, a
    checked kernel."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("bench_kernels")
    args = bench.parse_args(["--device", "cpu", "--smoke", "--ops", "quantized_lookup_reduce", "--tokens", "2"])
    case = bench.Case(bench.memory_shape("151m", 64), torch.bfloat16, args, copy_gbps=1.0)
    rows = {row["impl"]: row for row in bench.OPS["quantized_lookup_reduce"](case)}
    assert {name: row["row_bytes"] for name, row in rows.items()} == {
        "bfloat16": 2 * 512,
        "int8": 2 * 264,
        "int4": 8 * 36,
    }
    for name in ("int8", "int4"):
        assert rows[name]["max_relative_error"] < 1e-5 and rows[name]["speedup_vs_dense"] > 0
        assert rows[name]["score_backward_ms"] > 0
