"""Dimension-wise memory parallelism: each rank owns Dv/P columns of every row (paper appendix).

All ranks' indices and scores are gathered, each rank runs the ordinary lookup-reduce (PyTorch or Triton) on
its column slice for every token, and an all-to-all returns each token's pooled slices to its rank.
A pre-value table's `lookup_dot` (Dp/P columns a rank) gathers the indices likewise, sends each rank its columns of
every query (all-to-all), and returns the partial dots to the tokens' ranks, where they are summed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ultramem.memory_implementations import MemoryOps
from ultramem.parallel.comm import all_gather, all_to_all
from ultramem.parallel.sharded import ShardedValueStore
from ultramem.value_stores import is_ngram_table, is_pre_value_table


def check_dimension_split(value_dim: int, num_cores: int, size: int, field: str = "memory_value_dim") -> None:
    """Each rank's Dv/P columns must lie within one MCS core's chunk or hold whole chunks (a pre-value table,
    `field="pre_value_dim"`, is read by dots: its columns only have to split evenly)."""
    if field == "pre_value_dim" and value_dim % size:
        raise ValueError(
            f"memory_parallel='dimension' splits pre_value_dim={value_dim} over {size} ranks: the size must divide "
            f"{value_dim}; choose another memory_parallel_size, or memory_parallel='number'"
        )
    if field != "pre_value_dim" and (value_dim % size or not (num_cores % size == 0 or size % num_cores == 0)):
        raise ValueError(
            f"memory_parallel='dimension' splits {field}={value_dim} with mcs_cores={num_cores} over "
            f"{size} ranks: the size must divide {value_dim} and divide or be a multiple of {num_cores}; "
            "choose another memory_parallel_size, or memory_parallel='number'"
        )


class DimensionShardedValues(ShardedValueStore):
    """Columns split in P slices of Dv/P; a lookup is an all-gather of indices and scores and one all-to-all."""

    shard_dim = 1

    def __init__(self, weight: DTensor, mesh: DeviceMesh, num_cores: int | None = None):
        super().__init__(weight, mesh)
        self.num_rows = weight.shape[0]

    @classmethod
    def check_fits(
        cls, shape: torch.Size, size: int, num_cores: int | None = None, name: str = "", **options: Any
    ) -> None:
        if is_ngram_table(name):  # an n-gram table's rows are read as they are: one chunk
            check_dimension_split(shape[1], 1, size, "ngram_head_dim")
            return
        field = "pre_value_dim" if is_pre_value_table(name) else "memory_value_dim"
        check_dimension_split(shape[1], num_cores or 1, size, field)

    def _own_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores of the MCS cores whose columns this rank holds."""
        num_cores = scores.shape[-1]
        check_dimension_split(self.embedding_dim, num_cores, self.size)
        if num_cores % self.size == 0:
            width = num_cores // self.size
            return scores[..., self.rank * width : (self.rank + 1) * width]
        core = self.rank // (self.size // num_cores)
        return scores[..., core : core + 1]

    def _padded_tokens(self, rows: torch.Tensor) -> int:
        """The most tokens any rank of the group holds (ranks may hold different counts, e.g. in eval)."""
        counts = all_gather(torch.tensor([rows.shape[0]], device=rows.device), self.group, "counts")
        return int(counts.max())

    def forward(
        self, rows: torch.Tensor, groups: torch.Tensor, scores: torch.Tensor, num_groups: int, ops: MemoryOps
    ) -> torch.Tensor:
        """rows, groups (T, K), scores (T, K, h) -> (T, E, Dv), as `memory_ops.lookup_reduce` on the whole table."""
        num_tokens = rows.shape[0]
        padded = self._padded_tokens(rows)  # pad with zero scores
        slots = F.pad(groups * self.num_rows + rows, (0, 0, 0, padded - num_tokens))
        all_slots = all_gather(slots, self.group, "indices")  # (P*T', K)
        all_scores = all_gather(F.pad(scores, (0, 0, 0, 0, 0, padded - num_tokens)), self.group, "scores")
        rows, groups = all_slots % self.num_rows, all_slots // self.num_rows
        # (P*T', E, Dv/P): this rank's columns for every rank's tokens
        pooled = self._pool(self.local_weight(), rows, groups, self._own_scores(all_scores), num_groups, ops)
        split = [padded * pooled[0].numel()] * self.size
        returned = all_to_all(pooled.reshape(-1), split, split, self.group, "pooled")
        columns = returned.view(self.size, padded, num_groups, -1).permute(1, 2, 0, 3)  # (T', E, P, Dv/P)
        return columns.reshape(padded, num_groups, -1)[:num_tokens]

    def lookup_dot(self, rows: torch.Tensor, query: torch.Tensor, ops: MemoryOps) -> torch.Tensor:
        """rows (T, K), query (T, Dp) -> (T, K), as `memory_ops.lookup_dot` on the whole table."""
        num_tokens, num_slots = rows.shape
        padded = self._padded_tokens(rows)  # pad with zero queries
        all_rows = all_gather(F.pad(rows, (0, 0, 0, padded - num_tokens)), self.group, "indices")  # (P*T', K)
        width = query.shape[1] // self.size
        slices = F.pad(query, (0, 0, 0, padded - num_tokens)).view(padded, self.size, width).transpose(0, 1)
        split = [padded * width] * self.size  # rank q gets column slice q of every token's query
        columns = all_to_all(slices.reshape(-1), split, split, self.group, "queries").view(-1, width)  # (P*T', Dp/P)
        partial = ops.lookup_dot(self.local_weight(), all_rows, columns).float()  # (P*T', K) over this rank's columns
        split = [padded * num_slots] * self.size
        returned = all_to_all(partial.reshape(-1), split, split, self.group, "dots")  # every rank's partials, my tokens
        return returned.view(self.size, padded, num_slots).sum(0)[:num_tokens].to(self.weight.dtype)
