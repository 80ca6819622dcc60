"""What the number-wise and dimension-wise stores share: a DTensor shard of the table on a (replicate, shard) mesh."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ultramem.modeling_ultramem import MemoryValueTable
from ultramem.parallel.comm import data_parallel_mean_grad


class ShardedValueStore(nn.Module):
    """A value table split along `shard_dim` over the mesh's "shard" dimension and replicated over "replicate".

    `weight` is a `DTensor` parameter (placements Replicate, Shard(shard_dim)) under the table's own name, so the
    optimizer keeps its value group, gradient clipping spans the shards (Trainer's mixed-mesh norm), and
    `torch.distributed.checkpoint` can reshard it. Only the local shard is ever allocated.
    """

    shard_dim: ClassVar[int]

    def __init__(self, weight: DTensor, mesh: DeviceMesh):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.mesh = mesh
        self.group = mesh.get_group("shard")
        self.size = mesh.size(1)
        self.rank = mesh.get_local_rank("shard")

    @classmethod
    def check_fits(cls, shape: torch.Size, size: int, **options: Any) -> None:
        """Raise a one-line ValueError when a table of `shape` cannot be split over `size` ranks."""
        raise NotImplementedError

    @classmethod
    def from_table(cls, table: MemoryValueTable, name: str, mesh: DeviceMesh, **options: Any) -> ShardedValueStore:
        """Keep only this rank's rows or columns of `table` (its full weight is dropped with the table)."""
        size, rank = mesh.size(1), mesh.get_local_rank("shard")
        cls.check_fits(table.weight.shape, size, **options)
        local = table.weight.detach().chunk(size, dim=cls.shard_dim)[rank].clone()
        return cls.from_local(local, mesh, **options)

    @classmethod
    def from_local(cls, local: torch.Tensor, mesh: DeviceMesh, **options: Any) -> ShardedValueStore:
        placements = [Replicate(), Shard(cls.shard_dim)]
        return cls(DTensor.from_local(local, mesh, placements, run_check=False), mesh, **options)

    def local_weight(self) -> torch.Tensor:
        """This rank's shard, whose gradient arrives as the data-parallel mean."""
        return data_parallel_mean_grad(self.weight.to_local(), self.mesh)

    def extra_repr(self) -> str:
        return f"shape={tuple(self.weight.shape)}, local={tuple(self.weight.to_local().shape)}, mesh={self.mesh}"
