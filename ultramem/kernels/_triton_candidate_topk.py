"""Triton kernel of TDQKR's exact candidate scoring and final top-m (steps 6-7).

Reference: `ultramem.memory_ops.tucker_candidate_topk`. One program per (token, head) keeps the
m x m grid of summed Tucker scores in registers and selects the top-m there, so neither the
(h, m, m) per-core scores nor the m x m grid ever reach memory; only the winners' indices do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _candidate_index_kernel(
    row_ptr,
    col_ptr,
    core_ptr,
    out_ptr,
    num_candidates,
    topk,
    RANK: tl.constexpr,
    M_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
):
    """Indices x * m + y of the top-k cells of S_row^T C S_col, best first (ties: lower index first)."""
    item = tl.program_id(0).to(tl.int64)
    xs = tl.arange(0, M_PAD)
    valid = xs < num_candidates
    base = item * RANK * num_candidates
    grid = tl.zeros((M_PAD, M_PAD), dtype=tl.float32)
    for a in tl.static_range(RANK):
        row_a = tl.load(row_ptr + base + a * num_candidates + xs, mask=valid, other=0.0).to(tl.float32)
        mixed = tl.zeros((M_PAD,), dtype=tl.float32)  # (C S_col)[a, :]
        for b in tl.static_range(RANK):
            core_ab = tl.load(core_ptr + item * RANK * RANK + a * RANK + b).to(tl.float32)
            col_b = tl.load(col_ptr + base + b * num_candidates + xs, mask=valid, other=0.0).to(tl.float32)
            mixed += core_ab * col_b
        grid += row_a[:, None] * mixed[None, :]
    grid = tl.where(valid[:, None] & valid[None, :], grid, float("-inf"))
    # Sortable int64 keys: the float's order-preserving int32 image in the high word, the reversed
    # cell position in the low word (unique keys; equal scores rank the lower position first).
    bits = grid.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    position = xs[:, None] * M_PAD + xs[None, :]
    keys = (ordered.to(tl.int64) << 32) | (M_PAD * M_PAD - 1 - position).to(tl.int64)
    best = tl.topk(tl.reshape(keys, (M_PAD * M_PAD,)), K_PAD)
    cell = M_PAD * M_PAD - 1 - (best & 0x7FFFFFFF)
    flat_index = (cell // M_PAD) * num_candidates + cell % M_PAD
    ks = tl.arange(0, K_PAD)
    tl.store(out_ptr + item * topk + ks, flat_index, mask=ks < topk)


def candidate_tile(num_candidates: int, topk: int) -> tuple[int, int, int]:
    """(M_PAD, K_PAD, num_warps): 8 warps from a 64 x 64 grid up keep the sorted keys in registers."""
    padded = triton.next_power_of_2(num_candidates)
    return padded, triton.next_power_of_2(topk), 8 if padded * padded >= 4096 else 4


def candidate_index(
    row_scores: torch.Tensor, col_scores: torch.Tensor, core_sum: torch.Tensor, topk: int
) -> torch.Tensor:
    """(B, r, m), (B, r, m), (B, r, r) contiguous -> (B, topk) int64 flat indices, best first."""
    num_items, rank, num_candidates = row_scores.shape
    out = torch.empty((num_items, topk), dtype=torch.int64, device=row_scores.device)
    if num_items == 0:
        return out
    padded, topk_padded, warps = candidate_tile(num_candidates, topk)
    _candidate_index_kernel[(num_items,)](
        row_scores,
        col_scores,
        core_sum,
        out,
        num_candidates,
        topk,
        RANK=rank,
        M_PAD=padded,
        K_PAD=topk_padded,
        num_warps=warps,
    )
    return out
