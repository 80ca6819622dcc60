"""Quantized value tables: the storage format (`ultramem.quantized.format`) and the CPU lookup-reduce op against the
dequantize-then-pool reference, forward and score gradients."""

import pytest
import torch

from ultramem.memory_ops import lookup_reduce
from ultramem.quantized import QuantizationError, dequantize, lookup_reduce_quantized, lookup_reduce_quantized_reference
from ultramem.quantized.format import group_bytes, quantize, quantized_width
from ultramem.quantized.ops import quantized_bag_sum

Q = torch.ops.quantized
CASES = [("int8", 8), ("int4", 8), ("int4", 4)]  # (format, group size) on Dv = 16, h = 2: chunk 8


def table(rows=50, value_dim=16, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, value_dim, generator=generator).to(dtype)


@pytest.mark.parametrize("format, group_size", CASES)
def test_layout_is_pytorchs_prepack_per_group_and_dequantize_is_its_unpack(format, group_size):
    values = table()
    quantized = quantize(values, format, num_cores=2, group_size=group_size)
    assert quantized.dtype == torch.uint8 and quantized.shape == (50, quantized_width(format, 16, group_size))
    prepack = Q.embedding_bag_byte_prepack if format == "int8" else Q.embedding_bag_4bit_prepack
    unpack = Q.embedding_bag_byte_unpack if format == "int8" else Q.embedding_bag_4bit_unpack
    per_group = values.view(-1, group_size)
    assert torch.equal(quantized.view(-1, group_bytes(format, group_size)), prepack(per_group))
    dequantized = dequantize(quantized, format, group_size)
    torch.testing.assert_close(dequantized, unpack(quantized.view(-1, group_bytes(format, group_size))).view(50, 16))
    # asymmetric rowwise: each element within half a step of its group's scale (fp16 scale/bias for int4)
    steps = 255 if format == "int8" else 15
    group_range = per_group.amax(-1, keepdim=True) - per_group.amin(-1, keepdim=True)
    error = (dequantized.view(-1, group_size) - per_group).abs()
    assert (error <= group_range / steps / 2 * 1.01 + 1e-3).all()


def test_bfloat16_and_memory_mapped_style_inputs_quantize_like_their_float32_values():
    values = table(dtype=torch.bfloat16)
    assert torch.equal(quantize(values, "int8", 2), quantize(values.float(), "int8", 2))
    assert torch.equal(quantize(values[10:20], "int4", 2, 4), quantize(values, "int4", 2, 4)[10:20])


def test_bad_inputs_are_one_clear_line():
    values = table()
    with pytest.raises(QuantizationError, match="already quantized"):
        quantize(quantize(values, "int8", 2), "int8", 2)
    with pytest.raises(QuantizationError, match="2-D"):
        quantize(values.flatten(), "int8", 1)
    with pytest.raises(QuantizationError, match="group size 3 must be a positive divisor of the MCS chunk 8"):
        quantize(values, "int4", 2, group_size=3)
    with pytest.raises(QuantizationError, match="group size 16 must be a positive divisor of the MCS chunk 8"):
        quantize(values, "int8", 2, group_size=16)  # a group would straddle two cores' chunks
    with pytest.raises(QuantizationError, match="must be even"):
        quantize(table(value_dim=6), "int4", 2, group_size=1)
    with pytest.raises(QuantizationError, match="must be one of"):
        quantize(values, "int2", 2)
    with pytest.raises(QuantizationError, match="does not match the table"):
        dequantize(quantize(values, "int8", 2, 8), "int8", 4)


def float64_lookup_reduce(values, rows, groups, scores, num_groups):
    """The lookup-reduce's definition in float64 (memory_ops.lookup_reduce accumulates in float32)."""
    tokens, slots, cores = scores.shape
    gathered = values.double()[rows].view(tokens, slots, cores, -1) * scores.double().unsqueeze(-1)
    one_hot = torch.nn.functional.one_hot(groups, num_groups).double()  # (T, K, E)
    return torch.einsum("tke,tkd->ted", one_hot, gathered.flatten(-2))


def slots(tokens=40, slots_=12, cores=2, num_groups=4, rows=50, seed=1):
    generator = torch.Generator().manual_seed(seed)
    selected = torch.randint(0, rows, (tokens, slots_), generator=generator)
    selected[:, 1] = selected[:, 0]  # duplicate rows in a token
    groups = torch.randint(0, num_groups, (tokens, slots_), generator=generator)
    scores = torch.randn(tokens, slots_, cores, generator=generator)
    return selected, groups, scores


@pytest.mark.parametrize("format, group_size", CASES)
@pytest.mark.parametrize("cores, num_groups", [(2, 4), (1, 1), (2, 1), (1, 4)])
def test_op_equals_the_reference_on_the_dequantized_table_forward_and_score_gradients(
    format, group_size, cores, num_groups
):
    quantized = quantize(table(), format, num_cores=cores, group_size=group_size)
    dequantized = dequantize(quantized, format, group_size)
    rows, groups, scores = slots(cores=cores, num_groups=num_groups)
    scores.requires_grad_(True)
    pooled = lookup_reduce_quantized(quantized, rows, groups, scores, num_groups, format, group_size)
    reference = lookup_reduce_quantized_reference(quantized, rows, groups, scores, num_groups, format, group_size)
    scores64 = scores.detach().double().requires_grad_(True)
    exact = float64_lookup_reduce(dequantized, rows, groups, scores64, num_groups)
    assert pooled.shape == (40, num_groups, 16) and pooled.dtype == torch.float32
    scale = exact.abs().max().item()
    for result in (pooled, reference, lookup_reduce(dequantized, rows, groups, scores, num_groups)):
        torch.testing.assert_close(result.double(), exact, rtol=0, atol=1e-5 * scale)
    grad_output = torch.randn(pooled.shape, generator=torch.Generator().manual_seed(2))
    (grad,) = torch.autograd.grad(pooled, scores, grad_output)
    (grad_exact,) = torch.autograd.grad(exact, scores64, grad_output.double())
    torch.testing.assert_close(grad.double(), grad_exact, rtol=0, atol=1e-5 * grad_exact.abs().max().item())


def test_the_op_fails_a_wrong_table():
    """The comparison above can fail: a table quantized in another format gives other values."""
    quantized = quantize(table(), "int8", 2, 8)
    other = dequantize(quantize(table(), "int4", 2, 8), "int4", 8)
    rows, groups, scores = slots()
    pooled = lookup_reduce_quantized(quantized, rows, groups, scores, 4, "int8", 8)
    assert not torch.allclose(pooled, lookup_reduce(other, rows, groups, scores, 4), atol=1e-3)


@pytest.mark.parametrize("format", ["int8", "int4"])
def test_custom_op_registration_passes_opcheck(format):
    quantized = quantize(table(), format, 2, 8).view(-1, group_bytes(format, 8))
    index = torch.tensor([0, 5, 5, 9, 3, 1])
    bag_of_sample = torch.tensor([0, 0, 1, 1, 1, 3])
    offsets = torch.tensor([0, 2, 5, 5])  # bag 2 empty
    weights = torch.randn(6, requires_grad=True)
    torch.library.opcheck(quantized_bag_sum, (quantized, index, offsets, weights, bag_of_sample, format))


def test_torch_compile_fullgraph_forward_and_score_backward_equal_eager():
    quantized = quantize(table(), "int4", 2, 4)  # the 4-bit op has no meta kernel of its own
    rows, groups, scores = slots()
    compiled = torch.compile(lookup_reduce_quantized, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (lookup_reduce_quantized, compiled):
        leaf = scores.clone().requires_grad_(True)
        out = fn(quantized, rows, groups, leaf, 4, "int4", 4)
        out.square().sum().backward()
        results.append((out.detach(), leaf.grad))
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1])
