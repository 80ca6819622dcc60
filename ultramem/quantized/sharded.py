"""Quantized value tables under memory parallelism: the number-wise and dimension-wise stores over uint8 shards.

A shard of a quantized table is itself a quantized table: number-wise, a block of whole rows (each with its fused
scales and biases); dimension-wise, the same quantization groups of every row (a column slice of the uint8 table
that starts and ends on group boundaries, so it carries its groups' scales and biases, and lies within one MCS
chunk or holds whole chunks). Each rank reads only its shard of a checkpoint (a converted one as it is; a float one
is quantized shard by shard, which gives the same bytes: every group is quantized on its own).

The lookups are those of `ultramem.parallel` with the quantized lookup-reduce in place of the float one:

- number-wise, pooling at the source: owners send back the requested rows as they are stored (uint8, 2-7x fewer
  bytes than float32 rows), and the source pools them with `lookup_reduce_quantized` as a table of its own slots;
- number-wise, pooling at the owner: owners weight their rows by the received scores with the quantized op and send
  back one pooled float row per (token, IVE group) they serve;
- dimension-wise: each rank pools its groups' columns with the quantized op.

The tables are frozen (buffers, no gradient); the scores get theirs through `ultramem::quantized_bag_sum`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..memory_implementations import MemoryOps
from ..offload.safetensors_file import OffloadCheckpointError, SafetensorsCheckpoint
from ..parallel.dimension import DimensionShardedValues
from ..parallel.number import NumberShardedValues
from ..parallel.setup import check_quantization_groups, sharded_store_name
from ..value_stores import DeferredValueTable, is_ngram_table
from .format import FORMATS, QuantizationError, quantize, quantized_width, resolve_group_size
from .stores import QuantizedStoreMixin


class _QuantizedShards(QuantizedStoreMixin):
    """What both quantized sharded stores add to their float store: the uint8 shard, its format and its lookup."""

    def __init__(self, weight: DTensor, mesh: DeviceMesh, format: str, group_size: int, value_dim: int, **options):
        super().__init__(weight, mesh, **options)
        self.format, self.group_size, self.value_dim = format, group_size, value_dim

    @property
    def embedding_dim(self) -> int:
        return self.value_dim

    @property
    def pooled_dtype(self) -> torch.dtype:
        return torch.float32

    @classmethod
    def sent_sizes(cls, config: Any) -> dict[str, int]:
        """Rows go back as stored (uint8 payload with each group's scale and bias), pooled rows in float32."""
        value_dim = config.memory_value_dim
        group = resolve_group_size(cls.format, value_dim, config.mcs_cores, config.memory_quantization_group_size)
        return {"row_bytes": quantized_width(cls.format, value_dim, group), "pooled_bytes": 4}

    @classmethod
    def from_table(
        cls,
        table: torch.nn.Module,
        name: str,
        mesh: DeviceMesh,
        checkpoint: SafetensorsCheckpoint | None = None,
        dtype: torch.dtype | None = None,
        config: Any = None,
        num_cores: int | None = None,
        group_size: int | None = None,
        format: str | None = None,
        **options: Any,
    ) -> _QuantizedShards:
        """This rank's shard of `table` quantized: read from `checkpoint` (its uint8 table as it is, or its float
        table quantized shard by shard), or quantized from `table`'s float weight, or drawn with its init std."""
        format, num_cores, group_size = cls._settings(table, name, config, num_cores, group_size, format)
        if cls.shard_dim == 1:
            options["num_cores"] = num_cores
        value_dim, size = table.embedding_dim, mesh.size(1)
        cls.check_fits(torch.Size((table.num_embeddings, value_dim)), size, name=name, **options)
        if cls.shard_dim == 1:
            field = "ngram_head_dim" if is_ngram_table(name) else "memory_value_dim"
            check_quantization_groups(format, value_dim, group_size, size, field)
        shard = mesh.get_local_rank("shard")
        if isinstance(table, DeferredValueTable) and checkpoint is not None:
            source = _checkpoint_table(checkpoint, name, table.num_embeddings, value_dim, format, group_size)
            local = cls.shard_view(source, shard, size)
        elif isinstance(table, DeferredValueTable):
            shape = torch.Size((table.num_embeddings, value_dim))
            local = cls._random_shard(table, name, shape, mesh, torch.float32)
        else:
            local = cls.shard_view(table.weight.detach(), shard, size)
        if local.dtype == torch.uint8:
            local = torch.empty(local.shape, dtype=torch.uint8).copy_(local)  # only the shard's bytes are read
        else:
            local = quantize(local, format, 1, group_size)  # a shard holds whole groups: quantized alike
        return cls.from_local(local, mesh, format=format, group_size=group_size, value_dim=value_dim, **options)

    def local_weight(self) -> torch.Tensor:
        return self.weight.to_local()

    def _pool(self, table, rows, groups, scores, num_groups, ops: MemoryOps) -> torch.Tensor:
        self._warn_if_training()
        return self._lookup(table, rows, groups, scores, num_groups)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.format!r}, group_size={self.group_size}"


def _checkpoint_table(
    checkpoint: SafetensorsCheckpoint, name: str, rows: int, value_dim: int, format: str, group_size: int
) -> torch.Tensor:
    """The checkpoint's table `name` memory-mapped, checked: uint8 in the format's width, or float (N, Dv)."""
    location = checkpoint.locate(name)
    width = quantized_width(format, value_dim, group_size)
    if location.dtype == torch.uint8 and tuple(location.shape) != (rows, width):
        raise QuantizationError(
            f"{name} is {tuple(location.shape)} in the checkpoint; {format} with group size {group_size} needs "
            f"{(rows, width)}: the checkpoint's format or group size differs from the config's"
        )
    if location.dtype != torch.uint8 and tuple(location.shape) != (rows, value_dim):
        raise OffloadCheckpointError(
            f"{name} is {tuple(location.shape)} in the checkpoint, the config needs {(rows, value_dim)}"
        )
    return checkpoint.map(name)


class QuantizedNumberShardedValues(_QuantizedShards, NumberShardedValues):
    """memory_parallel="number" with quantized tables: each rank owns a block of quantized rows."""

    def _weighted_rows(self, rows: torch.Tensor, scores: torch.Tensor, ops: MemoryOps) -> torch.Tensor:
        """(R,) local rows and their (R, h) scores -> (R, Dv) float32, each row one bag of the quantized op."""
        one = rows.unsqueeze(1)  # (R, 1): every received slot its own "token" of one slot and one IVE group
        return self._pool(self.local_weight(), one, torch.zeros_like(one), scores.unsqueeze(1), 1, ops).squeeze(1)


class QuantizedDimensionShardedValues(_QuantizedShards, DimensionShardedValues):
    """memory_parallel="dimension" with quantized tables: each rank owns whole quantization groups of every row."""


SHARDED_STORES: dict[str, type] = {
    sharded_store_name(partitioning, format): store.bound(format)
    for partitioning, store in (
        ("number", QuantizedNumberShardedValues),
        ("dimension", QuantizedDimensionShardedValues),
    )
    for format in FORMATS
}
