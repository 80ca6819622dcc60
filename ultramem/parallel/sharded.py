"""What the number-wise and dimension-wise stores share: a DTensor shard of the table on a (replicate, shard) mesh."""

from __future__ import annotations

import zlib
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ultramem.memory_implementations import MemoryOps
from ultramem.offload.safetensors_file import SafetensorsCheckpoint
from ultramem.parallel.comm import data_parallel_mean_grad
from ultramem.value_stores import DeferredValueTable, MemoryValueTable


class ShardedValueStore(nn.Module):
    """A value table split along `shard_dim` over the mesh's "shard" dimension and replicated over "replicate".

    `weight` is a `DTensor` parameter (placements Replicate, Shard(shard_dim)) under the table's own name, so the
    optimizer keeps its value group, gradient clipping spans the shards (Trainer's mixed-mesh norm), and
    `torch.distributed.checkpoint` can reshard it. Only the local shard is ever allocated.

    A store answers both lookups of `ultramem.value_stores`: the lookup-reduce (`forward`) and `lookup_dot`.
    """

    shard_dim: ClassVar[int]
    cyclic = False  # rows owned cyclically (number-wise, a pool's tables): the DTensor is then of the rows so permuted

    find_checkpoint = staticmethod(SafetensorsCheckpoint.find)  # what `checkpoint=` of `from_table` is read through

    def __init__(self, weight: DTensor, mesh: DeviceMesh):
        super().__init__()
        if weight.is_floating_point():
            self.weight = nn.Parameter(weight)
        else:  # a quantized (uint8) table is frozen: a buffer, still saved under the table's key
            self.register_buffer("weight", weight)
        self.mesh = mesh
        self.group = mesh.get_group("shard")
        self.size = mesh.size(1)
        self.rank = mesh.get_local_rank("shard")

    @classmethod
    def check_fits(cls, shape: torch.Size, size: int, **options: Any) -> None:
        """Raise a one-line ValueError when a table of `shape` cannot be split over `size` ranks."""
        raise NotImplementedError

    @classmethod
    def sent_sizes(cls, config: Any) -> dict[str, int]:
        """`LookupShape`'s `row_bytes` and `pooled_bytes` where this store sends other than the model's float rows:
        what planning (`memory_parallel="auto"`) counts per row and per pooled element sent. None here."""
        return {}

    @classmethod
    def from_table(
        cls,
        table: MemoryValueTable | DeferredValueTable,
        name: str,
        mesh: DeviceMesh,
        checkpoint: SafetensorsCheckpoint | None = None,
        dtype: torch.dtype | None = None,
        **options: Any,
    ) -> ShardedValueStore:
        """Keep only this rank's rows or columns of `table` (its full weight is dropped with the table).

        A `DeferredValueTable` has no weight: the shard is read from `checkpoint`'s tensor `name` (through a memory
        map, so only the shard's bytes are copied), or, without a checkpoint, drawn with the table's init std.
        """
        shape = torch.Size((table.num_embeddings, table.embedding_dim))
        cls.check_fits(shape, mesh.size(1), name=name, **options)
        shard, cyclic = mesh.get_local_rank("shard"), options.get("cyclic", False)
        if not isinstance(table, DeferredValueTable):
            local = cls.shard_view(table.weight.detach(), shard, mesh.size(1), cyclic).clone()
        elif checkpoint is not None:
            local = cls._read_shard(checkpoint, name, shape, mesh, dtype, cyclic)
        else:
            local = cls._random_shard(table, name, shape, mesh, dtype)
        return cls.from_local(local, mesh, **options)

    @classmethod
    def shard_view(cls, full: torch.Tensor, shard: int, size: int, cyclic: bool = False) -> torch.Tensor:
        """The part of the whole table `full` that shard `shard` of `size` holds, as a view (to read or write)."""
        return full[shard::size] if cyclic else full.chunk(size, dim=cls.shard_dim)[shard]

    @classmethod
    def _read_shard(
        cls,
        checkpoint: SafetensorsCheckpoint,
        name: str,
        shape: torch.Size,
        mesh: DeviceMesh,
        dtype: torch.dtype | None,
        cyclic: bool,
    ) -> torch.Tensor:
        """Copy the shard out of the memory-mapped tensor: only its rows (or its columns' pages) are read."""
        mapped = checkpoint.map(name)
        if mapped.shape != shape:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(mapped.shape)}; the config says {tuple(shape)}"
            )
        view = cls.shard_view(mapped, mesh.get_local_rank("shard"), mesh.size(1), cyclic)
        return torch.empty(view.shape, dtype=dtype or view.dtype).copy_(view)

    @classmethod
    def _random_shard(
        cls, table: DeferredValueTable, name: str, shape: torch.Size, mesh: DeviceMesh, dtype: torch.dtype | None
    ) -> torch.Tensor:
        """N(0, init_std) from a generator seeded by the run's seed, the table and the shard: replicas of a shard
        agree and shards differ, but the values are not those of a one-process init."""
        shard = mesh.get_local_rank("shard")
        seed = (torch.initial_seed() + zlib.crc32(f"{name}/{shard}".encode())) % 2**63
        local = list(shape)
        local[cls.shard_dim] //= mesh.size(1)
        generator = torch.Generator().manual_seed(seed)
        return torch.empty(local, dtype=dtype).normal_(std=table.init_std, generator=generator)

    @classmethod
    def from_local(cls, local: torch.Tensor, mesh: DeviceMesh, **options: Any) -> ShardedValueStore:
        placements = [Replicate(), Shard(cls.shard_dim)]
        return cls(DTensor.from_local(local, mesh, placements, run_check=False), mesh, **options)

    @property
    def embedding_dim(self) -> int:
        """Dv, the width of the rows the table stands for."""
        return self.weight.shape[1]

    @property
    def pooled_dtype(self) -> torch.dtype:
        """The dtype of the pooled rows a lookup returns."""
        return self.weight.dtype

    def _pool(
        self,
        table: torch.Tensor,
        rows: torch.Tensor,
        groups: torch.Tensor,
        scores: torch.Tensor,
        num_groups: int,
        ops: MemoryOps,
    ) -> torch.Tensor:
        """The lookup-reduce over `table`, a local block of rows or columns (the quantized stores' own lookup)."""
        return ops.lookup_reduce(table, rows, groups, scores, num_groups)

    def local_weight(self) -> torch.Tensor:
        """This rank's shard, whose gradient arrives as the data-parallel mean."""
        return data_parallel_mean_grad(self.weight.to_local(), self.mesh)

    def extra_repr(self) -> str:
        return f"shape={tuple(self.weight.shape)}, local={tuple(self.weight.to_local().shape)}, mesh={self.mesh}"
