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
def _sortable(scores, positions):
    """int64 keys whose descending order is the scores' (ties: the lower position first): the float's order-preserving
    int32 image in the high word, the reversed position (< 2^31) in the low word."""
    bits = scores.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - positions).to(tl.int64)


@triton.jit
def _position(keys):
    return 0x7FFFFFFF - (keys & 0x7FFFFFFF)


@triton.jit
def _projection(scores_ptr, vector_ptr, base, stride_rank, head, keys, valid, RANK: tl.constexpr, DTYPE: tl.constexpr):
    """The rank-1 projection v^T S of one axis at `keys`, rounded as the reference rounds it (products in DTYPE, the
    promoted dtype of S and v, summed in float32, rounded once); float32 holding DTYPE's values."""
    projected = tl.zeros(keys.shape, dtype=tl.float32)
    for a in tl.static_range(RANK):
        weight = tl.load(vector_ptr + head * RANK + a).to(tl.float32)
        row = tl.load(scores_ptr + base + a * stride_rank + keys, mask=valid, other=0.0).to(tl.float32)
        projected += (row * weight).to(DTYPE).to(tl.float32)
    return projected.to(DTYPE).to(tl.float32)


@triton.jit
def _extremes(scores_ptr, vector_ptr, base, stride_rank, head, num_keys, RANK: tl.constexpr, CHUNK: tl.constexpr,
              DTYPE: tl.constexpr):  # fmt: skip
    """Min and max of one axis' projection over its n keys, CHUNK keys at a time."""
    keys = tl.arange(0, CHUNK)
    valid = keys < num_keys
    projected = _projection(scores_ptr, vector_ptr, base, stride_rank, head, keys, valid, RANK, DTYPE)
    high = tl.max(tl.where(valid, projected, float("-inf")), axis=0)
    low = tl.min(tl.where(valid, projected, float("inf")), axis=0)
    for start in range(CHUNK, num_keys, CHUNK):
        keys = start + tl.arange(0, CHUNK)
        valid = keys < num_keys
        projected = _projection(scores_ptr, vector_ptr, base, stride_rank, head, keys, valid, RANK, DTYPE)
        high = tl.maximum(high, tl.max(tl.where(valid, projected, float("-inf")), axis=0))
        low = tl.minimum(low, tl.min(tl.where(valid, projected, float("inf")), axis=0))
    return low, high


@triton.jit
def _axis_best(scores_ptr, vector_ptr, base, stride_rank, head, num_keys, sign, RANK: tl.constexpr,
               CHUNK: tl.constexpr, M_PAD: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """Sort keys of the M_PAD best keys of one axis by sign * projection, best first: each chunk's best merged into
    those of the chunks before it."""
    keys = tl.arange(0, CHUNK)
    valid = keys < num_keys
    projected = _projection(scores_ptr, vector_ptr, base, stride_rank, head, keys, valid, RANK, DTYPE)
    best = tl.topk(_sortable(tl.where(valid, projected * sign, float("-inf")), keys), M_PAD)
    for start in range(CHUNK, num_keys, CHUNK):
        keys = start + tl.arange(0, CHUNK)
        valid = keys < num_keys
        projected = _projection(scores_ptr, vector_ptr, base, stride_rank, head, keys, valid, RANK, DTYPE)
        chunk_best = tl.topk(_sortable(tl.where(valid, projected * sign, float("-inf")), keys), M_PAD)
        best = tl.topk(tl.reshape(tl.join(best, chunk_best), (2 * M_PAD,)), M_PAD)
    return best


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
    CHUNK: tl.constexpr,
    M_PAD: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """Virtual addresses x * n + y of the top-m cells, best first, and their h per-core scores S_row^T C_i S_col."""
    item = tl.program_id(0).to(tl.int64)
    head = item % num_heads
    base = item * stride_item

    # The quadrant: (top-m a, top-m b) or (bottom-m a, bottom-m b) of the rank-1 projections a = u^T S_row and
    # b = t^T S_col, whichever holds the higher rank-1 score (`memory_ops.rank_one_candidates`); compared in DTYPE, as
    # the reference compares
    row_low, row_high = _extremes(row_ptr, u_ptr, base, stride_rank, head, num_keys, RANK, CHUNK, DTYPE)
    col_low, col_high = _extremes(col_ptr, t_ptr, base, stride_rank, head, num_keys, RANK, CHUNK, DTYPE)
    positive = (row_high * col_high).to(DTYPE).to(tl.float32) >= (row_low * col_low).to(DTYPE).to(tl.float32)
    sign = tl.where(positive, 1.0, -1.0)
    row_best = _axis_best(row_ptr, u_ptr, base, stride_rank, head, num_keys, sign, RANK, CHUNK, M_PAD, DTYPE)
    col_best = _axis_best(col_ptr, t_ptr, base, stride_rank, head, num_keys, sign, RANK, CHUNK, M_PAD, DTYPE)
    candidates = tl.arange(0, M_PAD)
    is_candidate = candidates < topk
    row_index = tl.where(is_candidate, _position(row_best), 0)  # (M_PAD,) key indices, best first
    col_index = tl.where(is_candidate, _position(col_best), 0)

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
    best = tl.topk(tl.reshape(_sortable(grid, cell), (M_PAD * M_PAD,)), M_PAD)
    winner_cell = _position(best)  # (M_PAD,) cells, best first
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


MAX_CHUNK = 2048  # keys an axis' sort holds at once; more are taken a chunk at a time, merged into the best so far


def selection_tile(num_keys: int, topk: int) -> tuple[int, int, int]:
    """(CHUNK, M_PAD, num_warps): chunks of up to 2,048 keys; 16 warps from a 64 x 64 candidate grid, else 8 from a
    chunk of 1,024: at most 128 registers with no spills on sm_80 and sm_90 at the paper's shapes
    (`benchmarks/gpu/aot_check.py`; the 680M shape took 252 with 8 warps, chunks of 4,096 spilled)."""
    chunk, padded_topk = min(triton.next_power_of_2(num_keys), MAX_CHUNK), triton.next_power_of_2(topk)
    return chunk, padded_topk, 16 if padded_topk * padded_topk >= 4096 else 8 if chunk >= 1024 else 4


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
    chunk, topk_padded, warps = selection_tile(num_keys, topk)
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
        CHUNK=chunk,
        M_PAD=topk_padded,
        DTYPE=TRITON_DTYPES[torch.promote_types(row_scores.dtype, u.dtype)],
        num_warps=warps,
    )
    return index, scores
