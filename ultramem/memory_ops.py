"""Pure-PyTorch memory-layer operators: `lookup_reduce` and `tucker_candidate_topk` are the numerical
reference for the Triton kernels and for `lookup_reduce_embedding_bag`, the fast path on CPU.

This module is flat on purpose: `save_pretrained` copies it next to `modeling_ultramem.py`, so a
checkpoint loaded with `trust_remote_code=True` runs this path without the `ultramem` package.
Every function is vectorized (no Python loop over tokens, heads or candidates).

Shapes use T for flattened tokens, H memory heads, K = H * m selected slots per token,
r Tucker rank, h MCS cores, E IVE groups, N physical rows and Dv the value dim.
"""

from __future__ import annotations

import contextlib
import math
import mmap

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def lookup_reduce(
    values: torch.Tensor,
    rows: torch.Tensor,
    groups: torch.Tensor,
    scores: torch.Tensor,
    num_groups: int,
) -> torch.Tensor:
    """Gather the selected physical rows and pool them into their IVE groups.

    out[t, e, c * Dv/h + j] = sum_k [groups[t, k] == e] * scores[t, k, c] * values[rows[t, k], c * Dv/h + j]

    Args:
        values: (N, Dv) physical value table.
        rows: (T, K) int64 physical row of every selected slot.
        groups: (T, K) int64 IVE projector group in [0, num_groups) of every selected slot.
        scores: (T, K, h) score of every MCS core for every selected slot; chunk c of a row is weighted
            by core c.
        num_groups: E, the number of IVE groups.

    Returns:
        (T, E, Dv) pooled values in the dtype of `values`, accumulated in float32.
    """
    num_tokens, num_slots = rows.shape
    num_cores = scores.shape[-1]
    value_dim = values.shape[-1]
    gathered = F.embedding(rows, values).float()  # (T, K, Dv)
    weighted = gathered.view(num_tokens, num_slots, num_cores, value_dim // num_cores) * scores.float().unsqueeze(-1)
    weighted = weighted.view(num_tokens, num_slots, value_dim)  # (T, K, Dv)
    if num_groups == 1:
        pooled = weighted.sum(dim=1, keepdim=True)  # (T, 1, Dv)
    else:
        group_one_hot = F.one_hot(groups, num_groups).float()  # (T, K, E)
        pooled = torch.bmm(group_one_hot.transpose(1, 2), weighted)  # (T, E, Dv)
    return pooled.to(values.dtype)


EMBEDDING_BAG_MIN_TOKENS = 32
"""Fewest tokens for which `lookup_reduce_embedding_bag` uses embedding_bag: the crossover measured on CPU
(one thread, H*m = 32 slots, Dv = 128: reference 23 / 75 / 239 us at 1 / 16 / 64 tokens, embedding_bag
79 / 97 / 193 us; embedding_bag's fixed cost is ~60 us)."""
EMBEDDING_BAG_SUM = 0  # embedding_bag's mode number for "sum" in the aten ops


# Touching a fresh 4 KB page costs ~2 us (fault + zero fill), a fresh 2 MB huge page ~230 us (measured on this
# project's CPU machine): huge pages pay once the rows written cover about a quarter of the 4 KB pages of
# the 2 MB blocks they touch.
SMALL_PAGE, HUGE_PAGE, HUGE_PAGE_MIN_FILL = 4096, 2 << 20, 0.25


def _worth_huge_pages(rows: torch.Tensor, row_bytes: int) -> bool:
    """Whether the sorted unique `rows` fill enough of the 2 MB blocks they touch for huge pages to be cheaper."""
    start = rows * row_bytes
    small = torch.unique_consecutive(start // SMALL_PAGE).numel()
    huge = torch.unique_consecutive(start // HUGE_PAGE).numel()
    return small >= HUGE_PAGE_MIN_FILL * huge * (HUGE_PAGE // SMALL_PAGE)


def zeros_in_fresh_pages(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, rows_written: torch.Tensor | None = None
) -> torch.Tensor:
    """A zero tensor whose CPU pages the kernel zeroes on first touch (a fresh anonymous mapping).

    `torch.zeros` writes every page up front. A value table's gradient, of which a step writes only the
    selected rows, paid that write for the whole table at every backward: a 512 MB gradient took ~240 ms
    of CPU time in page faults and zero-filling, against ~80 ms for the pages of the rows written. Pages
    never written are read (e.g. by the optimizer) as the kernel's shared zero page. When the sorted
    `rows_written` (of dim 0) fill the blocks they touch densely, the mapping asks for transparent huge
    pages: one fault per 2 MB instead of 512 (a 32 MB gradient with 63% of its rows written: 16 -> 3.7 ms).
    Other devices use `torch.zeros`.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    row_bytes = nbytes // shape[0] if shape[0] else 0
    if rows_written is not None and hasattr(mmap, "MADV_HUGEPAGE") and _worth_huge_pages(rows_written, row_bytes):
        with contextlib.suppress(OSError):  # a hint: a kernel without transparent huge pages refuses it (EINVAL)
            pages.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(pages, dtype=dtype).view(shape)


class _WeightedBagSum(torch.autograd.Function):
    """`F.embedding_bag(mode="sum", per_sample_weights=...)` with its backward written out.

    PyTorch's own backward allocates the table-sized gradient with `torch.zeros`; this one writes the rows
    into `zeros_in_fresh_pages` instead (the same dense gradient, see there). Bags are contiguous runs of
    samples: `bag_of_sample` ascending, `offsets` the first sample of every bag.
    """

    @staticmethod
    def forward(
        ctx,
        table: torch.Tensor,
        index: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor,
        bag_of_sample: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(table, index, offsets, weights, bag_of_sample)
        return F.embedding_bag(index, table, offsets, mode="sum", per_sample_weights=weights)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_bags: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        table, index, offsets, weights, bag_of_sample = ctx.saved_tensors
        grad_table = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_table = _table_gradient(grad_bags, table, index, weights, bag_of_sample)
        if ctx.needs_input_grad[3]:  # <grad of its bag, its row> per sample, without materializing either (S, dim)
            grad_weights = torch.ops.aten._embedding_bag_per_sample_weights_backward(
                grad_bags, table, index, offsets, bag_of_sample, EMBEDDING_BAG_SUM
            )
        return grad_table, None, None, grad_weights, None


def _run_starts(lengths: torch.Tensor) -> torch.Tensor:
    """The first position of each of consecutive runs of `lengths` items (embedding_bag's `offsets`)."""
    return lengths.cumsum(0) - lengths


def _table_gradient(
    grad_bags: torch.Tensor, table: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, bag_of_sample: torch.Tensor
) -> torch.Tensor:
    """The embedding_bag's table gradient: row i gets the weighted bag gradients of its samples, in fresh pages.

    The transpose of the forward, as one `embedding_bag` over `grad_bags` with the samples grouped by row: it
    reads each bag gradient in place instead of materializing the (S, dim) weighted rows for `index_add_`
    (measured 26 -> 19 ms at 32k samples of 64, 105 -> 75 ms at 32k of 256, page faults included).
    """
    sorted_index, order = index.sort(stable=True)
    rows, samples_per_row = torch.unique_consecutive(sorted_index, return_counts=True)
    offsets = _run_starts(samples_per_row)
    grad_rows = F.embedding_bag(
        bag_of_sample[order], grad_bags, offsets, mode="sum", per_sample_weights=weights[order]
    )  # (rows, dim)
    grad_table = zeros_in_fresh_pages(table.shape, table.dtype, table.device, rows_written=rows)
    return grad_table.index_copy_(0, rows, grad_rows)


def lookup_reduce_embedding_bag(
    values: torch.Tensor,
    rows: torch.Tensor,
    groups: torch.Tensor,
    scores: torch.Tensor,
    num_groups: int,
) -> torch.Tensor:
    """`lookup_reduce` as one `F.embedding_bag`: the fast path on CPU, same contract and gradients.

    The reference materializes the (T, K, Dv) gathered rows and, for E > 1, pools them with a one-hot
    bmm; `embedding_bag` reads each selected row once and accumulates in place. The table is viewed as
    (N*h, Dv/h) chunks (chunk c of row n is row n*h + c) so each chunk gets its own core's score as a
    per-sample weight; slots are sorted by group so that every (token, core, group) is one contiguous bag.
    Values and scores are taken in the values' dtype (embedding_bag's requirement); the value gradient is
    built in fresh pages (`_WeightedBagSum`). Below `EMBEDDING_BAG_MIN_TOKENS` tokens (decoding) the
    reference runs instead: its fewer ops cost less there.
    """
    num_tokens, num_slots = rows.shape
    if num_tokens < EMBEDDING_BAG_MIN_TOKENS:
        return lookup_reduce(values, rows, groups, scores, num_groups)
    num_cores = scores.shape[-1]
    value_dim = values.shape[-1]
    if num_groups > 1:
        groups, order = groups.sort(dim=-1)
        rows = rows.gather(-1, order)
        scores = scores.gather(1, order.unsqueeze(-1).expand_as(scores))
    core = torch.arange(num_cores, device=rows.device).unsqueeze(-1)  # (h, 1)
    index = rows.unsqueeze(1) * num_cores + core  # (T, h, K): samples ordered (token, core, group)
    token_core = torch.arange(num_tokens * num_cores, device=rows.device).view(num_tokens, num_cores, 1)
    bag_of_sample = (token_core * num_groups + groups.unsqueeze(1)).flatten()  # bag (token, core, group), ascending
    num_bags = num_tokens * num_cores * num_groups
    offsets = _run_starts(torch.bincount(bag_of_sample, minlength=num_bags))  # empty bags pool to zero
    weights = scores.transpose(1, 2).to(values.dtype)  # (T, h, K)
    pooled = _WeightedBagSum.apply(
        values.view(-1, value_dim // num_cores), index.flatten(), offsets, weights.flatten(), bag_of_sample
    )  # (T*h*E, Dv/h)
    return pooled.view(num_tokens, num_cores, num_groups, -1).transpose(1, 2).reshape(num_tokens, num_groups, value_dim)


def tucker_candidate_topk(
    row_scores: torch.Tensor,
    col_scores: torch.Tensor,
    cores: torch.Tensor,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact Tucker scores on the m x m candidate grid, then the final top-m (TDQKR steps 6-7).

    The per-core score of candidate (x, y) is S_row[:, x]^T C^(i) S_col[:, y]; the top-m is taken on
    the sum over cores (the full Tucker score), and the per-core scores of the winners are returned
    for multi-core scoring.

    Args:
        row_scores: (..., r, m) scores of the m candidate rows for each of the r query parts.
        col_scores: (..., r, m) same for the m candidate columns.
        cores: (..., h, r, r) the h MCS component cores, broadcastable against the leading dims.
        topk: number of winners to keep (m).

    Returns:
        flat_index: (..., topk) int64 index x * m + y into the candidate grid, best first.
        core_scores: (..., topk, h) per-core scores of the winners.
    """
    # S_row^T C^(i) S_col as two broadcast matmuls (a three-operand einsum costs ~2x at decode, T = 1)
    row_times_core = row_scores.unsqueeze(-3).transpose(-1, -2) @ cores  # (..., h, m, r)
    per_core = (row_times_core @ col_scores.unsqueeze(-3)).flatten(-2)  # (..., h, m*m)
    _, flat_index = per_core.sum(dim=-2).topk(topk, dim=-1)  # (..., topk)
    gather_index = flat_index.unsqueeze(-2).expand(*per_core.shape[:-1], topk)  # (..., h, topk)
    core_scores = per_core.gather(-1, gather_index).transpose(-1, -2)  # (..., topk, h)
    return flat_index, core_scores
