"""The lookup-reduce over a quantized table: PyTorch's quantized embedding-bag ops on CPU, and the reference.

`lookup_reduce_quantized` has the contract of `memory_ops.lookup_reduce` (rows, groups (T, K), scores (T, K, h) ->
(T, E, Dv) float32) on a quantized table (`format`). It builds its bags as `embedding_bag_ops.lookup_reduce_embedding_bag`
does, with quantization groups in place of MCS chunks: sample (token, group j, slot k) reads group j of row
rows[t, k] (row rows * G + j of the (N*G, group_bytes) view), weighted by the score of the core that owns group j,
and bag (token, j, IVE group) sums its samples. On CPU the bags go to `ultramem::quantized_bag_sum`, a custom op on
`torch.ops.quantized.embedding_bag_{byte,4bit}_rowwise_offsets` with a fake kernel (torch.compile) and an autograd
formula for the scores only: the tables are frozen, and a score's gradient is the dot product of the dequantized
group it weights with its bag's output gradient. On CUDA, where Triton can launch, the Triton kernel
(`ultramem.kernels.quantized_lookup`: rows read as bytes, dequantized in registers, score backward); PyTorch's CUDA
versions of the quantized ops are unoptimized. Elsewhere the reference runs: gather the selected rows, `dequantize`
them, `memory_ops.lookup_reduce`.
"""

from __future__ import annotations

import torch

from ..embedding_bag_ops import chunk_bags
from ..kernels import triton_available
from ..kernels.quantized_lookup import quantized_lookup_reduce
from ..memory_ops import lookup_reduce
from .format import dequantize, group_bytes


def _group_size_of(weight: torch.Tensor, format: str) -> int:
    """Columns per group of the (N*G, group_bytes) view `weight`."""
    return weight.shape[1] - 8 if format == "int8" else (weight.shape[1] - 4) * 2


@torch.library.custom_op("ultramem::quantized_bag_sum", mutates_args=())
def quantized_bag_sum(
    weight: torch.Tensor,
    index: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor,
    bag_of_sample: torch.Tensor,
    format: str,
) -> torch.Tensor:
    """Weighted sums of the quantized rows `weight[index]` of each bag (bags: contiguous runs of samples starting
    at `offsets`; `bag_of_sample` is used by the backward) -> (bags, group_size) float32."""
    op = (
        torch.ops.quantized.embedding_bag_byte_rowwise_offsets
        if format == "int8"
        else torch.ops.quantized.embedding_bag_4bit_rowwise_offsets
    )
    return op(weight, index, offsets, False, 0, False, per_sample_weights.float(), None, False)


@quantized_bag_sum.register_fake
def _(weight, index, offsets, per_sample_weights, bag_of_sample, format):
    return weight.new_empty((offsets.shape[0], _group_size_of(weight, format)), dtype=torch.float32)


@torch.library.custom_op("ultramem::quantized_sample_dot", mutates_args=())
def quantized_sample_dot(
    weight: torch.Tensor, index: torch.Tensor, grad_bags: torch.Tensor, bag_of_sample: torch.Tensor, format: str
) -> torch.Tensor:
    """<dequantized weight[index[s]], grad_bags[bag_of_sample[s]]> for every sample s -> (S,) float32."""
    group_size = _group_size_of(weight, format)
    rows = dequantize(weight.index_select(0, index), format, group_size)  # (S, g)
    return (rows * grad_bags.float().index_select(0, bag_of_sample)).sum(-1)


@quantized_sample_dot.register_fake
def _(weight, index, grad_bags, bag_of_sample, format):
    return grad_bags.new_empty(index.shape, dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    weight, index, _, per_sample_weights, bag_of_sample, format = inputs
    ctx.save_for_backward(weight, index, bag_of_sample)
    ctx.format, ctx.weights_dtype = format, per_sample_weights.dtype


def _backward(ctx, grad_bags: torch.Tensor):
    weight, index, bag_of_sample = ctx.saved_tensors
    grad_weights = None
    if ctx.needs_input_grad[3]:
        grad_weights = quantized_sample_dot(weight, index, grad_bags, bag_of_sample, ctx.format).to(ctx.weights_dtype)
    return None, None, None, grad_weights, None, None


quantized_bag_sum.register_autograd(_backward, setup_context=_setup_context)


def lookup_reduce_quantized(
    weight: torch.Tensor,
    rows: torch.Tensor,
    groups: torch.Tensor,
    scores: torch.Tensor,
    num_groups: int,
    format: str,
    group_size: int,
) -> torch.Tensor:
    """`memory_ops.lookup_reduce` on the quantized table `weight` (N, width) -> (T, E, Dv) float32.

    On CPU through `ultramem::quantized_bag_sum` (the table is read in place: a mapped file's selected rows only);
    on CUDA through the Triton kernel `ultramem::quantized_lookup_reduce` where Triton can launch; elsewhere
    `lookup_reduce_quantized_reference`. No small-batch cutoff on CPU: the reference is faster only for int8 lookups
    under ~32K pooled elements (tokens x slots x Dv), by at most ~20 us of the op's ~70 us fixed cost (measured, one
    thread: 70 / 50 us at 1 token, 32 slots, Dv = 128; 73 / 59 at Dv = 512; int4 and Dv = 1024 never), under 1% of a
    decoded token.
    """
    if weight.device.type == "cuda" and triton_available():
        return quantized_lookup_reduce(weight, rows, groups, scores, num_groups, format, group_size)
    if weight.device.type != "cpu":
        return lookup_reduce_quantized_reference(weight, rows, groups, scores, num_groups, format, group_size)
    num_tokens, num_cores = rows.shape[0], scores.shape[-1]
    per_group = group_bytes(format, group_size)
    groups_per_row = weight.shape[1] // per_group
    group_scores = scores.repeat_interleave(groups_per_row // num_cores, dim=-1)  # (T, K, G): group j's core score
    index, offsets, weights, bag_of_sample = chunk_bags(rows, groups, group_scores, num_groups)
    pooled = quantized_bag_sum(
        weight.view(-1, per_group), index, offsets, weights.float(), bag_of_sample, format
    )  # (T*G*E, g)
    pooled = pooled.view(num_tokens, groups_per_row, num_groups, group_size).transpose(1, 2)
    return pooled.reshape(num_tokens, num_groups, groups_per_row * group_size)


def lookup_reduce_quantized_reference(
    weight: torch.Tensor,
    rows: torch.Tensor,
    groups: torch.Tensor,
    scores: torch.Tensor,
    num_groups: int,
    format: str,
    group_size: int,
) -> torch.Tensor:
    """The reference: the selected rows (each once) dequantized, then `memory_ops.lookup_reduce` -> float32."""
    unique, inverse = torch.unique(rows, return_inverse=True)
    table = dequantize(weight.index_select(0, unique), format, group_size)
    return lookup_reduce(table, inverse, groups, scores.float(), num_groups)
