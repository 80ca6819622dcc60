"""PyTorch UltraMem model ("Ultra-Sparse Memory Network", Huang et al., ICLR 2025).

The backbone is GPT-NeoX shaped (pre-norm, RoPE on the full head dim, LayerNorm, GeLU MLP). Memory
layers sit beside it: each reads the residual stream entering block `a` and adds its output to the
stream leaving block `b` (skip-layer placement, `config.memory_layers`).

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
"""

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from statistics import NormalDist
from types import SimpleNamespace
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, LinearAttentionCacheLayerMixin
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, find_packed_sequence_indices
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs
from transformers.utils.versions import require_version

from .configuration_ultramem import TUCKER, UltraMemConfig, validate_memory_offload
from .memory_ops import lookup_reduce, lookup_reduce_embedding_bag, tucker_candidate_topk

logger = logging.get_logger(__name__)

# The model takes and returns `cache` (Transformers 5.24 renamed `past_key_values`): a remote-code copy of this file
# loaded under an older Transformers says so here, not with a TypeError at its first forward.
require_version("transformers>=5.24", "UltraMem's model code follows Transformers 5.24's `cache` API")


class MemoryOps(Protocol):
    """The memory layer's two compute kernels, with the contract of `memory_ops` (their reference).

    Implementations: the pure-PyTorch reference (`memory_ops`), its `embedding_bag` lookup (fast on CPU) and
    the Triton kernels (`ultramem.kernels`), chosen by `config.memory_kernel`. Where the value table lives is a separate axis: see `VALUE_STORES`.
    """

    def lookup_reduce(
        self, values: torch.Tensor, rows: torch.Tensor, groups: torch.Tensor, scores: torch.Tensor, num_groups: int
    ) -> torch.Tensor: ...

    def tucker_candidate_topk(
        self, row_scores: torch.Tensor, col_scores: torch.Tensor, cores: torch.Tensor, topk: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


TORCH_MEMORY_OPS: MemoryOps = SimpleNamespace(lookup_reduce=lookup_reduce, tucker_candidate_topk=tucker_candidate_topk)
EMBEDDING_BAG_MEMORY_OPS: MemoryOps = SimpleNamespace(
    lookup_reduce=lookup_reduce_embedding_bag, tucker_candidate_topk=tucker_candidate_topk
)


def select_memory_ops(memory_kernel: str, device: torch.device) -> MemoryOps:
    """The kernels implementing `MemoryOps` for `config.memory_kernel`.

    "torch" is the pure-PyTorch reference; "embedding_bag" the same with the lookup as one `F.embedding_bag`
    (pure PyTorch, fast on CPU); "triton" the fused kernels of `ultramem.kernels`; "auto" picks embedding_bag
    on CPU, Triton on CUDA when it is installed, the reference elsewhere. A checkpoint loaded with
    `trust_remote_code` without the `ultramem` package installed runs a PyTorch path.
    """
    if memory_kernel == "embedding_bag" or (memory_kernel == "auto" and device.type == "cpu"):
        return EMBEDDING_BAG_MEMORY_OPS
    if memory_kernel == "torch" or (memory_kernel == "auto" and device.type != "cuda"):
        return TORCH_MEMORY_OPS
    try:
        from ultramem import kernels
    except ImportError as error:
        if memory_kernel == "triton":
            raise ImportError(
                "config.memory_kernel='triton' needs the `ultramem` package with Triton installed "
                "(pip install 'ultramem[triton]'); use memory_kernel='torch' or 'auto' otherwise."
            ) from error
        return TORCH_MEMORY_OPS
    if memory_kernel == "auto" and not kernels.triton_available():
        return TORCH_MEMORY_OPS
    return kernels


def expected_top_m_mean(num_candidates: int, top_m: int) -> float:
    """E[mean of the top-m of `num_candidates` standard normals] (appendix A), in closed form.

    The paper estimates it by sampling; the mean of a standard normal above its (1 - m/N) quantile,
    phi(z) / (m/N), is the same quantity for m << N, deterministic, and allocation-free.
    """
    tail = min(top_m / num_candidates, 0.5)
    normal = NormalDist()
    return normal.pdf(normal.inv_cdf(1.0 - tail)) / tail


@functools.cache
def mcs_output_gain(num_keys: int, top_m: int, rank: int, num_cores: int, samples: int = 512) -> float:
    """sqrt(E[S^2] / E[mean_i s_i^2]) over the top-m slots at init: the value scale that makes h cores match one.

    Sampled (seeded, float64) with standard normal row/column scores (r, n) and random cores, the top-m
    taken by the two-phase search over the signed rank-1 candidates; see `MemoryInitScales`.
    """
    if num_cores == 1:
        return 1.0
    generator = torch.Generator().manual_seed(0)
    # torch.normal, not torch.randn (the same numbers): DeepSpeed's `zero.Init` casts what torch.randn makes to the
    # training dtype, and torch.linalg.svd has no bfloat16 kernel (ZeRO-3 with --bf16 failed building the model)
    float64 = dict(generator=generator, dtype=torch.float64, device="cpu")
    rows, cols = torch.normal(0.0, 1.0, (2, samples, rank, num_keys), **float64)
    cores = torch.normal(0.0, 1.0, (samples, num_cores, rank, rank), **float64)
    cores = cores / (num_cores * rank * rank) ** 0.5  # E||sum_i C^(i)||_F^2 = 1, as `TuckerQueryKeyRetrieval`
    left, _, right_h = torch.linalg.svd(cores.sum(1))
    candidates = []
    for scores, vector in ((rows, left[..., :, 0]), (cols, right_h[..., 0, :])):
        projected = torch.einsum("srn,sr->sn", scores, vector)
        index = torch.cat([projected.topk(top_m).indices, (-projected).topk(top_m).indices], dim=-1)  # (S, 2m)
        candidates.append(scores.gather(-1, index.unsqueeze(1).expand(-1, rank, -1)))  # (S, r, 2m)
    _, selected = tucker_candidate_topk(candidates[0], candidates[1], cores, top_m)  # (S, m, h) per-core scores
    return (selected.sum(-1).pow(2).mean() / selected.pow(2).mean()).sqrt().item()


@dataclass(frozen=True)
class MemoryInitScales:
    """Initial scales of a memory layer: appendix A when `improved_init`, PKM's init otherwise.

    Improved: values ~ N(0, E / (2 m H L)), so the layer's output starts like an MLP's, N(0, 1/(2L));
    query/key LayerNorm gains make the mean selected score about 1 (see `expected_top_m_mean`); the
    projectors keep the pooled variance. PKM: values ~ N(0, 1/Dv), unit gains.

    Multi-core scoring (both inits): chunk i of a selected value is weighted by core i's score
    s_i = a^T C^(i) b (a, b the slot's row and column scores), not by the summed score S = sum_i s_i that
    selected it. With C^(i) = C / h + D_i, where D_i is independent of the sum C for Gaussian cores,
    s_i = S / h + a^T D_i b and, per output dimension,
        E[mean_i s_i^2] = E[S^2] / h^2 + (1 - 1/h) / h * E[||a||^2 ||b||^2] / r^2        (E||C||_F^2 = 1)
    The first term alone makes the output of h cores 1/h that of one core; the second depends on how the
    top-m selects large ||a|| ||b||, which has no closed form for product scores. `mcs_output_gain`
    estimates sqrt(E[S^2] / E[mean_i s_i^2]) once by sampling (as the paper does for the top-m mean) and
    the values are scaled by it, so the output's scale at init does not depend on h.
    """

    value_std: float
    projector_std: float
    query_gain: float
    key_gain: float

    @classmethod
    def from_config(cls, config: UltraMemConfig) -> "MemoryInitScales":
        core_scale = mcs_output_gain(config.memory_num_keys, config.memory_topk, config.tucker_rank, config.mcs_cores)
        if not config.improved_init:
            return cls(core_scale * config.memory_value_dim**-0.5, config.initializer_range, 1.0, 1.0)
        num_groups = config.ive_expansion
        activated = config.memory_topk * config.memory_heads
        top_mean = expected_top_m_mean(config.memory_num_keys**2, config.memory_topk)
        if config.retrieval_mode == TUCKER:
            query_gain = top_mean**-0.5  # Var(S_row^T C S_col) = g^4 ||C||_F^2 = 1 / top_mean^2
        else:
            query_gain = 1.0 / (math.sqrt(2.0) * top_mean)  # Var(s_row + s_col) = 2 g^2
        return cls(
            value_std=core_scale * math.sqrt(num_groups / (2 * activated * config.num_hidden_layers)),
            projector_std=(num_groups * config.memory_value_dim) ** -0.5,
            query_gain=query_gain,
            key_gain=(config.memory_key_dim // config.tucker_rank) ** -0.5,
        )


class ScaledLayerNorm(nn.LayerNorm):
    """LayerNorm whose gain starts at `init_gain` instead of 1 (query/key norms of the memory layers)."""

    def __init__(self, normalized_shape: int, eps: float, init_gain: float):
        super().__init__(normalized_shape, eps=eps)
        self.init_gain = init_gain

    def init_ultramem(self) -> None:
        init.constant_(self.weight, self.init_gain)
        init.zeros_(self.bias)


class MemoryValueTable(nn.Embedding):
    """The physical value table V (N, Dv) of one memory layer, held whole on this process's device.

    This is the "local" value store. A value store is any module whose forward is the lookup-reduce of the
    selected rows; where its values live (this device, shards on other ranks, host memory, a memory-mapped
    file) is its own business, and the memory layer only ever calls it. Being a module call, every store is
    seen by module hooks (Accelerate's `device_map` offload loads an offloaded table in them). Stores are
    registered in `VALUE_STORES` and swapped in by `UltraMemPreTrainedModel.set_value_store`.
    """

    def __init__(self, num_values: int, value_dim: int, init_std: float):
        super().__init__(num_values, value_dim)
        self.init_std = init_std

    def init_ultramem(self) -> None:
        init.normal_(self.weight, std=self.init_std)

    def forward(
        self, rows: torch.Tensor, groups: torch.Tensor, scores: torch.Tensor, num_groups: int, ops: MemoryOps
    ) -> torch.Tensor:
        """rows, groups (T, K), scores (T, K, h) -> (T, E, Dv): see `memory_ops.lookup_reduce`."""
        return ops.lookup_reduce(self.weight, rows, groups, scores, num_groups)


class ValueStore(Protocol):
    """Where a memory layer's values live: the one interface the memory layer reads values through.

    `from_table` builds the store from a layer's `MemoryValueTable` (taking its weight or only the part it
    keeps; `name` is the weight's state-dict key, e.g. to find it in a checkpoint); calling the store (its
    `forward`) returns the pooled (T, E, Dv) values of the selected rows on the device of `scores`.
    """

    @classmethod
    def from_table(cls, table: MemoryValueTable, name: str, **options) -> nn.Module: ...

    def __call__(
        self, rows: torch.Tensor, groups: torch.Tensor, scores: torch.Tensor, num_groups: int, ops: MemoryOps
    ) -> torch.Tensor: ...


class _LocalValueStore:
    """The default store: the table itself."""

    @classmethod
    def from_table(cls, table: MemoryValueTable, name: str, **options) -> nn.Module:
        if options:
            raise TypeError(f"the local value store takes no options, got {sorted(options)}")
        return table


VALUE_STORES: dict[str, type[ValueStore]] = {"local": _LocalValueStore}
"""Registry of value stores by name, as Transformers' `ALL_ATTENTION_FUNCTIONS` is for attention. The
`ultramem` package registers the sharded (memory parallelism) and offloaded ("cpu", "disk") stores.

A store may also offer `lookup_reduce_async(rows, groups, scores, num_groups, ops)`, same arguments, returning
an object whose `result()` is what calling the store returns: the memory layer then starts the read when block `a`
starts and collects it after block `b` (the skip-layer window, see `UltraMemMemoryLayer.start`)."""


class DeferredValueTable(nn.Module):
    """Stands for a table that a value store attaches after construction (no parameter).

    Having no `weight`, the loader never reads the checkpoint's table into memory nor initializes one; the
    checkpoint's `values.weight` keys are left to the store (`UltraMemModel` ignores them on load): the
    offloaded stores of `from_pretrained(..., memory_offload=...)`, or the sharded stores of memory
    parallelism, which read or initialize (with `init_std`) only their shard (`deferred_value_tables`).
    """

    def __init__(self, num_values: int, value_dim: int, offload: str | None, init_std: float):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.offload = num_values, value_dim, offload
        self.init_std = init_std

    def forward(self, *args, **kwargs) -> torch.Tensor:
        raise RuntimeError(
            f"UltraMemConfig.memory_offload={self.offload!r}: a value store attaches the value tables in "
            "from_pretrained(path, memory_offload=...), or in set_value_store('number' | 'dimension') after deferred_value_tables(); "
            "this model has none. Build it with memory_offload=None and call model.set_value_store('cpu') to offload "
            "an in-memory model."
        )


_tables_deferred: ContextVar[bool] = ContextVar("tables_deferred", default=False)


@contextmanager
def deferred_value_tables() -> Iterator[None]:
    """Models built (or loaded) inside have `DeferredValueTable`s, so no process ever holds a whole table
    before `set_value_store` installs a store that allocates or reads only its part."""
    token = _tables_deferred.set(True)
    try:
        yield
    finally:
        _tables_deferred.reset(token)


def tables_deferred(config: UltraMemConfig) -> bool:
    return bool(config.memory_offload) or _tables_deferred.get()


def offload_store(offload: str) -> type[ValueStore]:
    """The store class of `config.memory_offload`, from the `ultramem` package (also for `trust_remote_code` copies)."""
    try:
        from ultramem.offload import OFFLOAD_STORES
    except ImportError as error:
        raise ImportError(
            f"UltraMemConfig.memory_offload={offload!r} needs the `ultramem` package installed (pip install ultramem); "
            "without it load with memory_offload=None."
        ) from error
    return OFFLOAD_STORES[offload]


class ValueProjector(nn.Linear):
    """The E IVE projectors W_p (Dv -> D) stacked as one (E * Dv -> D) matrix, so they run as one GEMM."""

    def __init__(self, in_features: int, out_features: int, init_std: float):
        super().__init__(in_features, out_features, bias=False)
        self.init_std = init_std

    def init_ultramem(self) -> None:
        init.normal_(self.weight, std=self.init_std)


@dataclass
class UltraMemCausalLMOutputWithPast(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus the two parts of the loss.

    lm_loss: next-token cross entropy (when `labels` are given); `loss` = `lm_loss` + `aux_loss`.
    aux_loss: TDQKR auxiliary loss on the Tucker cores' non-leading singular values.
    """

    lm_loss: torch.FloatTensor | None = None
    aux_loss: torch.FloatTensor | None = None


class UltraMemMLP(nn.Module):
    """Two-matrix GeLU MLP of inner size `intermediate_size` (4D in the paper)."""

    def __init__(self, config: UltraMemConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(hidden_states)))


class UltraMemAttention(nn.Module):
    """Multi-head causal self-attention with RoPE, dispatched through Transformers' attention interface."""

    def __init__(self, config: UltraMemConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = 1
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        width = config.num_attention_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, width, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, width, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, width, bias=config.attention_bias)
        self.o_proj = nn.Linear(width, config.hidden_size, bias=config.attention_bias)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, heads, T, head_dim)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()  # (B, T, D)
        return self.o_proj(attn_output), attn_weights


class UltraMemDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm transformer block; adds the outputs of the memory layers that write after it.

    `memory_output` is positional: reentrant gradient checkpointing only treats positional tensors as inputs.
    """

    def __init__(self, config: UltraMemConfig, layer_idx: int):
        super().__init__()
        self.self_attn = UltraMemAttention(config, layer_idx)
        self.mlp = UltraMemMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        memory_output: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        attn_output, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            **kwargs,
        )
        hidden_states = hidden_states + self.dropout(attn_output)
        hidden_states = hidden_states + self.dropout(self.mlp(self.post_attention_layernorm(hidden_states)))
        if memory_output is not None:
            hidden_states = hidden_states + memory_output
        return hidden_states


class CausalDepthwiseConv(nn.Module):
    """Causal depthwise Conv1d over time (trick 4), with its last k-1 inputs kept in the generation cache.

    Padded positions are zeroed before the convolution, so left padding never leaks into a real token's
    query, and the cached state is exactly what a full recomputation would see. Rows that pack several
    sequences (`sequence_ids`, padding-free training) are convolved within each sequence only, as attention
    attends within each.
    """

    def __init__(self, channels: int, kernel_size: int, cache_layer_idx: int, state_idx: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.cache_layer_idx = cache_layer_idx
        self.state_idx = state_idx
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.empty(channels))

    def init_ultramem(self) -> None:
        """Start as the identity on the current token, so adding the conv does not change the initial model."""
        identity = torch.zeros_like(self.weight)
        identity[..., -1] = 1.0
        init.copy_(self.weight, identity)
        init.zeros_(self.bias)

    def forward(
        self,
        x: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        sequence_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if padding_mask is not None:
            x = x * padding_mask.unsqueeze(-1).to(x.dtype)
        if sequence_ids is not None:
            return self._within_sequences(x, sequence_ids)
        x = x.transpose(1, 2)  # (B, D, T)
        context = self.kernel_size - 1
        window = None
        if cache is not None and context > 0:
            layers = cache.layers
            if len(layers) <= self.cache_layer_idx or not isinstance(
                layers[self.cache_layer_idx], LinearAttentionCacheLayerMixin
            ):
                raise ValueError(
                    "UltraMem keeps query-conv states in the generation cache: build it with "
                    "DynamicCache(config=model.config) (or let the model create it with use_cache=True)."
                )
            has_past = cache.get_conv_state(self.cache_layer_idx, self.state_idx) is not None
            # With a previous state the cache returns cat(state, x) before overwriting its state in place
            # (so the old state must not be read after this call); on prefill it returns x, unpadded. While
            # `generate` records the past to roll it back (assisted decoding) the state is longer or shorter than
            # k-1: the window is its last k-1+T inputs, zeros before the first token.
            updated = cache.update_conv_state(
                x, self.cache_layer_idx, self.state_idx, conv_kernel_size=context
            )
            if has_past:
                width = context + x.shape[-1]
                window = updated[..., -width:].to(x.dtype)
                if window.shape[-1] < width:
                    window = F.pad(window, (width - window.shape[-1], 0))
        if window is None:
            window = F.pad(x, (context, 0))  # (B, D, k-1+T): zeros before the first token
        if x.shape[-1] == 1:  # a decode step: one dot product per channel, a fraction of conv1d's cost on CPU
            return ((window * self.weight[:, 0]).sum(-1) + self.bias).unsqueeze(1)  # (B, 1, D)
        return F.conv1d(window, self.weight, self.bias, groups=x.shape[1]).transpose(1, 2)  # (B, T, D)

    def _within_sequences(self, x: torch.Tensor, sequence_ids: torch.Tensor) -> torch.Tensor:
        """The convolution of packed rows x (B, T, D), each tap masked where it would reach into the previous sequence.

        sequence_ids (B, T): the index of the sequence each token belongs to. Tap `shift` multiplies x[t - shift]
        by weight[..., k-1-shift], as in conv1d over the zero-padded window.
        """
        output = x * self.weight[:, 0, -1] + self.bias
        for shift in range(1, min(self.kernel_size, x.shape[1])):
            same_sequence = (sequence_ids[:, shift:] == sequence_ids[:, :-shift]).unsqueeze(-1)  # (B, T-shift, 1)
            earlier = F.pad(x[:, :-shift] * same_sequence, (0, 0, shift, 0))  # x[t - shift], zero across a boundary
            output = output + earlier * self.weight[:, 0, -1 - shift]
        return output


class MemoryQuery(nn.Module):
    """Query network: optional causal depthwise conv, a linear map, LayerNorm on each Tucker part.

    With `share_query` one query serves row and column keys (trick 5); otherwise each gets its own.
    """

    def __init__(self, config: UltraMemConfig, scales: MemoryInitScales, cache_layer_idx: int, state_idx: int):
        super().__init__()
        self.num_heads = config.memory_heads
        self.num_queries = 1 if config.share_query else 2
        self.rank = config.tucker_rank
        self.part_dim = config.memory_key_dim // config.tucker_rank
        self.conv = (
            CausalDepthwiseConv(config.hidden_size, config.query_conv_kernel_size, cache_layer_idx, state_idx)
            if config.use_query_conv
            else None
        )
        self.proj = nn.Linear(
            config.hidden_size, self.num_heads * self.num_queries * config.memory_key_dim, bias=False
        )
        self.norm = (
            ScaledLayerNorm(self.part_dim, config.layer_norm_eps, scales.query_gain)
            if config.qk_layernorm
            else nn.Identity()
        )

    def forward(
        self,
        x: torch.Tensor,
        padding_mask: torch.Tensor | None,
        cache: Cache | None,
        sequence_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.conv is not None:
            x = self.conv(x, padding_mask, cache, sequence_ids)
        query = self.proj(x).unflatten(-1, (self.num_heads, self.num_queries, self.rank, self.part_dim))
        query = self.norm(query)  # (B, T, H, 1|2, r, Dk/r)
        return query[..., 0, :, :], query[..., -1, :, :]  # row and column queries, (B, T, H, r, Dk/r)


Derived = TypeVar("Derived")


class InferenceCache(nn.Module):
    """Tensors derived from parameters, kept between forwards of an eval-mode model while they cannot change.

    For what every decode step would otherwise recompute from fixed weights (the LayerNorm'd keys, the cores'
    singular vectors). An entry is reused only in eval mode with grad off (a graph through a cached tensor
    would be stale) and outside torch.compile (which traces the computation instead), and only while its
    parameters keep their storage, dtype, device and version counter, which every in-place write bumps
    (optimizer steps, `load_state_dict`, `copy_`). An entry holds the storages it was computed from, so a
    new tensor (after `.to()`, say) cannot reuse their address and pass for them. `train()` empties the
    cache. Writes through `.data` bypass the version counter: call `clear()` after them. It is a module only so
    that `train()` / `eval()` reach it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.entries: dict[str, tuple[tuple, tuple[torch.UntypedStorage, ...], object]] = {}

    def get(self, name: str, parameters: tuple[torch.Tensor, ...], compute: Callable[[], Derived]) -> Derived:
        """compute(), or its cached result for `name` while `parameters` are unchanged.

        A plain method, not `forward`: module hooks (DeepSpeed ZeRO-3's gather/release of parameters) must see
        the modules `compute` calls, not a parameterless wrapper around them.
        """
        if self.training or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return compute()
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in parameters)
        entry = self.entries.get(name)
        if entry is None or entry[0] != key:
            entry = self.entries[name] = (key, tuple(p.untyped_storage() for p in parameters), compute())
        return entry[2]

    def clear(self) -> None:
        self.entries.clear()

    def __getstate__(self) -> dict:
        """Pickled (`torch.save(model)`, `copy.deepcopy`) empty: the entries are derived, and the storages they hold
        alias parameters under another type, which `torch.save` refuses."""
        return {**self.__dict__, "entries": {}}

    def train(self, mode: bool = True) -> "InferenceCache":
        if mode:
            self.clear()
        return super().train(mode)


def key_axis_scores(
    retrieval: nn.Module, row_query: torch.Tensor, col_query: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column scores (B, T, H, r, n) of every key of a PKM or TDQKR retrieval module.

    The LayerNorm'd keys (H, r, n, Dk/r) are cached at inference (see `InferenceCache`).
    """
    parameters = (retrieval.row_keys, retrieval.col_keys, *retrieval.key_norm.parameters())
    row_keys, col_keys = retrieval.inference_cache.get(
        "keys", parameters, lambda: (retrieval.key_norm(retrieval.row_keys), retrieval.key_norm(retrieval.col_keys))
    )
    row = torch.einsum("bthrd,hrnd->bthrn", row_query, row_keys)
    col = torch.einsum("bthrd,hrnd->bthrn", col_query, col_keys)
    return row, col


def key_norm(config: UltraMemConfig, scales: MemoryInitScales) -> nn.Module:
    """LayerNorm on each key part (trick 2), or the identity when `qk_layernorm` is off."""
    if not config.qk_layernorm:
        return nn.Identity()
    part_dim = config.memory_key_dim // config.tucker_rank
    return ScaledLayerNorm(part_dim, config.layer_norm_eps, scales.key_gain)


def init_keys(retrieval: nn.Module) -> None:
    """Keys ~ N(0, 1/part_dim), so unit-variance queries give unit-variance scores even without key norm."""
    for keys in (retrieval.row_keys, retrieval.col_keys):
        init.normal_(keys, std=keys.shape[-1] ** -0.5)


class ProductKeyRetrieval(nn.Module):
    """PKM retrieval (Lample et al. 2019): additive row + column scores, two-phase top-m, one score per slot."""

    def __init__(self, config: UltraMemConfig, scales: MemoryInitScales):
        super().__init__()
        self.topk = config.memory_topk
        self.num_keys = config.memory_num_keys
        shape = (config.memory_heads, 1, config.memory_num_keys, config.memory_key_dim)
        self.row_keys = nn.Parameter(torch.empty(shape))
        self.col_keys = nn.Parameter(torch.empty(shape))
        self.key_norm = key_norm(config, scales)
        self.inference_cache = InferenceCache()

    def init_ultramem(self) -> None:
        init_keys(self)

    def axis_scores(self, row_query: torch.Tensor, col_query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column scores of every key: (B, T, H, r, n) each."""
        return key_axis_scores(self, row_query, col_query)

    def score_factors(self, row_scores: torch.Tensor, col_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., k, n) factors F_row, F_col with grid score [x, y] = F_row[:, x] . F_col[:, y]; for diagnostics.

        s_row[x] + s_col[y] = [s_row[x], 1] . [1, s_col[y]].
        """
        ones = torch.ones_like(row_scores)
        return torch.cat([row_scores, ones], dim=-2), torch.cat([ones, col_scores], dim=-2)

    def forward(
        self, row_query: torch.Tensor, col_query: torch.Tensor, ops: MemoryOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Virtual addresses (B, T, H, m) and their scores (B, T, H, m, 1)."""
        row_scores, col_scores = self.axis_scores(row_query, col_query)
        row_top, row_index = row_scores[..., 0, :].topk(self.topk, dim=-1)  # (B, T, H, m)
        col_top, col_index = col_scores[..., 0, :].topk(self.topk, dim=-1)
        grid = (row_top.unsqueeze(-1) + col_top.unsqueeze(-2)).flatten(-2)  # (B, T, H, m*m)
        scores, flat_index = grid.topk(self.topk, dim=-1)
        rows = row_index.gather(-1, flat_index // self.topk)
        cols = col_index.gather(-1, flat_index % self.topk)
        return rows * self.num_keys + cols, scores.unsqueeze(-1)


def _polar(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Radius and angle of (x, y) with finite gradients at the origin (radius 0, angle 0, zero gradient there).

    `hypot` and `atan2` have 0/0 gradients at (0, 0): a pure rotation or reflection, or a zero core, would give
    NaN gradients through the aux loss. The origin is replaced by (1, 0) in both branches of the `where`.
    """
    origin = (x == 0) & (y == 0)
    x_safe, y_safe = torch.where(origin, 1.0, x), torch.where(origin, 0.0, y)
    radius = torch.where(origin, 0.0, torch.hypot(x_safe, y_safe))
    return radius, torch.atan2(y_safe, x_safe)


def svd_2x2(matrices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Closed-form SVD of 2x2 matrices (..., 2, 2): singular values (..., 2) descending, leading u and t (..., 2).

    matrices = R(phi) diag(q + r, q - r) R(-theta), with q and r the norms of the rotation and reflection
    parts. The signs of u and t are arbitrary (callers normalize them). Gradients are finite everywhere
    (see `_polar`); where the SVD is differentiable they are those of `torch.linalg.svd`.
    """
    a, b, c, d = matrices[..., 0, 0], matrices[..., 0, 1], matrices[..., 1, 0], matrices[..., 1, 1]
    q, rotation = _polar((a + d) / 2, (c - b) / 2)
    r, reflection = _polar((a - d) / 2, (c + b) / 2)
    phi, theta = (rotation + reflection) / 2, (rotation - reflection) / 2
    u = torch.stack([phi.cos(), phi.sin()], dim=-1)
    t = torch.stack([theta.cos(), -theta.sin()], dim=-1)
    return torch.stack([q + r, (q - r).abs()], dim=-1), u, t


def core_svd(cores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Singular values (..., r) descending, and the leading left/right singular vectors u, t (..., r) of cores.

    On an accelerator with the paper's rank r = 2 this is `svd_2x2`: a few elementwise ops instead of
    `torch.linalg.svd`, which synchronizes a CUDA device with the host at every call (twice per memory layer
    per forward: retrieval and aux loss) and so stalls decoding and breaks CUDA graphs. On CPU, where there is
    no device to wait for, LAPACK's 2x2 SVD costs less than the dozen small ops of the closed form.
    """
    if cores.shape[-1] == 2 and cores.device.type != "cpu":
        return svd_2x2(cores)
    left, singular_values, right_h = torch.linalg.svd(cores)
    return singular_values, left[..., :, 0], right_h[..., 0, :]


def tucker_aux_loss(cores: torch.Tensor, alpha: float, tau: float) -> torch.Tensor:
    """alpha/(r-1) * sum_{i>=2} max(0, lambda_i - tau)^2 of each head's summed core, summed over heads.

    cores: (..., h, r, r), the MCS cores of one memory layer or of several stacked (one SVD call for all).
    """
    rank = cores.shape[-1]
    if rank == 1:
        return cores.new_zeros(())
    singular_values, _, _ = core_svd(cores.sum(-3).float())  # (..., r), descending
    excess = F.relu(singular_values[..., 1:] - tau)
    return alpha / (rank - 1) * excess.pow(2).sum()


class TuckerQueryKeyRetrieval(nn.Module):
    """Tucker Decomposed Query-Key Retrieval (TDQKR) with multi-core scoring (MCS).

    Scores are S_row^T C S_col with a rank-r Tucker core C = sum_i C^(i). The top-m is approximated in
    two phases through the rank-1 SVD C ~ sigma u t^T: m rows by a = u^T S_row and m columns by
    b = t^T S_col, then the exact scores of the m x m candidates pick the final m (see `candidates`).
    """

    def __init__(self, config: UltraMemConfig, scales: MemoryInitScales):
        super().__init__()
        self.topk = config.memory_topk
        self.num_keys = config.memory_num_keys
        part_dim = config.memory_key_dim // config.tucker_rank
        shape = (config.memory_heads, config.tucker_rank, config.memory_num_keys, part_dim)
        self.row_keys = nn.Parameter(torch.empty(shape))
        self.col_keys = nn.Parameter(torch.empty(shape))
        self.cores = nn.Parameter(
            torch.empty(config.memory_heads, config.mcs_cores, config.tucker_rank, config.tucker_rank)
        )
        self.key_norm = key_norm(config, scales)
        self.inference_cache = InferenceCache()
        self.signed_candidates = config.tdqkr_signed_candidates

    def init_ultramem(self) -> None:
        init_keys(self)
        num_cores, rank = self.cores.shape[1], self.cores.shape[-1]
        init.normal_(self.cores, std=(num_cores * rank * rank) ** -0.5)  # E||sum_i C^(i)||_F^2 = 1

    def axis_scores(self, row_query: torch.Tensor, col_query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """S_row and S_col for every key: (B, T, H, r, n) each."""
        return key_axis_scores(self, row_query, col_query)

    def score_factors(self, row_scores: torch.Tensor, col_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., r, n) factors F_row, F_col with grid score [x, y] = F_row[:, x] . F_col[:, y]; for diagnostics.

        In the SVD basis of the summed core C = U diag(sigma) T^T: F_row = diag(sigma) U^T S_row, F_col = T^T S_col,
        so the leading rank-1 term comes first and per-axis bounds on the score are tight.
        """
        left, singular_values, right_h = torch.linalg.svd(self.cores.sum(1).float())  # (H, r, r), (H, r), (H, r, r)
        row = torch.einsum("hak,...han->...hkn", left * singular_values.unsqueeze(-2), row_scores.float())
        return row, torch.einsum("hkb,...hbn->...hkn", right_h, col_scores.float())

    def candidates(self, row_projected: torch.Tensor, col_projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidate rows and columns (..., m') from the rank-1 projections a (..., n) and b (..., n).

        sigma a_x b_y is large where a_x and b_y are both large, or both very negative. The SVD's sign is
        arbitrary ((u, t) and (-u, -t) are the same rank-1 core), so picking the positive quadrant after a sign
        normalisation makes retrieval jump when the normalisation flips (a tiny rotation of the core can
        change every selected slot). Both quadrants are considered instead, which is sign-invariant:
        by default each token takes the quadrant, (top-m a, top-m b) or (bottom-m a, bottom-m b), whose best
        rank-1 score is higher (m' = m, the paper's m^2 candidates); with `tdqkr_signed_candidates` the m
        largest and m smallest of each axis are all kept (m' = 2m, 4 m^2 candidates, exact for rank-1 cores).
        Measured in README "Decisions" (`benchmarks/bench_retrieval.py`).
        """
        if self.signed_candidates:
            row_index, col_index = (
                torch.cat([axis.topk(self.topk, dim=-1).indices, axis.topk(self.topk, dim=-1, largest=False).indices], -1)
                for axis in (row_projected, col_projected)
            )
            return row_index, col_index
        # The quadrant is chosen from the axes' extremes, then one top-m per axis runs on the sign-flipped
        # projections (the bottom-m of a is the top-m of -a): two topk calls instead of four, same candidates.
        row_min, row_max = row_projected.amin(dim=-1, keepdim=True), row_projected.amax(dim=-1, keepdim=True)  # (..., 1)
        col_min, col_max = col_projected.amin(dim=-1, keepdim=True), col_projected.amax(dim=-1, keepdim=True)
        sign = torch.where(row_max * col_max >= row_min * col_min, 1.0, -1.0).to(row_projected.dtype)
        row_index, col_index = ((axis * sign).topk(self.topk, dim=-1).indices for axis in (row_projected, col_projected))
        return row_index, col_index

    @torch.no_grad()
    def leading_singular_vectors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """u, t of the rank-1 SVD of each head's summed core: (H, r) each, of arbitrary (joint) sign."""
        _, u, t = core_svd(self.cores.sum(1).float())
        return u.to(self.cores.dtype), t.to(self.cores.dtype)

    def forward(
        self, row_query: torch.Tensor, col_query: torch.Tensor, ops: MemoryOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Virtual addresses (B, T, H, m) and per-core scores (B, T, H, m, h)."""
        row_scores, col_scores = self.axis_scores(row_query, col_query)  # (B, T, H, r, n)
        u, t = self.inference_cache.get("singular_vectors", (self.cores,), self.leading_singular_vectors)
        # a = u^T S_row, b = t^T S_col, summed over the rank by broadcasting (an einsum here goes through a bmm on a
        # permuted copy: 10x slower on CPU)
        row_index, col_index = self.candidates(
            (row_scores.detach() * u.unsqueeze(-1)).sum(-2), (col_scores.detach() * t.unsqueeze(-1)).sum(-2)
        )  # (B, T, H, m') each
        rank, num_candidates = row_scores.shape[-2], row_index.shape[-1]
        row_candidates = row_scores.gather(-1, row_index.unsqueeze(-2).expand(-1, -1, -1, rank, -1))
        col_candidates = col_scores.gather(-1, col_index.unsqueeze(-2).expand(-1, -1, -1, rank, -1))
        flat_index, core_scores = ops.tucker_candidate_topk(
            row_candidates, col_candidates, self.cores, self.topk
        )  # (B, T, H, m), (B, T, H, m, h)
        rows = row_index.gather(-1, flat_index // num_candidates)
        cols = col_index.gather(-1, flat_index % num_candidates)
        return rows * self.num_keys + cols, core_scores


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
    group v' div N; the E pooled groups go through their projectors as one GEMM. The memory layer reads the
    rows from its value store in between (`physical_slots`, then the store, then `forward`).
    """

    def __init__(self, config: UltraMemConfig, scales: MemoryInitScales):
        super().__init__()
        self.num_groups = config.ive_expansion
        self.num_values = config.memory_num_values
        self.seed = config.ive_shuffle_seed
        shuffle = None
        if self.num_groups > 1:
            # Filled here too (not only in `_init_weights`) so every rank of a ZeRO-3 run, where weights are
            # initialised on one rank and only parameters are broadcast, holds the same bijection.
            size = config.memory_num_keys**2
            device = torch.empty(0).device  # the default device, e.g. meta inside `from_pretrained`
            shuffle = torch.empty(size, dtype=torch.int64) if device.type == "meta" else ive_shuffle(size, self.seed)
            shuffle = shuffle.to(device)
        self.register_buffer("virtual_to_physical", shuffle)
        self.projector = (
            ValueProjector(
                self.num_groups * config.memory_value_dim,
                config.hidden_size,
                scales.projector_std,
            )
            if config.value_projection
            else nn.Identity()
        )

    def init_ultramem(self) -> None:
        if self.virtual_to_physical is not None:
            init.copy_(self.virtual_to_physical, ive_shuffle(self.virtual_to_physical.numel(), self.seed))

    def physical_slots(self, virtual_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Virtual addresses (...) -> physical rows in [0, N) and IVE groups in [0, E), same shape."""
        if self.virtual_to_physical is not None:
            virtual_index = self.virtual_to_physical[virtual_index]
        return virtual_index % self.num_values, torch.div(virtual_index, self.num_values, rounding_mode="floor")

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled values (T, E, Dv) of the E groups -> output (T, D)."""
        return self.projector(pooled.flatten(1))


class UltraMemMemoryLayer(GradientCheckpointingLayer):
    """One UltraMem memory layer: pre-norm, query, retrieval (TDQKR or PKM), value lookup and IVE pooling."""

    def __init__(self, config: UltraMemConfig, memory_idx: int):
        super().__init__()
        self.config = config
        self.memory_idx = memory_idx
        self.read_block, self.write_block = config.memory_layers[memory_idx]
        conv_state_slots = config.memory_conv_state_slots
        cache_layer_idx, state_idx = conv_state_slots[memory_idx] if conv_state_slots else (0, 0)  # else: no state
        scales = MemoryInitScales.from_config(config)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.query = MemoryQuery(config, scales, cache_layer_idx, state_idx)
        retrieval_cls = TuckerQueryKeyRetrieval if config.retrieval_mode == TUCKER else ProductKeyRetrieval
        self.retrieval = retrieval_cls(config, scales)
        self.values = (
            DeferredValueTable(
                config.memory_num_values, config.memory_value_dim, config.memory_offload, scales.value_std
            )
            if tables_deferred(config)
            else MemoryValueTable(config.memory_num_values, config.memory_value_dim, scales.value_std)
        )
        self.value_expansion = ImplicitValueExpansion(config, scales)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def retrieve(
        self,
        hidden_states: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        ops: MemoryOps | None = None,
        sequence_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Virtual addresses (B, T, H, m) and scores (B, T, H, m, h) for the residual stream (B, T, D).

        padding_mask (B, T): 0 at padded tokens. sequence_ids (B, T): for rows that pack several sequences, the
        sequence of each token (Transformers' `find_packed_sequence_indices`); None when each row is one sequence.
        """
        ops = ops or select_memory_ops(self.config.memory_kernel, hidden_states.device)
        row_query, col_query = self.query(self.norm(hidden_states), padding_mask, cache, sequence_ids)
        virtual_index, scores = self.retrieval(row_query, col_query, ops)
        if self.config.memory_score_softmax:
            scores = scores.softmax(dim=-2)
        return virtual_index, scores

    def forward(
        self,
        hidden_states: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        sequence_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if hasattr(self.values, "base_layer"):  # a PEFT adapter layer wraps the table and adds to the rows it embeds
            raise ValueError(
                "PEFT adapters cannot target the value tables (`values`): the memory layer pools the rows it reads "
                "instead of embedding them. Train them with modules_to_save=['values'], or leave them frozen."
            )
        slots = self._selected_slots(hidden_states, padding_mask, cache, sequence_ids)
        return self._output(self.values(*slots), hidden_states)

    def start(
        self,
        hidden_states: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        sequence_ids: torch.Tensor | None = None,
    ) -> Callable[[], torch.Tensor]:
        """Start the layer at its read block; the returned call gives its output, wanted after the write block.

        A store with `lookup_reduce_async` (the offloaded ones) reads its rows in the background while the
        blocks in between compute; any other store runs `forward` now (gradient checkpointing included).
        """
        if not hasattr(self.values, "lookup_reduce_async"):
            output = self(hidden_states, padding_mask, cache=cache, sequence_ids=sequence_ids)
            return lambda: output
        slots = self._selected_slots(hidden_states, padding_mask, cache, sequence_ids)
        pending = self.values.lookup_reduce_async(*slots)
        return lambda: self._output(pending.result(), hidden_states)

    def _selected_slots(
        self,
        hidden_states: torch.Tensor,
        padding_mask: torch.Tensor | None,
        cache: Cache | None,
        sequence_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, MemoryOps]:
        """The value store's arguments: physical rows and IVE groups (B*T, H*m), scores (B*T, H*m, h), E, the ops."""
        batch, length, _ = hidden_states.shape
        ops = select_memory_ops(self.config.memory_kernel, hidden_states.device)
        virtual_index, scores = self.retrieve(hidden_states, padding_mask, cache, ops, sequence_ids)
        num_slots = virtual_index.shape[-2] * virtual_index.shape[-1]
        rows, groups = self.value_expansion.physical_slots(virtual_index.reshape(batch * length, num_slots))
        return rows, groups, scores.reshape(batch * length, num_slots, -1), self.value_expansion.num_groups, ops

    def _output(self, pooled: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """The store's pooled values (B*T, E, Dv) -> the layer's output (B, T, D)."""
        return self.dropout(self.value_expansion(pooled.to(hidden_states.dtype)).view(hidden_states.shape))

    def aux_loss(self) -> torch.Tensor:
        if isinstance(self.retrieval, TuckerQueryKeyRetrieval):
            return tucker_aux_loss(self.retrieval.cores, self.config.aux_loss_alpha, self.config.aux_loss_tau)
        return self.norm.weight.new_zeros((), dtype=torch.float32)


def offloaded_by_accelerate(module: nn.Module) -> bool:
    """Whether Accelerate offloads the module (`device_map` "disk", or "cpu" beside an accelerator): its hooks
    load the weights for each of its forwards and leave meta tensors otherwise."""
    return getattr(getattr(module, "_hf_hook", None), "offload", False)


def offloaded_weights_loaded(modules: list[nn.Module]) -> AbstractContextManager:
    """Loads the weights of those `modules` that are `offloaded_by_accelerate`, for a read outside their forward
    (a no-op context otherwise, which torch.compile traces)."""
    offloaded = [module for module in modules if offloaded_by_accelerate(module)]
    return _weights_loaded(offloaded) if offloaded else nullcontext()


@contextmanager
def _weights_loaded(modules: list[nn.Module]) -> Iterator[None]:
    from accelerate.utils import align_module_device

    with ExitStack() as loaded:
        for module in modules:
            loaded.enter_context(align_module_device(module))
        yield


class UltraMemPreTrainedModel(PreTrainedModel):
    config: UltraMemConfig
    config_class = UltraMemConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["UltraMemDecoderLayer", "UltraMemMemoryLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "hidden_states": UltraMemDecoderLayer,
        "attentions": UltraMemAttention,
    }

    def __init__(self, config: UltraMemConfig, *inputs, **kwargs):
        config.prepare_for_model()  # fields assigned after the config was built are checked before any module is
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
        """Names of the memory value tables, for the optimizer's value-LR parameter group."""
        return [f"{name}.values.weight" for name, _ in self.named_memory_layers()]

    def set_value_store(self, store: str, **options) -> None:
        """Put every memory layer's values in the value store `store` of `VALUE_STORES` (see `ValueStore`).

        Parameter names do not change (`...values.weight`), so optimizer groups and checkpoints keep their keys.
        """
        if store not in VALUE_STORES:
            raise ValueError(f"value store {store!r} is not registered; choose one of {sorted(VALUE_STORES)}")
        self._install_value_store(VALUE_STORES[store], **options)

    def _install_value_store(self, store: type[ValueStore], **options) -> None:
        for name, layer in self.named_memory_layers():
            if not isinstance(layer.values, (MemoryValueTable, DeferredValueTable)):
                raise ValueError(f"{name}.values is already a {type(layer.values).__name__} store")
            layer.values = store.from_table(layer.values, f"{name}.values.weight", **options)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, plus `memory_offload="cpu" | "disk"` (a config field set like any other).

        With it, the value tables are left out of the load (`DeferredValueTable`) and then attached as the
        offloaded stores of `ultramem.offload`, read from the checkpoint's safetensors; everything else goes
        where `device_map` / `dtype` say. The checkpoint is checked first, so a bad one fails before any load.
        """
        config = kwargs.get("config")
        offload = kwargs.get("memory_offload", getattr(config, "memory_offload", None))
        if not offload:
            model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
            if any(offloaded_by_accelerate(layer.values) for _, layer in model.named_memory_layers()):
                logger.warning(
                    "device_map offloads UltraMem value tables: Accelerate loads each of them whole at every "
                    "forward. from_pretrained(..., memory_offload='cpu' | 'disk') reads only the selected rows."
                )
            return model
        validate_memory_offload(offload)
        store = offload_store(offload)
        checkpoint = store.find_checkpoint(pretrained_model_name_or_path, **kwargs)
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model._install_value_store(store, checkpoint=checkpoint, device=model.device, dtype=model.dtype)
        return model

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
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.inference_cache = InferenceCache()
        self.gradient_checkpointing = False
        if tables_deferred(config):  # the tables are attached after loading (`DeferredValueTable`)
            self._keys_to_ignore_on_load_unexpected = [r"memory_layers\.\d+\.values\.weight$"]
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def aux_loss(self) -> torch.Tensor:
        """TDQKR aux loss summed over memory layers (zero without Tucker memory layers).

        One batched SVD per device the cores live on (one in all for a model on one device; several when
        `device_map` spreads the memory layers), summed on the device of the first memory layer. It runs at
        every forward, decode steps included; cached at inference (see `InferenceCache`).
        """
        retrievals = [layer.retrieval for layer in self.memory_layers if isinstance(layer.retrieval, TuckerQueryKeyRetrieval)]
        with offloaded_weights_loaded(retrievals or [self.norm]):
            if not retrievals:
                return self.norm.weight.new_zeros((), dtype=torch.float32)
            cores = tuple(retrieval.cores for retrieval in retrievals)
            return self.inference_cache.get("aux_loss", cores, lambda: self._aux_loss_by_device(cores))

    def _aux_loss_by_device(self, cores: tuple[torch.Tensor, ...]) -> torch.Tensor:
        cores_by_device: dict[torch.device, list[torch.Tensor]] = {}
        for core in cores:
            cores_by_device.setdefault(core.device, []).append(core)
        losses = [
            tucker_aux_loss(torch.stack(group), self.config.aux_loss_alpha, self.config.aux_loss_tau)
            for group in cores_by_device.values()
        ]
        return sum(loss.to(losses[0].device) for loss in losses[1:]) + losses[0]

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
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
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # (B, T, D)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
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
            causal_mask = create_causal_mask(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                cache=cache,
                position_ids=position_ids,
            )
            # (B, T) padding mask of the current tokens for the query convolutions, also on one-token steps
            padding_mask = None
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
                padding_mask = attention_mask[:, -inputs_embeds.shape[1] :]

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        pending: dict[int, Callable[[], torch.Tensor]] = {}  # memory layer -> its output, wanted at its write block
        for block_idx, decoder_layer in enumerate(self.layers):
            for memory_layer in self.memory_layers:
                if memory_layer.read_block == block_idx:  # starts as soon as its input exists
                    pending[memory_layer.memory_idx] = memory_layer.start(
                        hidden_states, padding_mask, cache, sequence_ids
                    )
            writes = [pending.pop(layer.memory_idx)() for layer in self.memory_layers if layer.write_block == block_idx]
            hidden_states = decoder_layer(
                hidden_states,
                torch.stack(writes).sum(0) if writes else None,  # (B, T, D); positional, see the layer
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                cache=cache,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


class UltraMemForCausalLM(UltraMemPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: UltraMemConfig):
        super().__init__(config)
        self.model = UltraMemModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def init_continuous_batching(self, *args, **kwargs):
        """Continuous batching (`generate_batch`, `transformers serve`) works without query convs: every other part
        of a memory layer is per token. Its paged cache has no place for conv states, so it is refused with them."""
        if self.config.memory_conv_state_slots:
            raise NotImplementedError(
                "Continuous batching (generate_batch, init_continuous_batching) has no cache for UltraMem's query-conv "
                "states (use_query_conv=True with query_conv_kernel_size > 1): use model.generate(), which batches "
                "with left padding."
            )
        return super().init_continuous_batching(*args, **kwargs)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
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
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])  # (B, T, vocab)
        aux_loss = self.model.aux_loss()
        loss = lm_loss = None
        if labels is not None:
            lm_loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            loss = lm_loss + aux_loss.to(lm_loss.device, lm_loss.dtype)
        return UltraMemCausalLMOutputWithPast(
            loss=loss,
            lm_loss=lm_loss,
            aux_loss=aux_loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


# The Trainer's label smoothing shifts the labels only for models named in Transformers' static causal-LM table,
# which `AutoModelForCausalLM.register` (and `trust_remote_code` loading) leave as they are: without this entry
# it would train UltraMem to predict the current token. Here so that remote-code copies of this file add it too.
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(UltraMemConfig.model_type, UltraMemForCausalLM.__name__)


class TaskHeadWithAuxLoss:
    """A Transformers task head on UltraMemModel whose loss also holds the TDQKR aux loss, as the causal LM's does.

    Without it fine-tuning would leave the Tucker cores free to drift from the rank-1 approximation retrieval uses.
    The generic heads compute their loss with `self.loss_function` when given labels; the aux loss is added there.
    Those losses are means over the micro-batch (they take no `num_items_in_batch`), so the Trainer must average
    them over gradient-accumulation steps itself: `accepts_loss_kwargs = False` (a `**kwargs` forward says otherwise).
    """

    accepts_loss_kwargs = False

    @property
    def loss_function(self) -> Callable[..., torch.Tensor]:
        task_loss = super().loss_function

        def task_and_aux_loss(*args, **kwargs) -> torch.Tensor:
            loss = task_loss(*args, **kwargs)
            return loss + self.model.aux_loss().to(loss.device, loss.dtype)

        return task_and_aux_loss


class UltraMemForSequenceClassification(TaskHeadWithAuxLoss, GenericForSequenceClassification, UltraMemPreTrainedModel):
    """Scores (B, num_labels) from the last non-padding token, as `LlamaForSequenceClassification`."""


class UltraMemForTokenClassification(TaskHeadWithAuxLoss, GenericForTokenClassification, UltraMemPreTrainedModel):
    """Scores (B, T, num_labels) for every token, as `LlamaForTokenClassification`."""


class UltraMemForQuestionAnswering(TaskHeadWithAuxLoss, GenericForQuestionAnswering, UltraMemPreTrainedModel):
    """Span start and end logits (B, T) each, as `LlamaForQuestionAnswering`."""


TASK_HEADS = {
    "AutoModelForSequenceClassification": UltraMemForSequenceClassification,
    "AutoModelForTokenClassification": UltraMemForTokenClassification,
    "AutoModelForQuestionAnswering": UltraMemForQuestionAnswering,
}

__all__ = [
    "UltraMemForCausalLM",
    "UltraMemForQuestionAnswering",
    "UltraMemForSequenceClassification",
    "UltraMemForTokenClassification",
    "UltraMemModel",
    "UltraMemPreTrainedModel",
]
