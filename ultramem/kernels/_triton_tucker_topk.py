"""Triton kernel of TDQKR's whole selection at inference: rank-1 projections, both axes' top-m, the exact m x m
candidate scores and the final top-m, and the winners' per-core scores, in one program per (token, head).

Reference: `ultramem.memory_ops.tucker_topk` (default, unsigned candidates). At decode the reference is about a dozen
small kernels per memory layer (projections, two `topk`, the candidates' gathers, the candidate kernel, the winners'
gathers and their einsum); each costs a launch gap in a CUDA graph, more than its own work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sortable(scores, positions, SIZE: tl.constexpr):
    """int64 keys whose descending order is the scores' (ties: the lower position first): the float's order-preserving
    int32 image in the high word, the reversed position in the low word."""
    bits = scores.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (SIZE - 1 - positions).to(tl.int64)


@triton.jit
def _position(keys, SIZE: tl.constexpr):
    return SIZE - 1 - (keys & 0x7FFFFFFF)


@triton.jit
def _axis_top(
    scores_ptr,
    vector_ptr,
    base,
    stride_rank,
    head,
    num_keys,
    RANK: tl.constexpr,
    N_PAD: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """The rank-1 projection p = v^T S (n,) of one axis, rounded as the reference rounds it (products in DTYPE, the
    promoted dtype of S and v, summed in float32, rounded once), and its min and max over the n keys; all float32
    holding DTYPE's values."""
    keys = tl.arange(0, N_PAD)
    valid = keys < num_keys
    projected = tl.zeros((N_PAD,), dtype=tl.float32)
    for a in tl.static_range(RANK):
        weight = tl.load(vector_ptr + head * RANK + a).to(tl.float32)
        row = tl.load(scores_ptr + base + a * stride_rank + keys, mask=valid, other=0.0).to(tl.float32)
        projected += (row * weight).to(DTYPE).to(tl.float32)
    projected = projected.to(DTYPE).to(tl.float32)
    high = tl.max(tl.where(valid, projected, float("-inf")), axis=0)
    low = tl.min(tl.where(valid, projected, float("inf")), axis=0)
    return projected, low, high


@triton.jit
def _tucker_topk_kernel(
    row_ptr,
    col_ptr,
    u_ptr,
    t_ptr,
    cores_ptr,
    index_ptr,
    scores_out_ptr,
    stride_item,
    stride_rank,
    num_heads,
    num_keys,
    topk,
    RANK: tl.constexpr,
    NUM_CORES: tl.constexpr,
    N_PAD: tl.constexpr,
    M_PAD: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """Virtual addresses x * n + y of the top-m cells, best first, and their h per-core scores S_row^T C_i S_col."""
    item = tl.program_id(0).to(tl.int64)
    head = item % num_heads
    base = item * stride_item

    # Rank-1 projections and the quadrant: (top-m a, top-m b) or (bottom-m a, bottom-m b), whichever holds the higher
    # rank-1 score (`memory_ops.rank_one_candidates`)
    row_projected, row_low, row_high = _axis_top(row_ptr, u_ptr, base, stride_rank, head, num_keys, RANK, N_PAD, DTYPE)
    col_projected, col_low, col_high = _axis_top(col_ptr, t_ptr, base, stride_rank, head, num_keys, RANK, N_PAD, DTYPE)
    # compared in DTYPE, as the reference compares
    positive = (row_high * col_high).to(DTYPE).to(tl.float32) >= (row_low * col_low).to(DTYPE).to(tl.float32)
    sign = tl.where(positive, 1.0, -1.0)
    keys = tl.arange(0, N_PAD)
    valid = keys < num_keys
    row_best = tl.topk(_sortable(tl.where(valid, row_projected * sign, float("-inf")), keys, N_PAD), M_PAD)
    col_best = tl.topk(_sortable(tl.where(valid, col_projected * sign, float("-inf")), keys, N_PAD), M_PAD)
    candidates = tl.arange(0, M_PAD)
    is_candidate = candidates < topk
    row_index = tl.where(is_candidate, _position(row_best, N_PAD), 0)  # (M_PAD,) key indices, best first
    col_index = tl.where(is_candidate, _position(col_best, N_PAD), 0)

    # Exact scores of the m x m candidate grid with the summed core (`memory_ops.tucker_candidate_topk`)
    grid = tl.zeros((M_PAD, M_PAD), dtype=tl.float32)
    for a in tl.static_range(RANK):
        row_a = tl.load(row_ptr + base + a * stride_rank + row_index).to(tl.float32)
        mixed = tl.zeros((M_PAD,), dtype=tl.float32)
        for b in tl.static_range(RANK):
            core_ab = tl.load(cores_ptr + (head * NUM_CORES * RANK + a) * RANK + b).to(tl.float32)
            for i in tl.static_range(1, NUM_CORES):  # summed in float32 and rounded once, as `cores.sum(-3)`
                core_ab += tl.load(cores_ptr + ((head * NUM_CORES + i) * RANK + a) * RANK + b).to(tl.float32)
            core_ab = core_ab.to(cores_ptr.dtype.element_ty).to(tl.float32)
            col_b = tl.load(col_ptr + base + b * stride_rank + col_index).to(tl.float32)
            mixed += core_ab * col_b
        grid += row_a[:, None] * mixed[None, :]
    grid = tl.where(is_candidate[:, None] & is_candidate[None, :], grid, float("-inf"))
    cell = candidates[:, None] * M_PAD + candidates[None, :]
    best = tl.topk(tl.reshape(_sortable(grid, cell, M_PAD * M_PAD), (M_PAD * M_PAD,)), M_PAD)
    winner_cell = _position(best, M_PAD * M_PAD)  # (M_PAD,) cells, best first
    # The winners' key indices, by a one-hot reduction over the candidates (registers cannot be indexed)
    winner_row = tl.sum(tl.where((winner_cell // M_PAD)[:, None] == candidates[None, :], row_index[None, :], 0), 1)
    winner_col = tl.sum(tl.where((winner_cell % M_PAD)[:, None] == candidates[None, :], col_index[None, :], 0), 1)

    winners = tl.arange(0, M_PAD)
    is_winner = winners < topk
    tl.store(index_ptr + item * topk + winners, winner_row * num_keys + winner_col, mask=is_winner)
    for i in tl.static_range(NUM_CORES):
        score = tl.zeros((M_PAD,), dtype=tl.float32)
        for a in tl.static_range(RANK):
            row_a = tl.load(row_ptr + base + a * stride_rank + winner_row, mask=is_winner, other=0.0).to(tl.float32)
            for b in tl.static_range(RANK):
                core = tl.load(cores_ptr + ((head * NUM_CORES + i) * RANK + a) * RANK + b).to(tl.float32)
                col_b = tl.load(col_ptr + base + b * stride_rank + winner_col, mask=is_winner, other=0.0)
                score += row_a * core * col_b.to(tl.float32)
        tl.store(scores_out_ptr + (item * topk + winners) * NUM_CORES + i, score, mask=is_winner)


TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def selection_tile(num_keys: int, topk: int) -> tuple[int, int, int]:
    """(N_PAD, M_PAD, num_warps): 16 warps from 4,096 padded keys up, 8 from 1,024, keep the sort keys of both axes
    at <= 8 int64 a thread and the kernel at <= 128 registers with no spills (`benchmarks/aot_check.py`: 126 on sm_90
    at the 680M shape, n = 3,264)."""
    padded = triton.next_power_of_2(num_keys)
    return padded, triton.next_power_of_2(topk), 16 if padded >= 4096 else 8 if padded >= 1024 else 4


def _kernel_layout(row_scores: torch.Tensor, col_scores: torch.Tensor) -> bool:
    """Whether the kernel reads both (B, H, r, n) as they are: the same strides, unit along n, tokens H heads apart."""
    strides = row_scores.stride()
    return strides == col_scores.stride() and strides[3] == 1 and strides[0] == row_scores.shape[1] * strides[1]


def tucker_topk_index(
    row_scores: torch.Tensor,
    col_scores: torch.Tensor,
    u: torch.Tensor,
    t: torch.Tensor,
    cores: torch.Tensor,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, r, n) x2 with equal strides, unit stride along n and the heads' stride times H between tokens (views of
    one GEMM's output qualify); u and t (H, r), cores (H, h, r, r) contiguous -> (B, H, m) int64 and (B, H, m, h)."""
    batch, num_heads, rank, num_keys = row_scores.shape
    num_cores = cores.shape[1]
    if not _kernel_layout(row_scores, col_scores):
        row_scores, col_scores = row_scores.contiguous(), col_scores.contiguous()
    index = torch.empty((batch, num_heads, topk), dtype=torch.int64, device=row_scores.device)
    dtype = torch.promote_types(row_scores.dtype, cores.dtype)  # the reference einsum's
    scores = torch.empty((batch, num_heads, topk, num_cores), dtype=dtype, device=row_scores.device)
    if batch == 0:
        return index, scores
    padded, topk_padded, warps = selection_tile(num_keys, topk)
    _tucker_topk_kernel[(batch * num_heads,)](
        row_scores,
        col_scores,
        u,
        t,
        cores,
        index,
        scores,
        row_scores.stride(1),
        row_scores.stride(2),
        num_heads,
        num_keys,
        topk,
        RANK=rank,
        NUM_CORES=num_cores,
        N_PAD=padded,
        M_PAD=topk_padded,
        DTYPE=TRITON_DTYPES[torch.promote_types(row_scores.dtype, u.dtype)],
        num_warps=warps,
    )
    return index, scores
