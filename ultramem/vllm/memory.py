"""A memory layer on vLLM's flat token batch (T, D).

Only the query convolution needs a request's history (`QueryConv`, a vLLM state layer); everything after it is per
token: the math is `ultramem.memory_ops` and the kernels are `ultramem.memory_implementations`, the same functions
`modeling_ultramem` calls. The parameters and buffers keep the checkpoint's names
(`model.memory_layers.{j}.{norm, query.conv, query.proj, query.norm, retrieval.*, values.weight, value_expansion.*}`).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import CacheConfig, ModelConfig

from ultramem.configuration_ultramem import TUCKER
from ultramem.memory_implementations import memory_ops_for
from ultramem.memory_ops import core_svd, physical_slots, product_key_topk, tucker_topk

from .query_conv import QueryConv, TokenwiseConv


class MemoryQuery(nn.Module):
    """LayerNorm'd residual -> (conv) -> one linear map -> per-part LayerNorm: row and column queries (T, H, r, Dk/r)."""

    def __init__(self, config, model_config: ModelConfig | None, cache_config: CacheConfig | None, prefix: str):
        super().__init__()
        self.num_heads, self.rank = config.memory_heads, config.tucker_rank
        self.num_queries = 1 if config.share_query else 2
        self.part_dim = config.memory_key_dim // config.tucker_rank
        self.conv = None
        if config.use_query_conv and config.query_conv_kernel_size > 1:
            kernel_size = config.query_conv_kernel_size
            self.conv = QueryConv(config.hidden_size, kernel_size, model_config, cache_config, f"{prefix}.conv")
        elif config.use_query_conv:
            self.conv = TokenwiseConv(config.hidden_size)
        # replicated, not tensor-parallel: the retrieval needs every head's query on each rank
        self.proj = nn.Linear(config.hidden_size, self.num_heads * self.num_queries * config.memory_key_dim, bias=False)
        self.norm = nn.LayerNorm(self.part_dim, eps=config.layer_norm_eps) if config.qk_layernorm else nn.Identity()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.conv is not None:
            x = self.conv(x)
        query = self.norm(self.proj(x).unflatten(-1, (self.num_heads, self.num_queries, self.rank, self.part_dim)))
        return query[:, :, 0], query[:, :, -1]  # (T, H, r, Dk/r) each


class KeyRetrieval(nn.Module):
    """Row and column keys (H, r, n, Dk/r), their LayerNorm and, for TDQKR, the cores (H, h, r, r).

    What inference derives from them (the LayerNorm'd keys, the cores' leading singular vectors) is computed once by
    `prepare()` after the weights load.
    """

    def __init__(self, config):
        super().__init__()
        self.tucker = config.retrieval_mode == TUCKER
        self.topk, self.signed = config.memory_topk, config.tdqkr_signed_candidates
        part_dim = config.memory_key_dim // config.tucker_rank
        shape = (config.memory_heads, config.tucker_rank, config.memory_num_keys, part_dim)
        self.row_keys = nn.Parameter(torch.empty(shape))
        self.col_keys = nn.Parameter(torch.empty(shape))
        self.key_norm = nn.LayerNorm(part_dim, eps=config.layer_norm_eps) if config.qk_layernorm else nn.Identity()
        if self.tucker:
            self.cores = nn.Parameter(
                torch.empty(config.memory_heads, config.mcs_cores, config.tucker_rank, config.tucker_rank)
            )
        self.keys: tuple[torch.Tensor, torch.Tensor] | None = None
        self.leading_vectors: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def prepare(self) -> None:
        self.keys = (self.key_norm(self.row_keys), self.key_norm(self.col_keys))
        if self.tucker:
            _, u, t = core_svd(self.cores.sum(1).float())
            self.leading_vectors = (u.to(self.cores.dtype), t.to(self.cores.dtype))

    def forward(self, row_query: torch.Tensor, col_query: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor]:
        """Virtual addresses (T, H, m) and per-core scores (T, H, m, h) (h = 1 for PKM)."""
        if self.keys is None:  # the profiling run, before the weights load
            self.prepare()
        row_scores = torch.einsum("thrd,hrnd->thrn", row_query, self.keys[0])
        col_scores = torch.einsum("thrd,hrnd->thrn", col_query, self.keys[1])
        if not self.tucker:
            return product_key_topk(row_scores[..., 0, :], col_scores[..., 0, :], self.topk)
        return tucker_topk(
            row_scores, col_scores, self.cores, self.leading_vectors, self.topk, self.signed, ops.tucker_candidate_topk
        )


class ValueTable(nn.Module):
    """The physical value table (N, Dv) of one memory layer, read only through the lookup-reduce."""

    def __init__(self, num_values: int, value_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_values, value_dim))


class ValueExpansion(nn.Module):
    """IVE: the checkpoint's fixed shuffle of virtual addresses (a buffer) and the E projectors as one linear map."""

    def __init__(self, config):
        super().__init__()
        self.num_groups, self.num_values = config.ive_expansion, config.memory_num_values
        shuffle = torch.empty(config.memory_num_keys**2, dtype=torch.int64) if self.num_groups > 1 else None
        self.register_buffer("virtual_to_physical", shuffle)
        self.projector = (
            nn.Linear(self.num_groups * config.memory_value_dim, config.hidden_size, bias=False)
            if config.value_projection
            else nn.Identity()
        )


class UltraMemMemoryLayer(nn.Module):
    """Pre-norm, query, retrieval, IVE slots, lookup-reduce, projectors: (T, D) -> (T, D)."""

    def __init__(
        self, config, memory_idx: int, model_config: ModelConfig | None, cache_config: CacheConfig | None, prefix: str
    ):
        super().__init__()
        self.read_block, self.write_block = config.memory_layers[memory_idx]
        self.softmax = config.memory_score_softmax
        self.implementation = getattr(config, "_memory_implementation", None)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.query = MemoryQuery(config, model_config, cache_config, f"{prefix}.query")
        self.retrieval = KeyRetrieval(config)
        self.values = ValueTable(config.memory_num_values, config.memory_value_dim)
        self.value_expansion = ValueExpansion(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        ops = memory_ops_for(self.implementation, hidden_states.device)
        row_query, col_query = self.query(self.norm(hidden_states))
        virtual_index, scores = self.retrieval(row_query, col_query, ops)  # (T, H, m), (T, H, m, h)
        if self.softmax:
            scores = scores.softmax(dim=-2)
        expansion = self.value_expansion
        rows, groups = physical_slots(
            virtual_index.reshape(num_tokens, -1), expansion.virtual_to_physical, expansion.num_values
        )  # (T, H*m) each
        pooled = ops.lookup_reduce(
            self.values.weight, rows, groups, scores.reshape(num_tokens, rows.shape[1], -1), expansion.num_groups
        )  # (T, E, Dv)
        return expansion.projector(pooled.to(hidden_states.dtype).flatten(-2))
