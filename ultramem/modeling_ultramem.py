"""PyTorch UltraMem model ("Ultra-Sparse Memory Network", Huang et al., ICLR 2025).

The backbone is GPT-NeoX shaped (pre-norm, RoPE on the full head dim, LayerNorm, GeLU MLP): Llama's attention and
Nemotron's two-matrix MLP, reused. Memory layers sit beside it: each reads the residual stream entering block `a` and
adds its output to the stream leaving block `b` (skip-layer placement, `config.memory_layers`).

One memory layer, for one token (paper section 3):
    x = LayerNorm(h)
    q = Linear(CausalDepthwiseConv(x))                      query, shared by row and column keys
    S_row, S_col = K_row q, K_col q                         (r, n) each; r = Tucker rank
    C = sum_i C^(i) ~ u t^T                                 rank-1 SVD of the Tucker core
    rows = topm(u^T S_row), cols = topm(t^T S_col)          two-phase approximate top-m
    s^(i)[x, y] = S_row[:, x]^T C^(i) S_col[:, y]           exact per-core scores on the m x m grid
    top-m of sum_i s^(i) -> virtual addresses v             no softmax
    v' = shuffle(v); row = v' mod N; group p = v' div N     implicit value expansion
    pooled_p = sum_{v in group p} [s^(1) V[row, :Dv/h], ..., s^(h) V[row, -Dv/h:]]   multi-core scoring
    out = sum_p W_p^T pooled_p                              one GEMM over the E projectors

The math is in `memory_ops` (plain functions); the modules below hold the parameters, in data-flow order, after the
query network (`memory_query`). Where the value table lives is `value_stores`' business, how the kernels compute is
`memory_implementations`'.
"""

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, find_packed_sequence_indices
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from transformers.models.nemotron.modeling_nemotron import NemotronMLP
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs
from transformers.utils.versions import require_version

from .configuration_ultramem import BLOCK_SITE, SWILU, TUCKER, UltraMemConfig
from .inference_cache import CacheEntry, InferenceCache, held_here
from .init_scales import MemoryInitScales, ScaledLayerNorm, ValueProjector
from .memory_implementations import MemoryOps, check_memory_implementation, memory_ops_for
from .memory_ops import (
    core_svd,
    key_balance_loss,
    physical_slots,
    product_key_topk,
    tucker_aux_loss,
    with_loss_gradient,
)
from .memory_query import MemoryInputs, MemoryQuery
from .moved_names import moved_attribute
from .ngram_memory import NGramMemory
from .query_normalization import QueryNormalization, collecting_statistics
from .task_heads import TaskHeadWithAuxLoss
from .transformers_compat import CACHE_FIELD as _CACHE_FIELD  # the cache's name in this release
from .transformers_compat import ContinuousBatchingCheck
from .transformers_compat import accepts_past_key_values as _accepts_past_key_values
from .value_gates import PreValueGate, SiluGate
from .value_stores import (
    LAYER_TABLE_PATTERN,
    LAYER_TABLES,
    POOL_TABLE_PATTERN,
    POOL_TABLES,
    DeferredValueTable,
    MemoryValueTable,
    ValueStoreMixin,
    offloaded_weights_loaded,
    tables_deferred,
)

logger = logging.get_logger(__name__)

# A remote-code copy of this file loaded under an older Transformers says what it needs here, not with a TypeError
require_version("transformers>=5.17", "UltraMem's model code needs Transformers 5.17 or later")


@dataclass
class UltraMemCausalLMOutputWithPast(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus the two parts of the loss.

    lm_loss: next-token cross entropy (when `labels` are given); `loss` = `lm_loss` + `aux_loss`.
    aux_loss: TDQKR auxiliary loss on the Tucker cores' non-leading singular values, with `labels` or in training
        (a function of the weights alone: a forward that computes no loss, such as a step of `generate`, leaves it
        out; `model.model.aux_loss()` gives it at any time).
    """

    lm_loss: torch.FloatTensor | None = None
    aux_loss: torch.FloatTensor | None = None


class UltraMemMLP(NemotronMLP):
    """Two-matrix MLP of inner size `intermediate_size` (4D in the paper) with `hidden_act` (GeLU): Nemotron's."""


class UltraMemAttention(LlamaAttention):
    """Multi-head causal self-attention with RoPE on the full head dim (no grouped KV heads): Llama's."""


class KeyRetrieval(nn.Module):
    """Product keys (Lample et al. 2019): row and column keys of each head, scored against the query's r parts.

    Shared by PKM and TDQKR: the keys (H, r, n, Dk/r) with their LayerNorm (trick 2), their init, and their scores.
    Subclasses pick the top-m from the scores and say what auxiliary loss their parameters carry.
    """

    def __init__(self, config: UltraMemConfig, scales: MemoryInitScales):
        super().__init__()
        self.topk = config.memory_topk
        self.num_keys = config.memory_num_keys
        self.shared_query = config.share_query
        part_dim = config.memory_key_dim // config.tucker_rank
        shape = (config.memory_heads, config.tucker_rank, config.memory_num_keys, part_dim)
        self.row_keys = nn.Parameter(torch.empty(shape))
        self.col_keys = nn.Parameter(torch.empty(shape))
        self.key_norm = (
            ScaledLayerNorm(part_dim, config.layer_norm_eps, scales.key_gain) if config.qk_layernorm else nn.Identity()
        )
        self.inference_cache = InferenceCache()
        self.balance_loss_coef = config.key_balance_loss_coef
        self.last_balance_loss: torch.Tensor | None = None  # for logging (`UltraMemModel.aux_loss`)

    def init_ultramem(self) -> None:
        """Keys ~ N(0, 1/part_dim), so unit-variance queries give unit-variance scores even without key norm."""
        for keys in (self.row_keys, self.col_keys):
            init.normal_(keys, std=keys.shape[-1] ** -0.5)

    def cached_entries(self) -> dict[str, CacheEntry]:
        """What `inference_cache` keeps, by name (for `refresh_inference_cache`): the LayerNorm'd keys."""
        return {"keys": self._keys_entry()}

    def _keys_entry(self) -> CacheEntry:
        """The LayerNorm'd keys as the right operand of one batched GEMM over the H*Q*r query parts: (H*r, Dk/r, 2n),
        the row and column keys side by side, for one query (trick 5); (H*2*r, Dk/r, n) for one query per axis."""
        parameters = (self.row_keys, self.col_keys, *self.key_norm.parameters())
        return parameters, self._normed_keys

    def _normed_keys(self) -> torch.Tensor:
        if self.shared_query:
            keys = torch.cat([self.row_keys, self.col_keys], dim=-2)  # (H, r, 2n, Dk/r)
        else:
            keys = torch.stack([self.row_keys, self.col_keys], dim=1)  # (H, 2, r, n, Dk/r)
        return self.key_norm(keys).flatten(0, -3).mT

    def axis_scores(self, queries: torch.Tensor) -> torch.Tensor:
        """S_row and S_col of every key, the axis first: (B, T, 2, H, r, n), from the queries (B, T, H, Q, r, Dk/r) as
        one GEMM's output, viewed; the LayerNorm'd keys are cached at inference."""
        keys = self.inference_cache.get("keys", *self._keys_entry())
        return part_scores(queries, keys, self.num_keys)

    def decode_step(self, ops: MemoryOps) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """`forward` at inference on the weights as they are now (`MemoryQuery.decode_step`): the cached keys and
        what the subclass' selection reads from its weights taken once."""
        keys, num_keys = self.inference_cache.get("keys", *self._keys_entry()), self.num_keys
        select = self._selection(ops)
        return lambda queries: select(part_scores(queries, keys, num_keys))

    def _selection(self, ops: MemoryOps) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """The axis scores (B, T, 2, H, r, n) -> virtual addresses and scores, at inference."""
        raise NotImplementedError

    def with_balance_loss(
        self, axis_scores: torch.Tensor, axis_projections: Callable[[], tuple[torch.Tensor, ...]]
    ) -> torch.Tensor:
        """`axis_scores`, whose backward also carries UltraMemV2's key-balance loss (Eq. 18-20) when training with
        `key_balance_loss_coef` > 0. `axis_projections()` (..., H, n): the scores each axis' top-m is taken on.

        Carried by the backward rather than returned, so it needs no output of its own and survives gradient
        checkpointing (a side-channel scalar computed under reentrant checkpointing has no graph); its value is kept
        in `last_balance_loss` for the logs.
        """
        if not (self.training and self.balance_loss_coef):
            self.last_balance_loss = None
            return axis_scores
        loss = self.balance_loss_coef * sum(key_balance_loss(scores, self.topk) for scores in axis_projections())
        self.last_balance_loss = loss.detach()
        return with_loss_gradient(axis_scores, loss)


def part_scores(queries: torch.Tensor, keys: torch.Tensor, num_keys: int) -> torch.Tensor:
    """The query parts (B, T, H, Q, r, Dk/r) against their keys (H*Q*r, Dk/r, 2n/Q): the axis scores (B, T, 2, H, r, n),
    as one bmm over the H*Q*r parts (an einsum spends a dozen permutes and views around the same bmm, which a decode
    step pays each time). The axis is the query's with one per axis (Q = 2), the keys' with one for both (Q = 1)."""
    *tokens, heads, num_queries, rank, part_dim = queries.shape
    parts = queries.reshape(-1, heads * num_queries * rank, part_dim).transpose(0, 1)  # (H*Q*r, B*T, Dk/r)
    scores = torch.bmm(parts, keys)  # (H*Q*r, B*T, 2n/Q)
    if num_queries == 1:
        return scores.view(heads, rank, *tokens, 2, num_keys).movedim((0, 1), (-3, -2))
    return scores.view(heads, 2, rank, *tokens, num_keys).movedim((0, 1, 2), (-3, -4, -2))


class ProductKeyRetrieval(KeyRetrieval):
    """PKM retrieval: additive row + column scores, two-phase top-m, one score per slot (r = 1)."""

    def forward(self, queries: torch.Tensor, ops: MemoryOps) -> tuple[torch.Tensor, torch.Tensor]:
        """Virtual addresses (B, T, H, m) and their scores (B, T, H, m, 1) for the queries (B, T, H, Q, 1, Dk)."""
        axis_scores = self.axis_scores(queries)[..., 0, :]  # (B, T, 2, H, n)
        axis_scores = self.with_balance_loss(axis_scores, lambda: axis_scores.unbind(-3))
        return product_key_topk(*axis_scores.unbind(-3), self.topk)

    def _selection(self, ops: MemoryOps) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        topk = self.topk
        return lambda axis_scores: product_key_topk(*axis_scores[..., 0, :].unbind(-3), topk)


class TuckerQueryKeyRetrieval(KeyRetrieval):
    """Tucker Decomposed Query-Key Retrieval (TDQKR) with multi-core scoring (MCS).

    Scores are S_row^T C S_col with a rank-r Tucker core C = sum_i C^(i). The top-m is approximated in two phases
    through the rank-1 SVD C ~ sigma u t^T (`memory_ops.tucker_topk`). The aux loss keeps C close to rank 1.
    """

    def __init__(self, config: UltraMemConfig, scales: MemoryInitScales):
        super().__init__(config, scales)
        self.cores = nn.Parameter(
            torch.empty(config.memory_heads, config.mcs_cores, config.tucker_rank, config.tucker_rank)
        )
        self.signed_candidates = config.tdqkr_signed_candidates

    def init_ultramem(self) -> None:
        super().init_ultramem()
        num_cores, rank = self.cores.shape[1], self.cores.shape[-1]
        init.normal_(self.cores, std=(num_cores * rank * rank) ** -0.5)  # E||sum_i C^(i)||_F^2 = 1

    def cached_entries(self) -> dict[str, CacheEntry]:
        """The keys and the leading singular vectors of the cores."""
        return {**super().cached_entries(), "singular_vectors": ((self.cores,), self.leading_singular_vectors)}

    @torch.no_grad()
    def leading_singular_vectors(self) -> torch.Tensor:
        """u and t of the rank-1 SVD of each head's summed core, of arbitrary (joint) sign, stacked as (2, H, r, 1):
        broadcast against the axis scores (B, T, 2, H, r, n)."""
        _, u, t = core_svd(self.cores.sum(1).float())
        return torch.stack((u, t)).unsqueeze(-1).to(self.cores.dtype)

    def forward(self, queries: torch.Tensor, ops: MemoryOps) -> tuple[torch.Tensor, torch.Tensor]:
        """Virtual addresses (B, T, H, m) and per-core scores (B, T, H, m, h) for the queries (B, T, H, Q, r, Dk/r)."""
        axis_scores = self.axis_scores(queries)  # (B, T, 2, H, r, n)
        leading = self.inference_cache.get("singular_vectors", (self.cores,), self.leading_singular_vectors)
        # the balance loss is on the rank-1 projections a = u^T S_row, b = t^T S_col
        axis_scores = self.with_balance_loss(axis_scores, lambda: (axis_scores * leading).sum(-2).unbind(-3))
        return ops.tucker_topk(axis_scores, self.cores, leading, self.topk, self.signed_candidates)

    def _selection(self, ops: MemoryOps) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        leading = self.inference_cache.get("singular_vectors", (self.cores,), self.leading_singular_vectors)
        cores, topk, signed = self.cores, self.topk, self.signed_candidates
        if hasattr(ops, "tucker_topk_on"):  # prepared on the cores once
            return ops.tucker_topk_on(cores, leading, topk, signed)
        tucker_topk = ops.tucker_topk
        return lambda axis_scores: tucker_topk(axis_scores, cores, leading, topk, signed)


def ive_shuffle(size: int, seed: int) -> torch.Tensor:
    """The fixed bijection over virtual addresses: a seeded CPU `randperm`, stored in checkpoints, not re-derived.

    device="cpu": under a `torch.device("cuda")` context randperm would otherwise reject the CPU generator.
    """
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(size, generator=generator, device="cpu")


class ImplicitValueExpansion(nn.Module):
    """Implicit Value Expansion (IVE): E virtual blocks V W_p computed on demand.

    The n^2 = E * N virtual addresses are shuffled by a fixed bijection, stored in the checkpoint so it
    is identical after reload on any machine. Shuffled address v' reads physical row v' mod N into
    group v' div N; the E pooled groups go through their projectors as one GEMM. With UltraMemV2's single
    projector (Eq. 12) the groups are pooled together into one projector. The memory layer reads the rows
    from its value store in between (`physical_slots`, then the store, then `forward`).

    With a value pool shared by the memory layers (`value_pool_size` P), layer j's N rows are the window of the
    pool starting at row j P / L_m, wrapping around (UltraMemV2's ring sharing).
    """

    def __init__(self, config: UltraMemConfig, scales: MemoryInitScales, memory_idx: int):
        super().__init__()
        self.num_groups = config.num_pooled_groups
        self.num_values = config.memory_num_values
        self.seed = config.ive_shuffle_seed
        self.pool_size = config.value_pool_size
        self.pool_offset = memory_idx * self.pool_size // config.num_memory_layers if self.pool_size else 0
        shuffle = None
        if config.ive_expansion > 1:
            # Filled here too (not only in `_init_weights`) so every rank of a ZeRO-3 run, where weights are
            # initialised on one rank and only parameters are broadcast, holds the same bijection.
            size = config.memory_num_keys**2
            device = torch.empty(0).device  # the default device, e.g. meta inside `from_pretrained`
            shuffle = torch.empty(size, dtype=torch.int64) if device.type == "meta" else ive_shuffle(size, self.seed)
            shuffle = shuffle.to(device)
        self.register_buffer("virtual_to_physical", shuffle)
        width = self.num_groups * config.memory_value_dim
        self.gate = SiluGate(config.hidden_size, width, scales.gate_input_std) if config.value_gate == SWILU else None
        self.projector = (
            ValueProjector(width, config.hidden_size, scales.projector_std)
            if config.value_projection
            else nn.Identity()
        )

    def init_ultramem(self) -> None:
        if self.virtual_to_physical is not None:
            init.copy_(self.virtual_to_physical, ive_shuffle(self.virtual_to_physical.numel(), self.seed))

    def physical_slots(self, virtual_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Virtual addresses (...) -> rows of the value table (or pool) and pooled groups in [0, E), same shape."""
        rows, groups = physical_slots(virtual_index, self.virtual_to_physical, self.num_values)
        if self.pool_size:
            rows = (rows + self.pool_offset) % self.pool_size
        return rows, groups if self.num_groups > 1 else torch.zeros_like(groups)

    def forward(self, pooled: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The E groups' pooled values side by side (..., E * Dv) and the layer's normed input x (..., D) -> (..., D)."""
        if self.gate is not None:
            pooled = self.gate(pooled, x)
        return self.projector(pooled)


class UltraMemMemoryLayer(GradientCheckpointingLayer):
    """One memory layer: pre-norm, query, retrieval (TDQKR or PKM), value lookup, gate, IVE pooling.

    Its value tables (`values` and, with a PEER gate, `pre_values`) are value stores; with a shared value pool the
    model owns them and hands them over at each call (`stores`).
    """

    def __init__(self, config: UltraMemConfig, memory_idx: int):
        super().__init__()
        self.config = config
        self.memory_idx = memory_idx
        self.read_block, self.write_block = config.memory_layers[memory_idx]
        conv_state_slots = config.memory_conv_state_slots  # empty where the query conv keeps no state
        scales = MemoryInitScales.from_config(config)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.query = MemoryQuery(config, scales, conv_state_slots[memory_idx] if conv_state_slots else None)
        retrieval_cls = TuckerQueryKeyRetrieval if config.retrieval_mode == TUCKER else ProductKeyRetrieval
        self.retrieval = retrieval_cls(config, scales)
        self.pre_value_gate = PreValueGate(config, scales) if config.pre_value_dim else None
        self.values = self.pre_values = None
        if config.value_pool_size is None:
            self.values, self.pre_values = build_value_tables(config, config.memory_num_values, scales)
        self.value_expansion = ImplicitValueExpansion(config, scales, memory_idx)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.fixed_weights = False  # inside `UltraMemModel.fixed_weights`: decode steps run `decode_step`
        self._decode: Callable[[torch.Tensor, MemoryInputs], torch.Tensor] | None = None

    def memory_ops(self, device: torch.device) -> MemoryOps:
        return memory_ops_for(getattr(self.config, "_memory_implementation", None), device)

    def retrieve(
        self, hidden_states: torch.Tensor, inputs: MemoryInputs = MemoryInputs(), ops: MemoryOps | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Virtual addresses (B, T, H, m) and scores (B, T, H, m, h) for the residual stream (B, T, D)."""
        return self._retrieve(self.norm(hidden_states), inputs, ops or self.memory_ops(hidden_states.device))

    def forward(self, hidden_states: torch.Tensor, inputs: MemoryInputs = MemoryInputs()) -> torch.Tensor:
        """The residual stream (B, T, D) -> the layer's output (B, T, D)."""
        if self.fixed_weights and hidden_states.shape[1] == 1 and not torch.is_grad_enabled():
            if inputs.sequence_ids is None and not torch.compiler.is_compiling():
                step = self._decode  # read once: a scope ending on another thread resets it
                if step is None:
                    step = self._decode = self.decode_step(inputs) or self._forward_modules
                return step(hidden_states, inputs)
        return self._forward_modules(hidden_states, inputs)

    def decode_step(self, inputs: MemoryInputs) -> Callable[[torch.Tensor, MemoryInputs], torch.Tensor] | None:
        """`forward` for decode steps (B, 1, D) -> (B, 1, D) on the weights as they are now, for the steps of one
        `generate` call, whose weights do not change (`UltraMemModel.fixed_weights`): the query's and the
        retrieval's decode steps and the forward's operators, without the module calls, checks and look-ups that
        cost a tiny model's decode step on CPU more than its operators do (the value gates, PEER's and Memory+'s,
        run their modules). None where a part has no decode step (an adapter, weights that ZeRO-3 or accelerate hold
        elsewhere)."""
        expansion, projector = self.value_expansion, self.value_expansion.projector
        if self.training or type(self.norm) is not nn.LayerNorm or type(projector) not in (ValueProjector, nn.Identity):
            return None
        if not held_here(*self.norm.parameters(), *self.retrieval.parameters(), *projector.parameters()):
            return None
        values, pre_values = inputs.stores or (self.values, self.pre_values)
        query = self.query.decode_step()
        if query is None or hasattr(values, "base_layer"):  # (the forward refuses an adapter on the table)
            return None
        ops, norm = self.memory_ops(self.norm.weight.device), self.norm
        select, slots = self.retrieval.decode_step(ops), expansion.physical_slots
        softmax, num_groups = self.config.memory_score_softmax, expansion.num_groups
        pre_value_gate, value_gate = self.pre_value_gate, expansion.gate
        score_shape = (-1,)  # (B, H*m, h), as the stores take them
        if type(values) is MemoryValueTable and held_here(values.weight):  # its forward, without the module call
            table = values.weight
            if hasattr(ops, "lookup_reduce_on") and pre_value_gate is None:  # prepared on the table once
                lookup = ops.lookup_reduce_on(table, num_groups)
                cores = self.config.mcs_cores if self.config.retrieval_mode == TUCKER else 1
                score_shape = (cores, 1) if cores > 1 else (1,)  # the chunks' weights (`memory_ops.chunk_weights`)
            else:
                lookup = lambda rows, groups, scores: ops.lookup_reduce(table, rows, groups, scores, num_groups)  # noqa: E731
        else:
            lookup = lambda rows, groups, scores: values(rows, groups, scores, num_groups, ops)  # noqa: E731
        projection_t = projector.weight.T if isinstance(projector, ValueProjector) else None  # (E*Dv, D)

        def step(hidden_states: torch.Tensor, inputs: MemoryInputs) -> torch.Tensor:
            x = F.layer_norm(hidden_states, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
            virtual_index, scores = select(query(x, inputs))  # (B, 1, H, m), (B, 1, H, m, h)
            if softmax:
                scores = scores.softmax(dim=-2)
            batch = x.shape[0]
            rows, groups = slots(virtual_index.reshape(batch, -1))  # (B, H*m) each
            scores = scores.reshape(*rows.shape, *score_shape)  # (B, H*m, h), or the chunks' weights
            if pre_value_gate is not None:
                scores = pre_value_gate(scores, rows, x.reshape(batch, -1), pre_values, ops)
            pooled = lookup(rows, groups, scores).to(x.dtype)  # (B, E, Dv)
            if value_gate is not None:
                pooled = value_gate(pooled.view(batch, 1, -1), x)
            if projection_t is None:
                return pooled.view(batch, 1, -1)
            return torch.mm(pooled.view(batch, -1), projection_t).view(batch, 1, -1)  # one GEMM, (B, 1, D)

        return step

    def _forward_modules(self, hidden_states: torch.Tensor, inputs: MemoryInputs) -> torch.Tensor:
        """`forward` through the layer's modules: any batch, any mode."""
        values, pre_values = inputs.stores or (self.values, self.pre_values)
        if hasattr(values, "base_layer"):  # a PEFT adapter layer wraps the table and adds to the rows it embeds
            raise ValueError(
                "PEFT adapters cannot target the value tables (`values`): the memory layer pools the rows it reads "
                "instead of embedding them. Train them with modules_to_save=['values'], or leave them frozen."
            )
        x = self.norm(hidden_states)
        return self._output(values(*self._selected_slots(x, inputs, pre_values)), x)

    def start(self, hidden_states: torch.Tensor, inputs: MemoryInputs) -> Callable[[], torch.Tensor]:
        """Start the layer at its read block; the returned call gives its output, wanted after the write block.

        A store with `lookup_reduce_async` (the offloaded ones) reads its rows in the background while the
        blocks in between compute; any other store runs `forward` now (gradient checkpointing included).
        """
        values, pre_values = inputs.stores or (self.values, self.pre_values)
        if not hasattr(values, "lookup_reduce_async"):
            output = self(hidden_states, inputs)
            return lambda: output
        x = self.norm(hidden_states)
        pending = values.lookup_reduce_async(*self._selected_slots(x, inputs, pre_values))
        return lambda: self._output(pending.result(), x)

    def _retrieve(self, x: torch.Tensor, inputs: MemoryInputs, ops: MemoryOps) -> tuple[torch.Tensor, torch.Tensor]:
        """`retrieve` on the normed input x (B, T, D)."""
        virtual_index, scores = self.retrieval(self.query(x, inputs), ops)
        if self.config.memory_score_softmax:
            scores = scores.softmax(dim=-2)
        return virtual_index, scores

    def _selected_slots(
        self, x: torch.Tensor, inputs: MemoryInputs, pre_values: nn.Module | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, MemoryOps]:
        """The value store's arguments: rows and pooled groups (B*T, H*m), scores (B*T, H*m, h), E, the ops."""
        batch, length, _ = x.shape
        ops = self.memory_ops(x.device)
        virtual_index, scores = self._retrieve(x, inputs, ops)
        num_slots = virtual_index.shape[-2] * virtual_index.shape[-1]
        rows, groups = self.value_expansion.physical_slots(virtual_index.reshape(batch * length, num_slots))
        scores = scores.reshape(batch * length, num_slots, -1)
        if self.pre_value_gate is not None:
            scores = self.pre_value_gate(scores, rows, x.reshape(batch * length, -1), pre_values, ops)
        return rows, groups, scores, self.value_expansion.num_groups, ops

    def _output(self, pooled: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The store's pooled values (B*T, E, Dv) and the normed input (B, T, D) -> the layer's output (B, T, D)."""
        pooled = pooled.to(x.dtype).view(*x.shape[:-1], -1)  # (B, T, E * Dv)
        return self.dropout(self.value_expansion(pooled, x))  # not a view: FSDP2 warns about views leaving a module


def build_value_tables(
    config: UltraMemConfig, num_rows: int, scales: MemoryInitScales
) -> tuple[nn.Module, nn.Module | None]:
    """The value table (num_rows, Dv) and, with a PEER gate, the pre-value table (num_rows, Dp): local stores, or
    placeholders a store fills when the tables are left out of the load."""
    table_cls = DeferredValueTable if tables_deferred(config) else MemoryValueTable
    values = table_cls(num_rows, config.memory_value_dim, scales.value_std)
    pre_values = table_cls(num_rows, config.pre_value_dim, scales.pre_value_std) if config.pre_value_dim else None
    return values, pre_values


class UltraMemDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm transformer block; adds the outputs of the memory layers that write after it.

    Memory layers at the MLP's site (`memory_site`, UltraMemV2 / Memory+) are run by the block itself, on the
    stream after attention, their outputs added with the MLP's: `parallel_memory` is that call. A block whose memory
    replaces its MLP ("instead_of_mlp") has no MLP. `memory_output` is positional: reentrant gradient checkpointing
    only treats positional tensors as inputs.
    """

    def __init__(self, config: UltraMemConfig, layer_idx: int):
        super().__init__()
        self.self_attn = UltraMemAttention(config, layer_idx)
        has_mlp = layer_idx not in config.blocks_without_mlp
        self.mlp = UltraMemMLP(config) if has_mlp else None
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if has_mlp else None
        self.dropout = nn.Dropout(config.hidden_dropout)

    @_accepts_past_key_values
    def forward(
        self,
        hidden_states: torch.Tensor,
        memory_output: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        parallel_memory: Callable[[torch.Tensor], torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        attn_output, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **{_CACHE_FIELD: cache},  # Llama's attention names it as its Transformers release does
            **kwargs,
        )
        hidden_states = hidden_states + self.dropout(attn_output)
        update = parallel_memory(hidden_states) if parallel_memory is not None else None  # reads the MLP's input
        if self.mlp is not None:
            mlp_output = self.dropout(self.mlp(self.post_attention_layernorm(hidden_states)))
            update = mlp_output if update is None else update + mlp_output
        if update is not None:
            hidden_states = hidden_states + update
        if memory_output is not None:
            hidden_states = hidden_states + memory_output
        return hidden_states


class UltraMemPreTrainedModel(ValueStoreMixin, PreTrainedModel):
    config: UltraMemConfig
    config_class = UltraMemConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["UltraMemDecoderLayer", "UltraMemMemoryLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {
        "hidden_states": UltraMemDecoderLayer,
        "attentions": UltraMemAttention,
    }
    # Tables a value store serves are left out of the load (`DeferredValueTable`); the store reads them itself
    _keys_to_ignore_on_load_unexpected = [
        rf"{LAYER_TABLE_PATTERN}\.weight$",
        rf"{POOL_TABLE_PATTERN}\.weight$",
        r"across_tokens\.pending_(mean|moment|count)$",  # buffers before the pending sums moved out of the state
    ]

    def __init__(self, config: UltraMemConfig, *inputs, **kwargs):
        config.prepare_for_model()  # fields assigned after the config was built are checked before any module is
        check_memory_implementation(getattr(config, "_memory_implementation", None))
        super().__init__(config, *inputs, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Transformers' defaults, then each memory module's own init (`init_ultramem`, see `MemoryInitScales`)."""
        super()._init_weights(module)
        if hasattr(module, "init_ultramem"):
            module.init_ultramem()

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Parameters; `exclude_embeddings` drops the token embedding and the LM head, as `ultramem.presets` and
        the paper count, and keeps the value tables (Transformers' default drops every `nn.Embedding`)."""
        total = super().num_parameters(only_trainable=only_trainable)
        if exclude_embeddings:
            modules = (self.get_input_embeddings(), self.get_output_embeddings())
            weights = {id(m.weight): m.weight for m in modules if m is not None}  # tied weights count once
            total -= sum(w.numel() for w in weights.values() if w.requires_grad or not only_trainable)
        return total

    def named_memory_layers(self) -> Iterator[tuple[str, UltraMemMemoryLayer]]:
        """(module name, memory layer) of every memory layer, in a base model or a model with a head."""
        return ((name, module) for name, module in self.named_modules() if isinstance(module, UltraMemMemoryLayer))

    def get_value_table_names(self) -> list[str]:
        """Names of the value tables (values, pre-values, a shared pool, the n-gram memories' tables): the value-LR
        parameter group, the stores."""
        return [
            f"{name}.{table}.weight"
            for name, module in self.named_modules()
            if isinstance(module, (UltraMemMemoryLayer, UltraMemModel, NGramMemory))
            for table in (*LAYER_TABLES, *POOL_TABLES)
            if getattr(module, table, None) is not None
        ]

    def set_memory_implementation(self, implementation: str | None) -> None:
        """How the memory layers compute (`memory_implementations`): a registered name, or None for the device's
        default. A private, unsaved setting, as `set_attn_implementation` is for attention."""
        check_memory_implementation(implementation)
        self.config._memory_implementation = implementation

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Map AutoConfig and every Auto class with an UltraMem model in `auto_map` (Transformers writes only the saved
        class), so a checkpoint of any head loads with any of them."""
        self.config.auto_map = {
            "AutoConfig": "configuration_ultramem.UltraMemConfig",
            "AutoModel": "modeling_ultramem.UltraMemModel",
            "AutoModelForCausalLM": "modeling_ultramem.UltraMemForCausalLM",
            **{auto_class: f"modeling_ultramem.{head.__name__}" for auto_class, head in TASK_HEADS.items()},
        }
        return super().save_pretrained(save_directory, *args, **kwargs)


class UltraMemModel(UltraMemPreTrainedModel):
    """The decoder stack with its memory layers; returns the final normalized hidden states."""

    def __init__(self, config: UltraMemConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([UltraMemDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.memory_layers = nn.ModuleList([UltraMemMemoryLayer(config, j) for j in range(config.num_memory_layers)])
        slots = config.ngram_state_slots
        self.ngram_memories = nn.ModuleList([NGramMemory(config, j, *slots[j]) for j in range(len(slots))])
        self.value_pool = self.pre_value_pool = None  # a value table shared by all memory layers (value_pool_size)
        if config.value_pool_size is not None:
            scales = MemoryInitScales.from_config(config)
            self.value_pool, self.pre_value_pool = build_value_tables(config, config.value_pool_size, scales)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.inference_cache = InferenceCache()
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def aux_loss(self) -> torch.Tensor:
        """TDQKR aux loss summed over memory layers (zero without Tucker memory layers), plus the value of the
        key-balance loss of the last training forward (its gradient travels with the scores, see `with_balance_loss`).

        One batched SVD per device the cores live on (one in all for a model on one device; several when
        `device_map` spreads the memory layers), summed on the device of the first memory layer. The causal LM
        runs it with a loss or in training (not in steps of `generate`); cached at inference (see `InferenceCache`).
        """
        retrievals = [
            layer.retrieval for layer in self.memory_layers if isinstance(layer.retrieval, TuckerQueryKeyRetrieval)
        ]
        with offloaded_weights_loaded(retrievals or [self.norm]):
            if not retrievals:
                loss = self.norm.weight.new_zeros((), dtype=torch.float32)
            else:
                # a copy: the cached tensor changes in place with the cores, an output must not
                loss = self.inference_cache.get("aux_loss", *self._aux_loss_entry(retrievals)).clone()
        if not self.training:
            return loss
        balance = [layer.retrieval.last_balance_loss for layer in self.memory_layers]
        return sum((value.to(loss.device) for value in balance if value is not None), loss)

    @contextlib.contextmanager
    def fixed_weights(self) -> Iterator[None]:
        """Inside it the weights do not change (one `generate` call): each memory layer builds its decode step
        (`UltraMemMemoryLayer.decode_step`) at its first one-token forward and reuses it, instead of checking at every
        step what it derives from the weights."""
        layers = [*self.memory_layers, *self.ngram_memories]
        outer = [(layer.fixed_weights, layer._decode) for layer in layers]  # (a scope inside another keeps it)
        for layer in layers:
            layer.fixed_weights = True
        try:
            yield
        finally:
            for layer, (fixed, step) in zip(layers, outer, strict=True):
                layer.fixed_weights, layer._decode = fixed, step

    def refresh_inference_cache(self) -> None:
        """Brings every tensor cached from the weights up to date, eagerly, and lets the next compiled forward read
        them instead of computing them in its graph (see `InferenceCache`). For compiled decoding steps: call it
        before each (`generate` does, in `prepare_inputs_for_generation`)."""
        for module in self.modules():  # the queries, retrievals, n-gram memories and convolutions
            if hasattr(module, "cached_entries"):
                for name, entry in module.cached_entries().items():
                    module.inference_cache.refresh(name, *entry)

    def _aux_loss_entry(self, retrievals: list[TuckerQueryKeyRetrieval]) -> CacheEntry:
        cores = tuple(retrieval.cores for retrieval in retrievals)
        return cores, lambda: self._aux_loss_by_device(cores)

    def _aux_loss_by_device(self, cores: tuple[torch.Tensor, ...]) -> torch.Tensor:
        cores_by_device: dict[torch.device, list[torch.Tensor]] = {}
        for core in cores:
            cores_by_device.setdefault(core.device, []).append(core)
        losses = [
            tucker_aux_loss(torch.stack(group), self.config.aux_loss_alpha, self.config.aux_loss_tau)
            for group in cores_by_device.values()
        ]
        return sum(loss.to(losses[0].device) for loss in losses[1:]) + losses[0]

    @_accepts_past_key_values
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        counted_tokens: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        r"""
        counted_tokens (`torch.Tensor` of shape `(batch_size, sequence_length)`, *optional*):
            1 at the tokens whose queries the across-token statistics count, 0 elsewhere; by default those the
            attention mask keeps. `UltraMemForCausalLM` leaves out the tokens its loss ignores (labels -100).
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if input_ids is None and self.ngram_memories:
            raise ValueError("UltraMemConfig.ngram_layers: the n-gram memories hash the token ids; pass input_ids")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # (B, T, D)
        if _CACHE_FIELD != "cache" and cache is not None and not isinstance(cache, Cache):
            kwargs["cache"], cache = cache, None  # before 5.24 continuous batching's paged cache is the attention's
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        # The query statistics change with the weights: gathered by training forwards, folded in after the optimizer's
        # step (see `query_normalization`)
        training_step = self.training and torch.is_grad_enabled()
        statistics = self._gathered_statistics() if training_step else []
        # Rows packing several sequences (padding-free training, the caller's restarting `position_ids`): the query
        # convolutions stay within each sequence, under the condition on which `create_causal_mask` keeps attention
        # within each (no mask, no cache)
        sequence_ids = None
        if position_ids is not None and attention_mask is None and cache is None:
            sequence_ids = find_packed_sequence_indices(position_ids.expand(inputs_embeds.shape[0], -1))
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)
        # `generate` with a static cache passes the masks already built, keyed by layer type: the causal mask,
        # and for "hybrid" layers the (B, T) padding mask of the current tokens (None for one-token steps)
        if isinstance(attention_mask, dict):
            causal_mask, padding_mask = attention_mask["full_attention"], attention_mask.get("linear_attention")
        else:
            # positional: the cache argument is `cache` from Transformers 5.24 on, `past_key_values` before
            causal_mask = create_causal_mask(self.config, inputs_embeds, attention_mask, cache, position_ids)
            # (B, T) padding mask of the current tokens for the query convolutions, also on one-token steps
            padding_mask = None
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
                padding_mask = attention_mask[:, -inputs_embeds.shape[1] :]
        # the tokens the query statistics count: neither padding nor left out by the caller
        if counted_tokens is not None and padding_mask is not None:
            counted_tokens = counted_tokens * padding_mask
        for layer in self.memory_layers:
            layer.query.training_step, layer.query.counted_tokens = training_step, counted_tokens

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        stores = (self.value_pool, self.pre_value_pool) if self.value_pool is not None else None
        memory_inputs = MemoryInputs(padding_mask, cache, sequence_ids, stores)
        with collecting_statistics(statistics):  # around the blocks only: a recomputation in the backward adds none
            hidden_states = self._blocks(
                hidden_states, input_ids, memory_inputs, causal_mask, position_embeddings, cache, **kwargs
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{_CACHE_FIELD: cache})

    def _gathered_statistics(self) -> list[QueryNormalization]:
        """The query normalisations whose statistics a training forward gathers: those of trained query projections,
        and those a PEFT adapter saves (`modules_to_save=["across_tokens"]`: its copies). A frozen projection, as under
        LoRA otherwise, keeps the statistics it was saved with, which inference then reads as training did."""
        norms = []
        for query in (layer.query for layer in self.memory_layers):
            if isinstance(query.across_tokens, QueryNormalization):
                norms += [query.across_tokens] if query.proj.weight.requires_grad else []
            elif query.across_tokens is not None:  # wrapped to be saved with an adapter
                norms += [module for module in query.across_tokens.modules() if isinstance(module, QueryNormalization)]
        return norms

    def _blocks(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor | None,
        memory_inputs: MemoryInputs,
        causal_mask: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        cache: Cache | None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        """The decoder blocks on (B, T, D), each memory layer started at its read block and added at its write block,
        each n-gram memory added to its block's input. The n-gram memories' addresses depend on the token ids alone:
        all their reads start before the first block (an offloaded table's in the background)."""
        pending: dict[int, Callable[[], torch.Tensor]] = {}  # memory layer -> its output, wanted at its write block
        ngram_reads = [ngram.start(input_ids, memory_inputs) for ngram in self.ngram_memories]
        for block_idx, decoder_layer in enumerate(self.layers):
            for ngram, read in zip(self.ngram_memories, ngram_reads, strict=True):
                if ngram.block == block_idx:
                    hidden_states = hidden_states + ngram(hidden_states, input_ids, memory_inputs, started=read)
            reading = [layer for layer in self.memory_layers if layer.read_block == block_idx]
            parallel_memory = None
            if reading and self.config.memory_site != BLOCK_SITE:  # beside (or instead of) the block's MLP
                parallel_memory = functools.partial(_sum_of_memories, reading, memory_inputs)
            for memory_layer in reading if parallel_memory is None else ():  # starts as soon as its input exists
                pending[memory_layer.memory_idx] = memory_layer.start(hidden_states, memory_inputs)
            writes = [
                pending.pop(layer.memory_idx)()
                for layer in self.memory_layers
                if layer.write_block == block_idx and layer.memory_idx in pending
            ]
            hidden_states = decoder_layer(
                hidden_states,
                sum(writes[1:], writes[0]) if writes else None,  # (B, T, D); positional, see the layer
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                cache=cache,
                parallel_memory=parallel_memory,
                **kwargs,
            )
        return hidden_states


def _sum_of_memories(
    layers: list[UltraMemMemoryLayer], inputs: MemoryInputs, hidden_states: torch.Tensor
) -> torch.Tensor:
    """The summed outputs (B, T, D) of the memory layers that read the MLP's input `hidden_states` (B, T, D)."""
    outputs = [layer(hidden_states, inputs) for layer in layers]
    return sum(outputs[1:], outputs[0])  # one layer's output as it is: no stack and sum in a decode step


class UltraMemForCausalLM(ContinuousBatchingCheck, UltraMemPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: UltraMemConfig):
        super().__init__(config)
        self.model = UltraMemModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def refresh_inference_cache(self) -> None:
        """See `UltraMemModel.refresh_inference_cache`."""
        self.model.refresh_inference_cache()

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate`, whose weights do not change while it runs: the memory layers' decode steps read
        what they derive from them once per call (`UltraMemModel.fixed_weights`)."""
        with self.model.fixed_weights():
            return super().generate(*args, **kwargs)

    generate.__signature__ = inspect.signature(GenerationMixin.generate)  # as `prepare_inputs_for_generation`'s

    def prepare_inputs_for_generation(self, *args, **kwargs) -> dict:
        """Eager before every step of `generate`. Steps on a compileable cache (a static one) may be compiled: they
        read the cached tensors, brought up to date here, instead of computing them in their graph. Eager steps (a
        dynamic cache) check the cached tensors as they read them, so they skip the refresh: a step of `generate`
        then costs what a Llama-style model's does beyond its forward."""
        if getattr(kwargs.get(_CACHE_FIELD), "is_compileable", False):
            self.refresh_inference_cache()
        return super().prepare_inputs_for_generation(*args, **kwargs)

    # generate checks the model kwargs it is given against this signature (Transformers 5.17: `past_key_values` is
    # refused when it only sees *args, **kwargs): the parent's, named as this release names its arguments
    prepare_inputs_for_generation.__signature__ = inspect.signature(GenerationMixin.prepare_inputs_for_generation)

    @_accepts_past_key_values
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> UltraMemCausalLMOutputWithPast:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Next-token labels (shifted inside); -100 is ignored. `loss` is then the LM loss plus the aux loss.

        Example:
        ```python
        >>> import ultramem
        >>> from transformers import AutoModelForCausalLM
        >>> model = AutoModelForCausalLM.from_pretrained("path/to/checkpoint")
        >>> out = model(input_ids, labels=input_ids)
        >>> out.loss, out.lm_loss, out.aux_loss
        ```
        """
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            counted_tokens=None if labels is None else labels != -100,  # pads marked in the labels alone count not
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])  # (B, T, vocab)
        # ~0.1 ms of an eager CPU decode step (tiny): not paid by a forward that computes no loss
        aux_loss = self.model.aux_loss() if labels is not None or self.training else None
        loss = lm_loss = None
        if labels is not None:
            lm_loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            loss = lm_loss + aux_loss.to(lm_loss.device, lm_loss.dtype)
        return UltraMemCausalLMOutputWithPast(
            loss=loss,
            lm_loss=lm_loss,
            aux_loss=aux_loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{_CACHE_FIELD: getattr(outputs, _CACHE_FIELD)},
        )


class UltraMemForSequenceClassification(TaskHeadWithAuxLoss, GenericForSequenceClassification, UltraMemPreTrainedModel):
    """Scores (B, num_labels) from the last non-padding token, as `LlamaForSequenceClassification`."""

    backbone_class = UltraMemModel


class UltraMemForTokenClassification(TaskHeadWithAuxLoss, GenericForTokenClassification, UltraMemPreTrainedModel):
    """Scores (B, T, num_labels) for every token, as `LlamaForTokenClassification`."""

    backbone_class = UltraMemModel


class UltraMemForQuestionAnswering(TaskHeadWithAuxLoss, GenericForQuestionAnswering, UltraMemPreTrainedModel):
    """Span start and end logits (B, T) each, as `LlamaForQuestionAnswering`."""

    backbone_class = UltraMemModel


TASK_HEADS = {
    "AutoModelForSequenceClassification": UltraMemForSequenceClassification,
    "AutoModelForTokenClassification": UltraMemForTokenClassification,
    "AutoModelForQuestionAnswering": UltraMemForQuestionAnswering,
}

__getattr__ = functools.partial(moved_attribute, __name__)  # names that moved out in 0.2 (`moved_names`)

__all__ = [
    "UltraMemForCausalLM",
    "UltraMemForQuestionAnswering",
    "UltraMemForSequenceClassification",
    "UltraMemForTokenClassification",
    "UltraMemModel",
    "UltraMemPreTrainedModel",
]
