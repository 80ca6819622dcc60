"""Number-wise memory parallelism: each rank owns N/P rows; lookups are routed to the owners (paper appendix).

Two ways to pool. At the source (the paper): the row indices go to their owners, the owners send the rows
back and the source does the weighted-sum pooling. At the owner: the scores travel with the indices and each
owner returns one partial pooled row per (token, IVE group) it serves, which moves fewer bytes whenever
several of a token's slots at one owner share a group (H*m large against E*P).

`lookup_dot` (a pre-value table) always computes at the owner: each token's query travels once to every owner of
its rows with their indices, and one dot per slot comes back.

Rows are owned in contiguous blocks, except in a value pool shared by the memory layers (`value_pool`,
`pre_value_pool`): each layer reads a window of consecutive pool rows, which blocks would put on a few ranks, so
there row r belongs to rank r mod P (cyclic), spreading every window evenly. The DTensor then holds the rows in
that permuted order; checkpoints are written in the table's own order (`shard_view`, `cyclic_to_blocks`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ultramem.memory_implementations import MemoryOps
from ultramem.parallel.comm import all_to_all, exchange_counts
from ultramem.parallel.sharded import ShardedValueStore
from ultramem.value_stores import DeferredValueTable, MemoryValueTable, is_ngram_table, shared_by_layers

POOL_AT = ("source", "owner")


class NumberShardedValues(ShardedValueStore):
    """Rows split in P blocks of N/P (or cyclically); a lookup is an all-to-all of indices and one of rows back."""

    shard_dim = 0

    def __init__(self, weight: DTensor, mesh: DeviceMesh, pool_at: str = "source", cyclic: bool = False):
        super().__init__(weight, mesh)
        if pool_at not in POOL_AT:
            raise ValueError(f"pool_at={pool_at!r}: allowed: {', '.join(POOL_AT)}")
        self.pool_at, self.cyclic = pool_at, cyclic
        self.rows_per_shard = weight.shape[0] // self.size

    @classmethod
    def from_table(
        cls, table: MemoryValueTable | DeferredValueTable, name: str, mesh: DeviceMesh, **options: Any
    ) -> NumberShardedValues:
        """`ShardedValueStore.from_table`; a pool's tables (`shared_by_layers`) are owned cyclically by default."""
        options.setdefault("cyclic", shared_by_layers(name))
        return super().from_table(table, name, mesh, **options)

    @classmethod
    def check_fits(cls, shape: torch.Size, size: int, name: str = "", **options: Any) -> None:
        if shape[0] % size:
            rows = f"the {shape[0]} rows of {name}" if is_ngram_table(name) else f"the {shape[0]} value rows"
            raise ValueError(
                f"memory_parallel='number' splits {rows} over {size} ranks, which does not "
                f"divide them; use a memory_parallel_size dividing {shape[0]}, or memory_parallel='dimension'"
            )

    def _owners(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Owning rank and row within its shard of each of the (T*K,) `rows`."""
        if self.cyclic:
            return rows % self.size, torch.div(rows, self.size, rounding_mode="floor")
        owner = torch.div(rows, self.rows_per_shard, rounding_mode="floor")
        return owner, rows - owner * self.rows_per_shard

    def forward(
        self, rows: torch.Tensor, groups: torch.Tensor, scores: torch.Tensor, num_groups: int, ops: MemoryOps
    ) -> torch.Tensor:
        """rows, groups (T, K), scores (T, K, h) -> (T, E, Dv), as `memory_ops.lookup_reduce` on the whole table."""
        owner, local_rows = self._owners(rows.reshape(-1))  # (T*K,)
        order = torch.argsort(owner, stable=True)  # slots grouped by owner, in rank order
        local_rows = local_rows[order]
        if self.pool_at == "owner":
            return self._pool_at_owner(rows.shape[0], owner, order, local_rows, groups, scores, num_groups, ops)
        send = torch.bincount(owner, minlength=self.size)
        send_list, receive_list = send.tolist(), exchange_counts(send, self.group).tolist()
        received = all_to_all(local_rows, receive_list, send_list, self.group, "indices")
        looked_up = F.embedding(received, self.local_weight())  # (R, Dv) rows asked of this rank
        returned = all_to_all(looked_up, send_list, receive_list, self.group, "values")  # (T*K, Dv), sorted
        gathered = returned[torch.argsort(order)]  # back in slot order
        slots = torch.arange(rows.numel(), device=rows.device).view_as(rows)
        return self._pool(gathered, slots, groups, scores, num_groups, ops)

    def _route_cells(
        self, owner: torch.Tensor, order: torch.Tensor, local_rows: torch.Tensor, cell: torch.Tensor, num_cells: int
    ) -> _Routing:
        """Send each slot's row (in `order`) to its owner, tagged with its (owner, cell) pair: a cell, in
        [0, num_cells), is what an owner returns one result for (a token's IVE group, or a token)."""
        pairs, slot_pair = torch.unique(owner * num_cells + cell, return_inverse=True)  # grouped by owner
        pair_counts = torch.bincount(torch.div(pairs, num_cells, rounding_mode="floor"), minlength=self.size)
        first_pair = torch.cumsum(pair_counts, 0) - pair_counts
        pair_in_owner = (slot_pair - first_pair[owner])[order]
        send = torch.stack([torch.bincount(owner, minlength=self.size), pair_counts], dim=1)  # (P, 2)
        receive = exchange_counts(send, self.group)
        send_slots, send_pairs = send.T.tolist()
        receive_slots, receive_pairs = receive.T.tolist()
        packed = pair_in_owner * self.rows_per_shard + local_rows
        packed = all_to_all(packed, receive_slots, send_slots, self.group, "indices")
        # pair id inside this rank's output: offset of the source's block + the id the source gave
        source = torch.repeat_interleave(
            torch.arange(self.size, device=owner.device), receive[:, 0], output_size=len(packed)
        )  # the repeats on the device too: a CPU tensor there fails index_select on CUDA
        first_received = torch.cumsum(receive[:, 1], 0) - receive[:, 1]
        received_pair = first_received[source] + torch.div(packed, self.rows_per_shard, rounding_mode="floor")
        return _Routing(pairs % num_cells, send_slots, send_pairs, receive_slots, receive_pairs,
                        packed % self.rows_per_shard, received_pair)  # fmt: skip

    def _pool_at_owner(
        self,
        num_tokens: int,
        owner: torch.Tensor,
        order: torch.Tensor,
        local_rows: torch.Tensor,
        groups: torch.Tensor,
        scores: torch.Tensor,
        num_groups: int,
        ops: MemoryOps,
    ) -> torch.Tensor:
        """Send (row, partial-sum id, scores) to the owners; they return one pooled row per (token, group) served."""
        token = torch.arange(num_tokens, device=owner.device).repeat_interleave(groups.shape[1])
        buckets = num_tokens * num_groups
        routing = self._route_cells(owner, order, local_rows, token * num_groups + groups.reshape(-1), buckets)
        slot_scores = scores.reshape(-1, scores.shape[-1])[order]
        received_scores = all_to_all(slot_scores, routing.receive_slots, routing.send_slots, self.group, "scores")
        weighted = self._weighted_rows(routing.rows, received_scores, ops)  # (R, Dv) float32
        partial = weighted.new_zeros(sum(routing.receive_pairs), self.embedding_dim)
        partial = partial.index_add(0, routing.pair, weighted)
        returned = all_to_all(partial, routing.send_pairs, routing.receive_pairs, self.group, "pooled")  # (pairs, Dv)
        pooled = returned.new_zeros(buckets, self.embedding_dim).index_add(0, routing.cells, returned)
        return pooled.view(num_tokens, num_groups, -1).to(self.pooled_dtype)

    def _weighted_rows(self, rows: torch.Tensor, scores: torch.Tensor, ops: MemoryOps) -> torch.Tensor:
        """(R,) local rows and their (R, h) scores -> (R, Dv) float32: each row's MCS chunks times their scores."""
        values = F.embedding(rows, self.local_weight()).float()  # (R, Dv)
        num_cores = scores.shape[-1]
        chunks = values.view(len(values), num_cores, self.embedding_dim // num_cores)
        return (chunks * scores.float().unsqueeze(-1)).flatten(1)

    def lookup_dot(self, rows: torch.Tensor, query: torch.Tensor, ops: MemoryOps) -> torch.Tensor:
        """rows (T, K), query (T, Dp) -> (T, K), as `memory_ops.lookup_dot` on the whole table.

        Each (owner, token) pair sends the token's query once; the owner dots every slot of the pair's rows."""
        num_tokens, num_slots = rows.shape
        owner, local_rows = self._owners(rows.reshape(-1))  # (T*K,)
        order = torch.argsort(owner, stable=True)  # slots grouped by owner, in rank order
        token = torch.arange(num_tokens, device=rows.device).repeat_interleave(num_slots)
        routing = self._route_cells(owner, order, local_rows[order], token, num_tokens)
        queries = all_to_all(query[routing.cells], routing.receive_pairs, routing.send_pairs, self.group, "queries")
        # (R, 1) rows, each with its own query: the received slots as R one-slot "tokens"
        dots = ops.lookup_dot(self.local_weight(), routing.rows.unsqueeze(1), queries[routing.pair]).squeeze(1)
        returned = all_to_all(dots, routing.send_slots, routing.receive_slots, self.group, "dots")  # grouped by owner
        return returned[torch.argsort(order)].view(num_tokens, num_slots)


class _Routing(NamedTuple):
    """Slots sent to their owners in (owner, cell) pairs (`NumberShardedValues._route_cells`)."""

    cells: torch.Tensor  # (pairs,) the cell of each pair this rank sent, grouped by owner
    send_slots: list[int]  # slots sent to each rank
    send_pairs: list[int]  # pairs sent to each rank
    receive_slots: list[int]
    receive_pairs: list[int]
    rows: torch.Tensor  # (R,) the local row of each slot received
    pair: torch.Tensor  # (R,) its pair among all pairs received, grouped by source rank


def _cyclic_and_blocks(rows_per_shard: int, size: int, rank: int, device: torch.device):
    """For rank `rank`: how many of its cyclic rows (rank, rank + P, ...) each block owner holds, how many of its
    block's rows each cyclic owner holds, and the order grouping its block's rows by cyclic owner."""
    held = rank + size * torch.arange(rows_per_shard, device=device)  # ascending, so grouped by block owner
    block = rank * rows_per_shard + torch.arange(rows_per_shard, device=device)
    to_blocks = torch.bincount(torch.div(held, rows_per_shard, rounding_mode="floor"), minlength=size).tolist()
    to_cyclic = torch.bincount(block % size, minlength=size).tolist()
    return to_blocks, to_cyclic, torch.argsort(block % size, stable=True)


def cyclic_to_blocks(local: torch.Tensor, size: int, rank: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Rank `rank`'s rows of a cyclically owned table -> its contiguous block of the same table, by one all-to-all
    in the shard group (checkpoints hold a table in its own order)."""
    to_blocks, to_cyclic, order = _cyclic_and_blocks(local.shape[0], size, rank, local.device)
    received = torch.empty_like(local)
    dist.all_to_all_single(received, local.contiguous(), to_cyclic, to_blocks, group=group)
    blocks = torch.empty_like(local)
    blocks[order] = received
    return blocks


def blocks_to_cyclic(blocks: torch.Tensor, size: int, rank: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of `cyclic_to_blocks`."""
    to_blocks, to_cyclic, order = _cyclic_and_blocks(blocks.shape[0], size, rank, blocks.device)
    local = torch.empty_like(blocks)
    dist.all_to_all_single(local, blocks[order].contiguous(), to_blocks, to_cyclic, group=group)
    return local
