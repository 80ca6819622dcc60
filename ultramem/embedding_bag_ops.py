"""The embedding_bag path on CPU: `lookup_reduce` and `lookup_dot` through `F.embedding_bag`'s kernels, same contracts
and gradients as the references in `memory_ops` (the "embedding_bag" memory implementation, the default on CPU).

The references materialise the (T, K, Dv) gathered rows; embedding_bag reads each selected row once and accumulates
in place. The value tables' gradients are built in fresh pages (`zeros_in_fresh_pages`), so a backward touches only
the pages of the rows it writes: what lets a memory-mapped table train without being read whole.

This file is copied beside `modeling_ultramem.py` into checkpoints (remote code), so it imports only relatively.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .memory_ops import lookup_dot, lookup_reduce, lookup_reduce_on

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
    grad_bags: torch.Tensor,
    table: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    bag_of_sample: torch.Tensor,
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
    index, offsets, weights, bag_of_sample = chunk_bags(rows, groups, scores, num_groups)
    pooled = _WeightedBagSum.apply(
        values.view(-1, value_dim // num_cores), index, offsets, weights.to(values.dtype), bag_of_sample
    )  # (T*h*E, Dv/h)
    return pooled.view(num_tokens, num_cores, num_groups, -1).transpose(1, 2).reshape(num_tokens, num_groups, value_dim)


def lookup_reduce_embedding_bag_on(values: torch.Tensor, num_groups: int) -> Callable[..., torch.Tensor]:
    """`lookup_reduce_embedding_bag` on a table whose rows stay as they are: `memory_ops.lookup_reduce_on`'s call,
    chunk weights included, running what `lookup_reduce_embedding_bag` runs for the same number of tokens."""
    few_tokens = lookup_reduce_on(values, num_groups)

    def lookup(rows: torch.Tensor, groups: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] < EMBEDDING_BAG_MIN_TOKENS:
            return few_tokens(rows, groups, weights)
        return lookup_reduce_embedding_bag(values, rows, groups, weights.view(*rows.shape, -1), num_groups)

    return lookup


def chunk_bags(
    rows: torch.Tensor, groups: torch.Tensor, chunk_scores: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The embedding-bag arguments that pool each token's selected rows chunk by chunk into its IVE groups.

    The table is viewed as (N*C, Dv/C) chunks (chunk c of row n is row n*C + c); sample (t, c, k) reads chunk c of
    `rows[t, k]` weighted by `chunk_scores[t, k, c]` into bag (t, c, groups[t, k]). Slots are sorted by group, so
    every bag is one contiguous run of samples and the bags ascend.

    Args:
        rows, groups: (T, K) physical rows and IVE groups of the selected slots.
        chunk_scores: (T, K, C) the score of each chunk of each selected row.
        num_groups: E.

    Returns:
        index (T*C*K,), offsets (T*C*E,) (empty bags pool to zero), weights (T*C*K,), bag of each sample (T*C*K,).
    """
    num_tokens, num_chunks = rows.shape[0], chunk_scores.shape[-1]
    if num_groups > 1:
        groups, order = groups.sort(dim=-1)
        rows = rows.gather(-1, order)
        chunk_scores = chunk_scores.gather(1, order.unsqueeze(-1).expand_as(chunk_scores))
    chunk = torch.arange(num_chunks, device=rows.device).unsqueeze(-1)  # (C, 1)
    index = rows.unsqueeze(1) * num_chunks + chunk  # (T, C, K): samples ordered (token, chunk, group)
    token_chunk = torch.arange(num_tokens * num_chunks, device=rows.device).view(num_tokens, num_chunks, 1)
    bag_of_sample = (token_chunk * num_groups + groups.unsqueeze(1)).flatten()  # (token, chunk, group), ascending
    # the first sample of every bag, found in the ascending samples: a fixed-length result (bincount's length depends
    # on the data, which torch.compile specialises on its first batch)
    bags = torch.arange(num_tokens * num_chunks * num_groups, device=rows.device)
    offsets = torch.searchsorted(bag_of_sample, bags)
    return index.flatten(), offsets, chunk_scores.transpose(1, 2).flatten(), bag_of_sample


class _BagDot(torch.autograd.Function):
    """`lookup_dot` without the (T, K, Dp) gathered rows: the transpose of `_WeightedBagSum`.

    Each token is one bag of its K samples (its selected rows), and the query is that bag's vector. The forward
    is embedding_bag's per-sample-weight gradient (<bag vector, row> per sample); the query gradient is the
    weighted bag sum with the output gradient as weights, and the table gradient is `_table_gradient`.
    """

    @staticmethod
    def forward(
        ctx,
        table: torch.Tensor,
        query: torch.Tensor,
        index: torch.Tensor,
        offsets: torch.Tensor,
        bag_of_sample: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(table, query, index, offsets, bag_of_sample)
        return torch.ops.aten._embedding_bag_per_sample_weights_backward(
            query, table, index, offsets, bag_of_sample, EMBEDDING_BAG_SUM
        )  # (T*K,)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        table, query, index, offsets, bag_of_sample = ctx.saved_tensors
        grad_table = grad_query = None
        if ctx.needs_input_grad[0]:
            grad_table = _table_gradient(query, table, index, grad_out, bag_of_sample)
        if ctx.needs_input_grad[1]:
            grad_query = F.embedding_bag(index, table, offsets, mode="sum", per_sample_weights=grad_out)
        return grad_table, grad_query, None, None, None


def lookup_dot_embedding_bag(table: torch.Tensor, rows: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """`lookup_dot` through embedding_bag's kernels: the fast path on CPU, same contract and gradients.

    The query is taken in the table's dtype (embedding_bag's requirement); the table gradient is built in fresh
    pages (`_table_gradient`). Below `EMBEDDING_BAG_MIN_TOKENS` tokens without autograd (decoding) the reference runs
    instead: its forward costs about the same there, but its backward fills a dense table-sized gradient (one CPU
    thread, 65,536 rows of 256, 32 slots: 63 ms at 1 token against 0.4 ms here).
    """
    num_tokens, num_slots = rows.shape
    differentiable = torch.is_grad_enabled() and (table.requires_grad or query.requires_grad)
    if num_tokens < EMBEDDING_BAG_MIN_TOKENS and not differentiable:
        return lookup_dot(table, rows, query)
    token = torch.arange(num_tokens, device=rows.device)
    offsets = token * num_slots
    bag_of_sample = token.repeat_interleave(num_slots)
    out = _BagDot.apply(table, query.to(table.dtype), rows.flatten(), offsets, bag_of_sample)
    return out.view(num_tokens, num_slots)
