"""Value tables split by rows across vLLM's tensor-parallel group.

Every rank of the group runs the whole memory layer on the same tokens (its query, retrieval and projections are
small and replicated), but holds only its block of N/P value rows: rank r owns rows [r N/P, (r+1) N/P). A lookup pools
the selected rows the rank owns, with the other slots weighted zero, and one all-reduce adds the ranks' partial
outputs: each slot's row is held by exactly one rank, so the sum is the whole table's lookup (up to the order of
float additions). A PEER pre-value table answers `lookup_dot` the same way.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.utils import set_weight_attrs


class TensorParallelRows(nn.Module):
    """This rank's rows of a value table (`table`: a local or quantized store of N/P rows) under the whole table's
    name (`weight` is the table's own tensor), loaded from the checkpoint's whole table by narrowing its rows."""

    def __init__(self, table: nn.Module, num_rows: int):
        super().__init__()
        size = get_tensor_model_parallel_world_size()
        self.rows_per_rank = num_rows // size
        self.first_row = get_tensor_model_parallel_rank() * self.rows_per_rank
        if isinstance(table.weight, nn.Parameter):
            self.weight = table.weight  # registered before `table`, so named_parameters gives it this name
        else:
            self.register_buffer("weight", table.weight)
        self.table = table
        set_weight_attrs(self.weight, {"weight_loader": self._load_rows})

    def _load_rows(self, target: torch.Tensor, whole: torch.Tensor) -> None:
        target.data.copy_(whole[self.first_row : self.first_row + self.rows_per_rank])

    def _owned(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows as this rank's local indices (0 where another rank owns them), and which it owns."""
        local = rows - self.first_row
        owned = (local >= 0) & (local < self.rows_per_rank)
        return torch.where(owned, local, 0), owned

    def forward(
        self, rows: torch.Tensor, groups: torch.Tensor, scores: torch.Tensor, num_groups: int, ops
    ) -> torch.Tensor:
        """rows, groups (T, K), scores (T, K, h) -> (T, E, Dv), as the whole table's store."""
        local, owned = self._owned(rows)
        partial = self.table(local, groups, scores * owned.unsqueeze(-1), num_groups, ops)
        return tensor_model_parallel_all_reduce(partial)

    def lookup_dot(self, rows: torch.Tensor, query: torch.Tensor, ops) -> torch.Tensor:
        """rows (T, K), query (T, Dp) -> (T, K), as the whole table's store."""
        local, owned = self._owned(rows)
        return tensor_model_parallel_all_reduce(self.table.lookup_dot(local, query, ops) * owned)
