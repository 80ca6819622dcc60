"""Triton kernels of the lookup-reduce over a quantized value table (forward, score gradient).

Reference: `ultramem.quantized.ops.lookup_reduce_quantized_reference` (dequantize the selected rows, then
`memory_ops.lookup_reduce`); the kernels compute the same pooled vectors and score gradients without ever writing a
dequantized row: each row is read once as its bytes and decoded in registers.

Table layout (`ultramem.quantized.format`): weight (N, W) uint8, each row G groups of g columns, group j at byte
j * group_bytes of the row:
- int8: [g uint8 | fp32 scale | fp32 bias] (group_bytes = g + 8);
- int4: [g/2 bytes, column 2i in the low nibble, 2i+1 in the high one | fp16 scale | fp16 bias] (g/2 + 4).
A value is q * scale + bias. Groups never straddle an MCS chunk: group j belongs to core j // (G / h).

Pooling folds the scale into the score and applies the bias once per bag:
    sum_k s_k (q_k * scale_k + bias_k) = sum_k (s_k scale_k) q_k + sum_k s_k bias_k,
so a program multiplies its payload tile by one number per slot and adds one number per IVE group. Scales and
biases are assembled from their bytes (little-endian), so no load needs 4-byte alignment (g + 8 need not be a
multiple of 4). Imported lazily (first launch), so `TRITON_INTERPRET=1` set by a test before that point is honoured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ultramem.kernels._triton_lookup_reduce import backward_tile, forward_configs, forward_size_class, forward_tiles

# The float kernels' tiles; the score gradient with 8 warps instead of 4 (4 elements a thread): at 4 warps it takes
# 167 registers a thread on sm_90, at 8 it takes 80 (no spills either way; `triton.compile` + cuobjdump, 151M-1.6B).
SCORE_GRAD_WARPS = 8


@triton.jit
def _load_float(ptr, offsets, mask, HALF: tl.constexpr):
    """The fp32 (HALF: fp16) number at byte `offsets` of ptr, as float32, from its little-endian bytes."""
    bits = tl.load(ptr + offsets, mask=mask, other=0).to(tl.uint32)
    bits |= tl.load(ptr + offsets + 1, mask=mask, other=0).to(tl.uint32) << 8
    if HALF:
        return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    bits |= tl.load(ptr + offsets + 2, mask=mask, other=0).to(tl.uint32) << 16
    bits |= tl.load(ptr + offsets + 3, mask=mask, other=0).to(tl.uint32) << 24
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scale_bias(weight_ptr, group_starts, group_size, mask, INT4: tl.constexpr):
    """(scale, bias) float32 of the groups starting at byte `group_starts` of the table."""
    if INT4:
        meta = group_starts + group_size // 2
        return _load_float(weight_ptr, meta, mask, True), _load_float(weight_ptr, meta + 2, mask, True)
    meta = group_starts + group_size
    return _load_float(weight_ptr, meta, mask, False), _load_float(weight_ptr, meta + 4, mask, False)


@triton.jit
def _payload(weight_ptr, group_starts, cols, mask, INT4: tl.constexpr):
    """(len(group_starts), len(cols)) float32 quantized levels q of columns `cols` of the groups."""
    if INT4:
        packed = tl.load(weight_ptr + group_starts[:, None] + (cols // 2)[None, :], mask=mask, other=0)
        return ((packed.to(tl.int32) >> ((cols % 2) * 4)[None, :]) & 0xF).to(tl.float32)
    return tl.load(weight_ptr + group_starts[:, None] + cols[None, :], mask=mask, other=0).to(tl.float32)


@triton.autotune(
    configs=forward_configs(), key=["num_slots", "width", "group_size", "INT4", "NUM_GROUPS", "size_class"]
)
@triton.jit
def _forward_kernel(
    weight_ptr,
    rows_ptr,
    groups_ptr,
    scores_ptr,
    out_ptr,
    num_slots,
    width,
    group_size,
    group_bytes,
    groups_per_core,
    num_cores,
    value_dim,
    size_class,
    INT4: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[t, e, group j] = sum_k [groups[t,k]==e] scores[t,k,core(j)] dequantized(weight[rows[t,k]], group j)."""
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)  # quantization group j of the row
    core = group // groups_per_core
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < group_size
    ive_ids = tl.arange(0, GROUPS_PAD)
    # one accumulator per (IVE group, slot lane, column), summed over the lanes once after the loop: no cross-warp
    # reduction inside it (the first GPU run measured the lookup-reduce forward built that way at 2.3% of copy bandwidth)
    acc = tl.zeros((GROUPS_PAD, BLOCK_K, BLOCK_D), dtype=tl.float32)
    bias_acc = tl.zeros((GROUPS_PAD, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, num_slots, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        slot_mask = ks < num_slots
        slots = token * num_slots + ks
        rows = tl.load(rows_ptr + slots, mask=slot_mask, other=0).to(tl.int64)  # N * W may exceed 2**31
        ive = tl.load(groups_ptr + slots, mask=slot_mask, other=0)
        scores = tl.load(scores_ptr + slots * num_cores + core, mask=slot_mask, other=0.0).to(tl.float32)
        starts = rows * width + group * group_bytes
        scale, bias = _scale_bias(weight_ptr, starts, group_size, slot_mask, INT4)
        levels = _payload(weight_ptr, starts, cols, slot_mask[:, None] & col_mask[None, :], INT4)
        weighted = levels * (scores * scale)[:, None]
        biases = scores * bias
        chosen = ive[None, :] == ive_ids[:, None]  # (GROUPS_PAD, BLOCK_K)
        acc += tl.where(chosen[:, :, None], weighted[None, :, :], 0.0)
        bias_acc += tl.where(chosen, biases[None, :], 0.0)
    out_offsets = (token * NUM_GROUPS + ive_ids[:, None]) * value_dim + group * group_size + cols[None, :]
    out_mask = (ive_ids[:, None] < NUM_GROUPS) & col_mask[None, :]
    pooled = tl.sum(acc, axis=1) + tl.sum(bias_acc, axis=1)[:, None]  # (GROUPS_PAD, BLOCK_D)
    tl.store(out_ptr + out_offsets, pooled, mask=out_mask)


@triton.jit
def _score_grad_kernel(
    grad_out_ptr,
    weight_ptr,
    rows_ptr,
    groups_ptr,
    grad_scores_ptr,
    num_slots,
    width,
    group_size,
    group_bytes,
    groups_per_core,
    num_cores,
    value_dim,
    INT4: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """grad_scores[t,k,c] = sum over core c's groups j of scale * <grad_out[t, groups[t,k], j], q> + bias * sum(grad)."""
    token = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    slot_mask = ks < num_slots
    slots = token * num_slots + ks
    rows = tl.load(rows_ptr + slots, mask=slot_mask, other=0).to(tl.int64)
    ive = tl.load(groups_ptr + slots, mask=slot_mask, other=0)
    grad_rows = (token * NUM_GROUPS + ive) * value_dim
    for core in range(num_cores):
        grad_score = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for group in range(core * groups_per_core, (core + 1) * groups_per_core):
            starts = rows * width + group * group_bytes
            scale, bias = _scale_bias(weight_ptr, starts, group_size, slot_mask, INT4)
            dot = tl.zeros((BLOCK_K,), dtype=tl.float32)
            grad_sum = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for d0 in range(0, group_size, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                mask = slot_mask[:, None] & (cols < group_size)[None, :]
                grad = tl.load(
                    grad_out_ptr + grad_rows[:, None] + group * group_size + cols[None, :], mask=mask, other=0.0
                ).to(tl.float32)
                dot += tl.sum(grad * _payload(weight_ptr, starts, cols, mask, INT4), axis=1)
                grad_sum += tl.sum(grad, axis=1)
            grad_score += scale * dot + bias * grad_sum
        tl.store(
            grad_scores_ptr + slots * num_cores + core, grad_score.to(grad_scores_ptr.dtype.element_ty), mask=slot_mask
        )


def _geometry(weight: torch.Tensor, scores: torch.Tensor, format: str, group_size: int) -> dict[str, int]:
    """The table's sizes the kernels take: row width, group size and bytes, groups per MCS core, h, Dv."""
    group_bytes = group_size + 8 if format == "int8" else group_size // 2 + 4
    groups_per_row = weight.shape[1] // group_bytes
    return dict(
        width=weight.shape[1],
        group_size=group_size,
        group_bytes=group_bytes,
        groups_per_core=groups_per_row // scores.shape[-1],
        num_cores=scores.shape[-1],
        value_dim=groups_per_row * group_size,
    )


def forward(
    weight: torch.Tensor,
    rows: torch.Tensor,
    groups: torch.Tensor,
    scores: torch.Tensor,
    num_groups: int,
    format: str,
    group_size: int,
) -> torch.Tensor:
    """Launch the forward on contiguous, validated inputs; returns (T, E, Dv) float32."""
    num_tokens, num_slots = rows.shape
    sizes = _geometry(weight, scores, format, group_size)
    out = torch.empty((num_tokens, num_groups, sizes["value_dim"]), dtype=torch.float32, device=weight.device)
    if num_tokens == 0:
        return out
    if num_slots == 0:
        return out.zero_()

    def grid(tile: dict) -> tuple[int, int, int]:
        return (num_tokens, sizes["value_dim"] // group_size, triton.cdiv(group_size, tile["BLOCK_D"]))

    _forward_kernel[grid](
        weight,
        rows,
        groups,
        scores,
        out,
        num_slots,
        **sizes,
        size_class=forward_size_class(num_tokens),
        INT4=format == "int4",
        NUM_GROUPS=num_groups,
        GROUPS_PAD=triton.next_power_of_2(num_groups),
        **forward_tiles(_forward_kernel, num_slots, group_size),
    )
    return out


def score_grad(
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    groups: torch.Tensor,
    scores: torch.Tensor,
    format: str,
    group_size: int,
) -> torch.Tensor:
    """Gradient of the forward w.r.t. `scores` (the table is frozen), in scores' dtype; grad_out contiguous."""
    num_tokens, num_slots = rows.shape
    grad_scores = torch.empty_like(scores)
    if num_tokens == 0 or num_slots == 0:
        return grad_scores
    sizes = _geometry(weight, scores, format, group_size)
    block_k, block_d, _ = backward_tile(num_slots, group_size)
    _score_grad_kernel[(num_tokens, triton.cdiv(num_slots, block_k))](
        grad_out,
        weight,
        rows,
        groups,
        grad_scores,
        num_slots,
        **sizes,
        INT4=format == "int4",
        NUM_GROUPS=grad_out.shape[1],
        BLOCK_K=block_k,
        BLOCK_D=block_d,
        num_warps=SCORE_GRAD_WARPS,
    )
    return grad_scores
