"""Triton kernels of the fused lookup-reduce (forward, score gradient, value gradient).

Reference: `ultramem.memory_ops.lookup_reduce`; every kernel below computes what autograd computes
through it, accumulating in float32.

Layout: values (N, Dv), rows/groups (T, K), scores (T, K, h), out (T, E, Dv), which is (T, E*Dv)
row-major, so the E projectors run afterwards as one GEMM. Column blocks never straddle an MCS
chunk (the grid has one axis per chunk), so each program reads one score per slot, not one per
column. This module is imported lazily (first Triton launch), so `TRITON_INTERPRET=1` set by a
test before that point is honoured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ultramem.kernels import _device

# Tile sizes: about 8 elements per thread, which keeps every kernel at <= ~110 registers per thread
# and without spills on sm_80 and sm_90 (`python benchmarks/gpu/aot_check.py` compiles and reports).
FORWARD_TILE = (2048, 8)  # (elements per program, warps)
BACKWARD_TILE = (1024, 4)
SEGMENT_TILE = (1024, 4)


def _tile(num_rows: int, chunk: int, elements: int, max_cols: int = 128) -> tuple[int, int]:
    """(rows, columns) of a program's tile: columns within one MCS chunk (at most max_cols), rows up
    to `elements` in all and no more than needed."""
    block_d = min(max_cols, triton.next_power_of_2(chunk))
    block_rows = max(1, min(triton.next_power_of_2(max(num_rows, 1)), elements // block_d))
    return block_rows, block_d


def forward_tile(num_slots: int, chunk: int) -> tuple[int, int, int]:
    """(BLOCK_K, BLOCK_D, num_warps) of the forward kernel."""
    return (*_tile(num_slots, chunk, FORWARD_TILE[0]), FORWARD_TILE[1])


def backward_tile(num_slots: int, chunk: int) -> tuple[int, int, int]:
    """(BLOCK_K, BLOCK_D, num_warps) of the score-gradient (and atomic value-gradient) kernel."""
    return (*_tile(num_slots, chunk, BACKWARD_TILE[0]), BACKWARD_TILE[1])


def segment_tile(num_entries: int, chunk: int) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_D, num_warps) of the deterministic value-gradient kernel; 16 to 128 sorted
    entries per tile (shorter tiles would make most segments run past their tile)."""
    block_p, block_d = _tile(num_entries, chunk, SEGMENT_TILE[0], max_cols=64)
    return min(128, max(16, block_p)), block_d, SEGMENT_TILE[1]


@triton.jit
def _load_groups(groups_ptr, entries, mask, NUM_GROUPS: tl.constexpr):
    """The IVE group of each (token, slot) entry; with one group nothing is read (groups_ptr may be None)."""
    if NUM_GROUPS == 1:
        groups = tl.zeros_like(entries)
    else:
        groups = tl.load(groups_ptr + entries, mask=mask, other=0)
    return groups


@triton.jit
def _slot_block(rows_ptr, groups_ptr, scores_ptr, k0, token, num_slots, num_cores, core, BLOCK_K: tl.constexpr,
                NUM_GROUPS: tl.constexpr):  # fmt: skip
    """Rows, IVE groups, scores (float32) and mask of the token's slots k0 .. k0 + BLOCK_K (none past the last)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    mask = ks < num_slots
    slots = token * num_slots + ks
    rows = tl.load(rows_ptr + slots, mask=mask, other=0).to(tl.int64)  # N * Dv may exceed 2**31
    groups = _load_groups(groups_ptr, slots, mask, NUM_GROUPS)
    scores = tl.load(scores_ptr + slots * num_cores + core, mask=mask, other=0.0).to(tl.float32)
    return rows, groups, scores, mask


@triton.jit
def _row_tile(values_ptr, rows, mask, cols, col_mask, value_dim):
    """(BLOCK_K, BLOCK_D) float32 piece of the selected rows; masked slots read 0 (and no memory)."""
    tile = tl.load(values_ptr + rows[:, None] * value_dim + cols[None, :], mask=mask[:, None] & col_mask[None, :],
                   other=0.0)  # fmt: skip
    return tile.to(tl.float32)


def tuned_forward_configs() -> list[triton.Config]:
    """The forward's tile candidates (BLOCK_K slots x BLOCK_D columns, warps), timed once per shape class by
    `triton.autotune` on a GPU."""
    tiles = [
        (8, 128, 4),
        (16, 128, 8),
        (32, 128, 16),
        (8, 64, 2),
        (16, 64, 4),
        (32, 64, 8),
    ]  # <= 32 accumulators a thread at E = 4
    return [triton.Config({"BLOCK_K": k, "BLOCK_D": d}, num_warps=w) for k, d, w in tiles]


def forward_configs() -> list[triton.Config]:
    """On a GPU the tuned candidates; in the interpreter one config whose tile the launcher passes (`forward_tiles`),
    so nothing is timed there. Shared by the quantized forward."""
    return [triton.Config({}, num_warps=FORWARD_TILE[1])] if _device.interpreting() else tuned_forward_configs()


def forward_tiles(kernel: triton.runtime.Autotuner, num_slots: int, chunk: int) -> dict[str, int]:
    """The tile arguments a forward launch passes: none where `triton.autotune` picks them (a GPU), the heuristic
    tile in the interpreter."""
    if len(kernel.configs) > 1:
        return {}
    return dict(zip(("BLOCK_K", "BLOCK_D"), forward_tile(num_slots, chunk)[:2]))


def forward_size_class(num_tokens: int) -> int:
    """Decode (<= 64 tokens), prefill or short training batches, long batches: one tuned tile each."""
    return 0 if num_tokens <= 64 else 1 if num_tokens <= 1024 else 2


@triton.autotune(configs=forward_configs(), key=["num_slots", "value_dim", "chunk", "NUM_GROUPS", "size_class"])
@triton.jit
def _forward_kernel(
    values_ptr,
    rows_ptr,
    groups_ptr,
    scores_ptr,
    out_ptr,
    num_slots,
    value_dim,
    chunk,
    num_cores,
    size_class,
    NUM_GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[t, e, chunk c] = sum_k [groups[t,k]==e] scores[t,k,c] values[rows[t,k], chunk c].

    Each program keeps one float32 accumulator per (group, slot lane, column) and sums the slot lanes once at the
    end: inside the loop every thread only multiplies and adds its own elements (no cross-warp reduction), so the
    loop is the row reads. `size_class` only keys the tuning."""
    token = tl.program_id(0).to(tl.int64)
    core = tl.program_id(1)
    in_chunk = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = in_chunk < chunk
    cols = core * chunk + in_chunk
    group_ids = tl.arange(0, GROUPS_PAD)
    acc = tl.zeros((GROUPS_PAD, BLOCK_K, BLOCK_D), dtype=tl.float32)
    for k0 in range(0, num_slots, BLOCK_K):
        rows, groups, scores, mask = _slot_block(
            rows_ptr, groups_ptr, scores_ptr, k0, token, num_slots, num_cores, core, BLOCK_K, NUM_GROUPS
        )
        weighted = _row_tile(values_ptr, rows, mask, cols, col_mask, value_dim) * scores[:, None]  # masked: 0
        acc += tl.where(groups[None, :, None] == group_ids[:, None, None], weighted[None, :, :], 0.0)
    pooled = tl.sum(acc, axis=1)  # (GROUPS_PAD, BLOCK_D)
    out_offsets = (token * NUM_GROUPS + group_ids[:, None]) * value_dim + cols[None, :]
    out_mask = (group_ids[:, None] < NUM_GROUPS) & col_mask[None, :]
    tl.store(out_ptr + out_offsets, pooled.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _backward_kernel(
    grad_out_ptr,
    values_ptr,
    rows_ptr,
    groups_ptr,
    scores_ptr,
    grad_scores_ptr,
    grad_values_ptr,
    num_slots,
    value_dim,
    chunk,
    num_cores,
    NUM_GROUPS: tl.constexpr,
    ACCUMULATE_VALUES: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    COMPUTE_SCORE_GRAD: tl.constexpr = True,
):
    """Score gradient (per-chunk dot products); with ACCUMULATE_VALUES also the value gradient by
    float32 atomics (the fast, non-deterministic mode). Without COMPUTE_SCORE_GRAD only the latter,
    and the value rows are not read. A pointer only a skipped output needs may be None: values_ptr
    and grad_scores_ptr without COMPUTE_SCORE_GRAD, scores_ptr and grad_values_ptr without
    ACCUMULATE_VALUES, groups_ptr with one group."""
    token = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    slot_mask = ks < num_slots
    slots = token * num_slots + ks
    rows = tl.load(rows_ptr + slots, mask=slot_mask, other=0).to(tl.int64)
    grad_rows = token * NUM_GROUPS + _load_groups(groups_ptr, slots, slot_mask, NUM_GROUPS)
    for core in range(num_cores):
        if ACCUMULATE_VALUES:
            scores = tl.load(scores_ptr + slots * num_cores + core, mask=slot_mask, other=0.0).to(tl.float32)
        grad_score = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for d0 in range(0, chunk, BLOCK_D):
            cols = core * chunk + d0 + tl.arange(0, BLOCK_D)
            mask = slot_mask[:, None] & ((cols < (core + 1) * chunk)[None, :])
            grad = tl.load(grad_out_ptr + grad_rows[:, None] * value_dim + cols[None, :], mask=mask, other=0.0)
            grad = grad.to(tl.float32)
            if COMPUTE_SCORE_GRAD:
                tile = tl.load(values_ptr + rows[:, None] * value_dim + cols[None, :], mask=mask, other=0.0)
                grad_score += tl.sum(grad * tile.to(tl.float32), axis=1)
            if ACCUMULATE_VALUES:
                tl.atomic_add(
                    grad_values_ptr + rows[:, None] * value_dim + cols[None, :],
                    grad * scores[:, None],
                    mask=mask,
                    sem="relaxed",
                )
        if COMPUTE_SCORE_GRAD:
            out_dtype = grad_scores_ptr.dtype.element_ty
            tl.store(grad_scores_ptr + slots * num_cores + core, grad_score.to(out_dtype), mask=slot_mask)


@triton.jit
def _scaled_grad_rows(
    positions,
    mask,
    order_ptr,
    groups_ptr,
    scores_ptr,
    grad_out_ptr,
    num_slots,
    value_dim,
    num_cores,
    core,
    cols,
    col_mask,
    NUM_GROUPS: tl.constexpr,
):
    """(len(positions), BLOCK_D) float32: scores[e, core] * grad_out[token(e), groups[e], cols] for the
    (token, slot) entries e = order[positions], i.e. each entry's contribution to its row's gradient."""
    entries = tl.load(order_ptr + positions, mask=mask, other=0)
    groups = _load_groups(groups_ptr, entries, mask, NUM_GROUPS)
    scores = tl.load(scores_ptr + entries * num_cores + core, mask=mask, other=0.0).to(tl.float32)
    grad_rows = (entries // num_slots) * NUM_GROUPS + groups
    grad = tl.load(
        grad_out_ptr + grad_rows[:, None] * value_dim + cols[None, :], mask=mask[:, None] & col_mask[None, :], other=0.0
    )
    return grad.to(tl.float32) * scores[:, None]


@triton.jit
def _segmented_add(value_a, start_a, value_b, start_b):
    """Combine of a segmented inclusive sum: restart the running sum where a segment starts."""
    return tl.where(start_b != 0, value_b, value_a + value_b), start_a | start_b


@triton.jit
def _value_grad_segment_kernel(
    grad_out_ptr,
    sorted_rows_ptr,
    order_ptr,
    segment_end_ptr,
    groups_ptr,
    scores_ptr,
    grad_values_ptr,
    num_entries,
    num_slots,
    value_dim,
    chunk,
    num_cores,
    NUM_GROUPS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Deterministic value gradient over (token, slot) entries sorted by row.

    Each program loads a tile of BLOCK_P consecutive sorted entries and reduces the row segments in it
    with a segmented scan. A program owns the segments that start in its tile: it writes each of them
    once, continuing past its tile for the last one when that segment runs on. Summation order is fixed
    by the sort and the tile shape, so the bits are the same on every run; no atomics.
    """
    core = tl.program_id(1)
    in_chunk = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = in_chunk < chunk
    cols = core * chunk + in_chunk
    first = tl.program_id(0).to(tl.int64) * BLOCK_P
    lanes = tl.arange(0, BLOCK_P)
    positions = first + lanes
    valid = positions < num_entries
    rows = tl.load(sorted_rows_ptr + positions, mask=valid, other=-1)
    previous = tl.load(sorted_rows_ptr + positions - 1, mask=valid & (positions > 0), other=-1)
    following = tl.load(sorted_rows_ptr + positions + 1, mask=positions + 1 < num_entries, other=-1)
    starts = valid & (rows != previous)
    ends = valid & (rows != following)
    owned = tl.cumsum(starts.to(tl.int32), axis=0) > 0  # the segment started inside this tile
    contributions = _scaled_grad_rows(
        positions,
        valid,
        order_ptr,
        groups_ptr,
        scores_ptr,
        grad_out_ptr,
        num_slots,
        value_dim,
        num_cores,
        core,
        cols,
        col_mask,
        NUM_GROUPS,
    )
    start_flags = tl.broadcast_to(starts.to(tl.int32)[:, None], (BLOCK_P, BLOCK_D))
    sums, _ = tl.associative_scan((contributions, start_flags), axis=0, combine_fn=_segmented_add)
    out_dtype = grad_values_ptr.dtype.element_ty
    row_offsets = rows.to(tl.int64)[:, None] * value_dim + cols[None, :]
    tl.store(grad_values_ptr + row_offsets, sums.to(out_dtype), mask=(owned & ends)[:, None] & col_mask[None, :])

    # The tile's last segment, if this program owns it and it runs past the tile: finish it here.
    is_last_lane = lanes == BLOCK_P - 1
    runs_on = tl.sum(tl.where(is_last_lane & owned & valid & (ends == 0), 1, 0), axis=0) > 0
    if runs_on:
        acc = tl.sum(tl.where(is_last_lane[:, None], sums, 0.0), axis=0)
        row = tl.sum(tl.where(is_last_lane, rows, 0), axis=0).to(tl.int64)
        segment_end = tl.load(segment_end_ptr + first + BLOCK_P - 1)
        for j0 in range(first + BLOCK_P, segment_end, BLOCK_P):
            js = j0 + lanes
            acc += tl.sum(
                _scaled_grad_rows(
                    js,
                    js < segment_end,
                    order_ptr,
                    groups_ptr,
                    scores_ptr,
                    grad_out_ptr,
                    num_slots,
                    value_dim,
                    num_cores,
                    core,
                    cols,
                    col_mask,
                    NUM_GROUPS,
                ),
                axis=0,
            )
        tl.store(grad_values_ptr + row * value_dim + cols, acc.to(out_dtype), mask=col_mask)


def forward(
    values: torch.Tensor,
    rows: torch.Tensor,
    groups: torch.Tensor | None,
    scores: torch.Tensor,
    num_groups: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Launch the fused forward on contiguous, validated inputs; returns (T, E, Dv) in `out_dtype` (default: values'
    dtype). `groups` may be None when E = 1."""
    num_tokens, num_slots = rows.shape
    num_cores = scores.shape[-1]
    value_dim = values.shape[-1]
    chunk = value_dim // num_cores
    out = torch.empty((num_tokens, num_groups, value_dim), dtype=out_dtype or values.dtype, device=values.device)
    if num_tokens == 0:
        return out

    def grid(tile: dict) -> tuple[int, int, int]:
        return (num_tokens, num_cores, triton.cdiv(chunk, tile["BLOCK_D"]))

    _forward_kernel[grid](
        values,
        rows,
        groups,
        scores,
        out,
        num_slots,
        value_dim,
        chunk,
        num_cores,
        forward_size_class(num_tokens),
        NUM_GROUPS=num_groups,
        GROUPS_PAD=triton.next_power_of_2(num_groups),
        **forward_tiles(_forward_kernel, num_slots, chunk),
    )
    return out


def sorted_value_grad_is_faster(values: torch.Tensor, rows: torch.Tensor) -> bool:
    """For 16-bit tables, the sort/segment value gradient wins while the (token, slot) entries are fewer than the
    table's rows: the atomic mode's fixed cost is zeroing, re-reading and casting a float32 (N, Dv) scratch, the
    sorted mode's extra cost grows with the entries (both per column). Measured on an H200 at 2.66M rows x 768
    (benchmarks/results/nvidia-h200): sorted 2.18 / 4.94 / 20.4 ms, atomic 5.71 / 7.91 / 16.9 ms at 0.29M / 1.1M /
    4.6M entries, crossing near 2.2M. float32 tables have no scratch and keep the atomics."""
    return values.element_size() == 2 and rows.numel() < values.shape[0]


def backward(
    grad_out: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    groups: torch.Tensor,
    scores: torch.Tensor,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients (values, scores) in their inputs' dtypes.

    deterministic=True: sort/segment value gradient, no float atomics, identical bits every run, no
    table-sized float32 scratch. deterministic=False: float32 atomics fused into the score-gradient
    pass (one pass over the gathered rows), plus a float32 (N, Dv) scratch when values are 16-bit,
    unless `sorted_value_grad_is_faster` says the sort/segment kernel costs less for this lookup.
    """
    num_tokens, num_slots = rows.shape
    grad_scores = torch.empty_like(scores)
    if num_tokens == 0 or num_slots == 0:
        return torch.zeros_like(values), grad_scores.zero_()
    if deterministic or sorted_value_grad_is_faster(values, rows):
        score_and_value_grad_pass(grad_out, values, rows, groups, scores, grad_scores=grad_scores)
        return segment_value_grad(grad_out, values, rows, groups, scores), grad_scores
    value_acc = torch.zeros(values.shape, dtype=torch.float32, device=values.device)
    score_and_value_grad_pass(grad_out, values, rows, groups, scores, grad_scores=grad_scores, value_acc=value_acc)
    return value_acc.to(values.dtype), grad_scores


def score_and_value_grad_pass(
    grad_out: torch.Tensor,
    values: torch.Tensor | None,
    rows: torch.Tensor,
    groups: torch.Tensor | None,
    scores: torch.Tensor | None,
    grad_scores: torch.Tensor | None = None,
    value_acc: torch.Tensor | None = None,
) -> None:
    """One launch of `_backward_kernel` over T*K >= 1 slots: the score gradient into `grad_scores` (T, K, h) and/or
    the value gradient added by atomics into `value_acc` (a float32 (N, Dv)). An output left None is skipped with
    the reads only it needs (values for the first, scores for the second); groups may be None when E = 1."""
    num_tokens, num_slots = rows.shape
    num_cores = (grad_scores if scores is None else scores).shape[-1]
    value_dim = grad_out.shape[-1]
    chunk = value_dim // num_cores
    block_k, block_d, warps = backward_tile(num_slots, chunk)
    grid = (num_tokens, triton.cdiv(num_slots, block_k))
    _backward_kernel[grid](
        grad_out,
        values,
        rows,
        groups,
        scores,
        grad_scores,
        value_acc,
        num_slots,
        value_dim,
        chunk,
        num_cores,
        NUM_GROUPS=grad_out.shape[1],
        ACCUMULATE_VALUES=value_acc is not None,
        BLOCK_K=block_k,
        BLOCK_D=block_d,
        COMPUTE_SCORE_GRAD=grad_scores is not None,
        num_warps=warps,
    )


def segment_value_grad(
    grad_out: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    groups: torch.Tensor | None,
    scores: torch.Tensor,
) -> torch.Tensor:
    """Value gradient without atomics: stable sort of the (token, slot) entries by row, then tiles of
    sorted entries reduced by segmented scans (segment ends by binary search: no host synchronisation).
    `values` gives the gradient's shape and dtype; groups may be None when E = 1."""
    num_slots = rows.shape[1]
    num_cores = scores.shape[-1]
    value_dim = values.shape[-1]
    chunk = value_dim // num_cores
    key_dtype = torch.int32 if values.shape[0] <= torch.iinfo(torch.int32).max else torch.int64
    sorted_rows, order = torch.sort(rows.reshape(-1).to(key_dtype), stable=True)
    segment_end = torch.searchsorted(sorted_rows, sorted_rows, right=True)
    grad_values = torch.zeros_like(values)
    num_entries = sorted_rows.numel()
    block_p, block_d, warps = segment_tile(num_entries, chunk)
    grid = (triton.cdiv(num_entries, block_p), num_cores, triton.cdiv(chunk, block_d))
    _value_grad_segment_kernel[grid](
        grad_out,
        sorted_rows,
        order,
        segment_end,
        groups,
        scores,
        grad_values,
        num_entries,
        num_slots,
        value_dim,
        chunk,
        num_cores,
        NUM_GROUPS=grad_out.shape[1],
        BLOCK_P=block_p,
        BLOCK_D=block_d,
        num_warps=warps,
    )
    return grad_values
