"""The storage format of quantized value tables: rowwise int8 / int4 per column group, scale and bias fused to the row.

A (N, Dv) table is cut into G = Dv / g groups of g columns per row; each group is quantized asymmetrically with its own
scale and bias (bias = the group's min, scale = its range / (2^bits - 1)), in the layout of PyTorch's
`torch.ops.quantized.embedding_bag_byte_prepack` / `embedding_bag_4bit_prepack` applied to the (N*G, g) view:

- "int8": [g uint8 | fp32 scale | fp32 bias] per group: g + 8 bytes;
- "int4": [g/2 bytes, element 2j in the low nibble, 2j+1 in the high one | fp16 scale | fp16 bias]: g/2 + 4 bytes.

The quantized table is ONE uint8 tensor (N, G * group_bytes) stored under the table's usual key: a row is one
contiguous run of bytes, so a memory-mapped safetensors file is read row by row, and its (N*G, group_bytes) view is
exactly what the quantized embedding-bag ops take (no copy).

Groups never straddle an MCS chunk (g divides Dv/h), so each pooled group takes the score of its own core. Group
size: int8 uses one group per chunk (g = Dv/h: its error is already ~0.7% of the values' rms); int4 uses
`DEFAULT_INT4_GROUP_SIZE` = 64 columns where that divides the chunk (else the chunk): 64-column groups cut int4's
error from ~12% to ~9% of the rms for 6% more bytes than 128-column groups (measured on Gaussian tables;
`benchmarks/bench_quantized.py` measures the loss).
"""

from __future__ import annotations

import torch

from ..kernels.quantized_lookup import group_bytes

FORMATS = ("int8", "int4")
DEFAULT_INT4_GROUP_SIZE = 64
QUANTIZE_BLOCK_BYTES = 32 << 20  # float32 bytes of table quantized at once


class QuantizationError(ValueError):
    """A table, checkpoint or setting that does not fit the quantized format; the message says what to do."""


def check_format(format: str | None) -> None:
    if format is not None and format not in FORMATS:
        raise QuantizationError(f"memory_quantization={format!r} is invalid: must be one of {(None, *FORMATS)}")


def resolve_group_size(format: str, value_dim: int, num_cores: int, group_size: int | None = None) -> int:
    """The group size for a (., value_dim) table with `num_cores` MCS chunks: checked, or the format's default."""
    check_format(format)
    if value_dim % num_cores:
        raise QuantizationError(f"value dim {value_dim} is not divisible by mcs_cores={num_cores}")
    chunk = value_dim // num_cores
    if group_size is None:
        default = DEFAULT_INT4_GROUP_SIZE if format == "int4" else chunk
        group_size = default if chunk % default == 0 else chunk
    if not isinstance(group_size, int) or group_size <= 0 or chunk % group_size:
        raise QuantizationError(
            f"group size {group_size!r} must be a positive divisor of the MCS chunk {chunk} (memory_value_dim "
            f"{value_dim} / mcs_cores {num_cores}), so that a group never straddles two cores' chunks"
        )
    if format == "int4" and group_size % 2:
        raise QuantizationError(f"int4 packs two columns a byte: group size {group_size} must be even")
    return group_size


def quantized_width(format: str, value_dim: int, group_size: int) -> int:
    """Bytes per row of the quantized (N, value_dim) table."""
    return value_dim // group_size * group_bytes(format, group_size)


def value_dim_of(format: str, width: int, group_size: int) -> int:
    """The float table's Dv for a quantized table of `width` bytes per row (inverse of `quantized_width`)."""
    per_group = group_bytes(format, group_size)
    if width % per_group:
        raise QuantizationError(
            f"a quantized {format} table with group size {group_size} has rows of a multiple of {per_group} bytes, "
            f"this one has {width}: the format or group size does not match the table"
        )
    return width // per_group * group_size


def _prepack(block: torch.Tensor, format: str) -> torch.Tensor:
    block = block.float() if block.dtype not in (torch.float32, torch.float16) else block
    if format == "int8":
        return torch.ops.quantized.embedding_bag_byte_prepack(block)
    return torch.ops.quantized.embedding_bag_4bit_prepack(block, False)


def quantize(
    table: torch.Tensor, format: str, num_cores: int = 1, group_size: int | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """(N, Dv) float table -> (N, quantized_width) uint8, quantized in row blocks of `QUANTIZE_BLOCK_BYTES`.

    `table` may be a memory-mapped view: only one block is ever converted to float32 at once. `out` (uint8, the
    result's shape) receives the rows instead of a new tensor. Runs on the CPU (the prepack ops have no GPU kernel).
    """
    if table.dtype in (torch.uint8, torch.int8) or not table.is_floating_point():
        raise QuantizationError(
            f"quantize() takes a float table, got {table.dtype}: the table is already quantized (or not a table)"
        )
    if table.dim() != 2:
        raise QuantizationError(f"quantize() takes a 2-D (rows, value_dim) table, got shape {tuple(table.shape)}")
    rows, value_dim = table.shape
    group_size = resolve_group_size(format, value_dim, num_cores, group_size)
    width = quantized_width(format, value_dim, group_size)
    if out is None:
        out = torch.empty(rows, width, dtype=torch.uint8)
    block_rows = max(1, QUANTIZE_BLOCK_BYTES // (4 * value_dim))
    for start in range(0, rows, block_rows):
        block = table[start : start + block_rows].cpu()
        packed = _prepack(block.reshape(-1, group_size), format)  # (rows * G, group_bytes)
        out[start : start + block.shape[0]] = packed.view(block.shape[0], width)
    return out


def dequantize(quantized: torch.Tensor, format: str, group_size: int) -> torch.Tensor:
    """(N, width) uint8 -> (N, Dv) float32, decoded by hand from the layout (the numerical reference)."""
    check_format(format)
    if quantized.dtype != torch.uint8 or quantized.dim() != 2:
        raise QuantizationError(
            f"dequantize() takes a 2-D uint8 quantized table, got {quantized.dtype} of shape {tuple(quantized.shape)}"
        )
    rows, width = quantized.shape
    value_dim = value_dim_of(format, width, group_size)
    per_group = quantized.reshape(rows, value_dim // group_size, group_bytes(format, group_size))
    if format == "int8":
        payload = per_group[..., :group_size].float()
        scale_bias = per_group[..., group_size:].contiguous().view(torch.float32)  # (N, G, 2)
    else:
        packed = per_group[..., : group_size // 2]
        payload = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).float()
        scale_bias = per_group[..., group_size // 2 :].contiguous().view(torch.float16).float()
    return (payload * scale_bias[..., :1] + scale_bias[..., 1:]).view(rows, value_dim)
