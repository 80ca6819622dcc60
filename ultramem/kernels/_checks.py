"""Input validation at the Python boundary, so bad input raises a named error, never a kernel fault."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        raise TypeError(f"{name} has dtype {tensor.dtype}; allowed: {', '.join(str(d) for d in allowed)}")


def check_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims {layout}, got shape {tuple(tensor.shape)}")


def check_range(name: str, tensor: torch.Tensor, upper: int) -> None:
    """Every entry in [0, upper). One host synchronisation (a min/max reduction), skipped while a
    CUDA graph is being captured (a sync is illegal there; the eager warm-up runs have checked)."""
    if tensor.numel() == 0 or (tensor.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    low, high = (int(v) for v in torch.aminmax(tensor))
    if low < 0 or high >= upper:
        bad = low if low < 0 else high
        raise IndexError(f"{name} contains {bad}; allowed range is [0, {upper - 1}]")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")
    return next(iter(devices.values()))


def check_lookup_inputs(
    values: torch.Tensor, rows: torch.Tensor, groups: torch.Tensor, scores: torch.Tensor, num_groups: int
) -> None:
    """Shapes and dtypes of `lookup_reduce`'s arguments (see memory_ops for the contract); the index
    ranges are checked by the op itself, on real tensors (see `check_range`)."""
    check_ndim("values", values, 2, "(N, Dv)")
    check_ndim("rows", rows, 2, "(T, K)")
    check_ndim("scores", scores, 3, "(T, K, h)")
    check_dtype("values", values, FLOAT_DTYPES)
    check_dtype("scores", scores, FLOAT_DTYPES)
    check_dtype("rows", rows, INDEX_DTYPES)
    check_dtype("groups", groups, INDEX_DTYPES)
    check_same_device(values=values, rows=rows, groups=groups, scores=scores)
    if groups.shape != rows.shape:
        raise ValueError(f"groups must have the shape of rows {tuple(rows.shape)}, got {tuple(groups.shape)}")
    if scores.shape[:2] != rows.shape:
        raise ValueError(
            f"scores must have shape (T, K, h) with (T, K) = {tuple(rows.shape)}, got {tuple(scores.shape)}"
        )
    num_cores, value_dim = scores.shape[-1], values.shape[-1]
    if num_cores < 1 or value_dim % num_cores != 0:
        raise ValueError(f"scores.shape[-1] (h = {num_cores}) must be >= 1 and divide the value dim {value_dim}")
    if not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"num_groups must be an int >= 1, got {num_groups!r}")
