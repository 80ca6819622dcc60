"""The memory layer's query network (paper section 3, tricks 4 and 5): a causal depthwise convolution over time
whose last inputs live in the generation cache, a linear map, the across-token normalisation
(`query_normalization`), and a LayerNorm on each Tucker part.

This file is copied beside `modeling_ultramem.py` into checkpoints (remote code), so it imports only relatively.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin

from .configuration_ultramem import NO_QUERY_NORM, UltraMemConfig
from .inference_cache import CacheEntry, InferenceCache, held_here
from .init_scales import MemoryInitScales, ScaledLayerNorm
from .query_normalization import QueryNormalization


@dataclass(frozen=True)
class MemoryInputs:
    """What every memory layer of one forward reads beside the residual stream; the model builds it once."""

    padding_mask: torch.Tensor | None = None  # (B, T): 0 at padded tokens of the current ones
    cache: Cache | None = None  # the generation cache, holding the convolutions' states
    sequence_ids: torch.Tensor | None = None  # (B, T): each token's sequence, for rows that pack several
    stores: tuple[nn.Module, nn.Module | None] | None = None  # a shared value pool: (values, pre-values)


class CausalDepthwiseConv(nn.Module):
    """Causal depthwise Conv1d over time (trick 4), with its last (k-1) x dilation inputs kept in the generation cache.

    Padded positions are zeroed before the convolution, so left padding never leaks into a real token's
    query, and the cached state is exactly what a full recomputation would see. Rows that pack several
    sequences (`sequence_ids`, padding-free training) are convolved within each sequence only, as attention
    attends within each.
    """

    def __init__(self, channels: int, kernel_size: int, state_slot: tuple[int, int] | None, dilation: int = 1):
        """`state_slot`: (cache layer, slot) of its inputs in the generation cache; None for one tap, which keeps none."""
        super().__init__()
        self.kernel_size = kernel_size
        self.dilation = dilation  # the n-gram memory's conv skips N - 1 tokens between taps (Engram)
        self.state_slot = state_slot
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.empty(channels))
        self.inference_cache = InferenceCache()

    def init_ultramem(self) -> None:
        """Start as the identity on the current token, so adding the conv does not change the initial model."""
        identity = torch.zeros_like(self.weight)
        identity[..., -1] = 1.0
        init.copy_(self.weight, identity)
        init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, inputs: MemoryInputs = MemoryInputs()) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D)."""
        if inputs.sequence_ids is not None:
            return self._within_sequences(self._masked(x, inputs), inputs.sequence_ids)
        window = self.window(x, inputs)  # (B, D, (k-1) * dilation + T)
        if x.shape[1] == 1:  # a decode step: one dot product per channel, a fraction of conv1d's cost on CPU
            return _convolved_window(window, self._window_taps(), self.bias)
        convolved = F.conv1d(window, self.weight, self.bias, dilation=self.dilation, groups=window.shape[1])
        return convolved.transpose(1, 2)  # (B, T, D)

    def decode_step(self) -> Callable[[torch.Tensor, MemoryInputs], torch.Tensor] | None:
        """`forward` for decode steps (x (B, 1, D) -> (B, 1, D)) on the taps as they are now, for the steps of one
        `generate` call (`UltraMemModel.fixed_weights`); None for a weight held elsewhere (ZeRO-3, accelerate)."""
        if not held_here(self.weight, self.bias):
            return None
        taps, bias, window_of = self._window_taps(), self.bias, self.window
        return lambda x, inputs: _convolved_window(window_of(x, inputs), taps, bias)

    def cached_entries(self) -> dict[str, CacheEntry]:
        """What `inference_cache` keeps (for `refresh_inference_cache`): a dilated conv's taps spread over the window
        of a decode step (`_spread_taps`)."""
        return {"spread_taps": ((self.weight,), self._spread_taps)} if self._caches_taps() else {}

    def _caches_taps(self) -> bool:
        """Whether a decode step reads its taps from `inference_cache`: dilated, the weight held here (one that ZeRO-3
        partitions or accelerate offloads is whole only inside this module's forward)."""
        return self.dilation > 1 and held_here(self.weight)

    def _window_taps(self) -> torch.Tensor:
        """One weight (D, (k-1) * dilation + 1) per input of a decode step's window: the taps themselves, or spread
        with the zeros between them (one product over the window, no picking of every dilation-th input)."""
        if self.dilation == 1:
            return self.weight[:, 0]
        if self._caches_taps():
            return self.inference_cache.get("spread_taps", (self.weight,), self._spread_taps)
        return self._spread_taps()

    def _spread_taps(self) -> torch.Tensor:
        """(D, (k-1) * dilation + 1): the k taps with the dilation - 1 zeros between them."""
        taps = F.pad(self.weight[:, 0, :, None], (0, self.dilation - 1))  # (D, k, dilation): each tap, then zeros
        return taps.flatten(1)[:, : (self.kernel_size - 1) * self.dilation + 1]

    def window(self, x: torch.Tensor, inputs: MemoryInputs) -> torch.Tensor:
        """The inputs (B, D, (k-1) * dilation + T) the convolution of x (B, T, D) reads: the cached last ones (zeros
        before the first token), then x; the cache then keeps the last of them."""
        x = self._masked(x, inputs).transpose(1, 2)  # (B, D, T)
        context = (self.kernel_size - 1) * self.dilation
        cache = inputs.cache
        if cache is not None and context > 0:
            layers, (layer_idx, state_idx) = cache.layers, self.state_slot
            if len(layers) <= layer_idx or not isinstance(layers[layer_idx], LinearAttentionCacheLayerMixin):
                raise ValueError(
                    "UltraMem keeps query-conv states in the generation cache: build it with "
                    "DynamicCache(config=model.config) (or let the model create it with use_cache=True)."
                )
            has_past = layers[layer_idx].has_previous_state[state_idx]  # get_conv_state: 5.24 on
            # With a previous state the cache returns cat(state, x) before overwriting its state in place
            # (so the old state must not be read after this call); on prefill it returns x, unpadded. While
            # `generate` records the past to roll it back (assisted decoding) the state is longer or shorter than
            # k-1: the window is its last k-1+T inputs, zeros before the first token.
            updated = cache.update_conv_state(x, layer_idx, state_idx, conv_kernel_size=context)
            if has_past:
                width = context + x.shape[-1]
                window = (updated if updated.shape[-1] == width else updated[..., -width:]).to(x.dtype)
                return F.pad(window, (width - window.shape[-1], 0)) if window.shape[-1] < width else window
        return F.pad(x, (context, 0))  # zeros before the first token

    @staticmethod
    def _masked(x: torch.Tensor, inputs: MemoryInputs) -> torch.Tensor:
        """x with its padded tokens zeroed: left padding never reaches a real token's window."""
        return x if inputs.padding_mask is None else x * inputs.padding_mask.unsqueeze(-1).to(x.dtype)

    def _within_sequences(self, x: torch.Tensor, sequence_ids: torch.Tensor) -> torch.Tensor:
        """The convolution of packed rows x (B, T, D), each tap masked where it would reach into the previous sequence.

        sequence_ids (B, T): the index of the sequence each token belongs to. Tap i multiplies x[t - i * dilation]
        by weight[..., k-1-i], as in conv1d over the zero-padded window.
        """
        output = x * self.weight[:, 0, -1] + self.bias
        for tap in range(1, self.kernel_size):
            shift = tap * self.dilation
            if shift >= x.shape[1]:
                break
            same_sequence = (sequence_ids[:, shift:] == sequence_ids[:, :-shift]).unsqueeze(-1)  # (B, T-shift, 1)
            earlier = F.pad(x[:, :-shift] * same_sequence, (0, 0, shift, 0))  # x[t - shift], zero across a boundary
            output = output + earlier * self.weight[:, 0, -1 - tap]
        return output


def _convolved_window(window: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """A decode step's conv: its window (B, D, W) and one tap per input of it (D, W) -> (B, 1, D)."""
    return ((window * taps).sum(-1) + bias).unsqueeze(1)


def _window_features(window: torch.Tensor, taps: list[torch.Tensor]) -> torch.Tensor:
    """A decode step's conv window (B, D, k) -> what the folded projection reads (`window_projection`): the conv's
    output without its bias (B, D) with the taps apart, else the window itself (B, D*k)."""
    return (window * taps[0]).sum(-1) if taps else window.reshape(window.shape[0], -1)


def window_projection(
    weight_t: torch.Tensor, bias: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor, taps_apart: bool
) -> tuple[torch.Tensor, ...]:
    """The projection W'^T (D, F), b' with a depthwise conv (D, 1, k), (D,) before it, as a map of the conv's window
    (B, D, k): (w (D, k), W'^T, b'') with `taps_apart`, else (W''^T (D*k, F), b''); see
    `MemoryQuery._window_projection_entry`."""
    bias = torch.addmv(bias, weight_t.T, conv_bias)  # b'' = b' + W' b_conv
    taps = conv_weight[:, 0, :]  # (D, k)
    if taps_apart:
        return taps, weight_t, bias
    return (taps[..., None] * weight_t[:, None, :]).flatten(0, 1), bias  # (D*k, F)


class MemoryQuery(nn.Module):
    """Query network: optional causal depthwise conv, a linear map, across-token normalisation, LayerNorm on each
    Tucker part.

    With `share_query` one query serves row and column keys (trick 5); otherwise each gets its own. The across-token
    normalisation (`query_norm`, `query_normalization`) removes what all tokens' queries share, which would otherwise
    make every token read the same rows.
    """

    def __init__(self, config: UltraMemConfig, scales: MemoryInitScales, conv_slot: tuple[int, int] | None):
        super().__init__()
        self.num_heads = config.memory_heads
        self.num_queries = 1 if config.share_query else 2
        self.rank = config.tucker_rank
        self.part_dim = config.memory_key_dim // config.tucker_rank
        self.conv = (
            CausalDepthwiseConv(config.hidden_size, config.query_conv_kernel_size, conv_slot)
            if config.use_query_conv
            else None
        )
        features = self.num_heads * self.num_queries * config.memory_key_dim
        self.proj = nn.Linear(config.hidden_size, features, bias=False)
        self.across_tokens = (
            QueryNormalization(
                self.num_heads * self.num_queries * self.rank,
                self.part_dim,
                config.query_norm,
                config.query_norm_momentum,
                config.layer_norm_eps,
            )
            if config.query_norm != NO_QUERY_NORM
            else None
        )
        self.norm = (
            ScaledLayerNorm(self.part_dim, config.layer_norm_eps, scales.query_gain)
            if config.qk_layernorm
            else nn.Identity()
        )
        self.inference_cache = InferenceCache()
        # whether the model's current forward is a training one, and the tokens (B, T) its statistics count (None:
        # those the padding mask keeps), set where it starts (`UltraMemModel.forward`) and read again by a
        # recomputation in the backward (gradient checkpointing), which runs after it returned
        self.training_step = True
        self.counted_tokens: torch.Tensor | None = None

    def cached_entries(self) -> dict[str, CacheEntry]:
        """What `inference_cache` keeps (for `refresh_inference_cache`): the projection with the across-token
        normalisation folded in, which is linear at inference, and for decode steps the conv's bias folded in too (its
        taps too, off CPU: `_window_projection_entry`)."""
        if not self._folds():
            return {}
        entries = {"projection": self._projection_entry()}
        return {**entries, "window_projection": self._window_projection_entry()} if self._folds_conv() else entries

    def _folds(self) -> bool:
        """Whether inference folds the normalisation into the projection: a plain `nn.Linear` whose weight is held
        here. An adapter or a quantized layer runs its own forward; a weight that ZeRO-3 partitions or accelerate
        offloads (meta) is only whole inside the projection's own forward, which its hooks wrap."""
        if not isinstance(self.across_tokens, QueryNormalization) or type(self.proj) is not nn.Linear:
            return False
        return held_here(self.proj.weight)

    def _projection_entry(self) -> CacheEntry:
        """(W'^T (D, F), b'): the normalised query is addmm(b', x, W'^T), one operator."""
        return (self.proj.weight, *self.across_tokens.statistics()), self._folded_projection

    def _folded_projection(self) -> tuple[torch.Tensor, torch.Tensor]:
        weight, bias = self.across_tokens.folded(self.proj.weight)  # (F, D), (F,)
        return weight.T, bias

    def _folds_conv(self) -> bool:
        """Whether a decode step's conv folds into the projection too: an undilated conv of more than one tap whose
        window is this cache's (vLLM's conv keeps its own state)."""
        conv = self.conv
        return type(conv) is CausalDepthwiseConv and conv.kernel_size > 1 and conv.dilation == 1

    def _window_projection_entry(self) -> CacheEntry:
        """A decode step's query from the conv's window (B, D, k), with b'' = b' + W' b_conv (the conv's bias folded):

        - on an accelerator (W''^T (D*k, F), b''): addmm(b'', window, W''^T), W''[f, (d, i)] = W'[f, d] * w[d, i], the
          depthwise conv and the projection as one linear map of the last k inputs (a step there pays per launch);
        - on CPU (w (D, k), W'^T (D, F), b''): addmm(b'', sum_i w[:, i] window[..., i], W'^T), where a decode step is
          memory-bound and W'' is k times W' (ultramem-151m-x12, one thread: 69.0 -> 67.8 ms a step; tiny 12.0 both).
        """
        parameters = (self.proj.weight, *self.across_tokens.statistics(), self.conv.weight, self.conv.bias)
        return parameters, self._folded_window_projection

    def _folded_window_projection(self) -> tuple[torch.Tensor, ...]:
        weight_t, bias = self._folded_projection()  # (D, F), (F,)
        taps_apart = weight_t.device.type == "cpu"
        return window_projection(weight_t, bias, self.conv.weight, self.conv.bias, taps_apart)

    def forward(self, x: torch.Tensor, inputs: MemoryInputs = MemoryInputs()) -> torch.Tensor:
        """The normed residual stream (B, T, D) -> the queries (B, T, H, Q, r, Dk/r): Q = 1 for both axes (trick 5),
        else the row query, then the column query."""
        # running statistics (at inference, and under no_grad as in `generate` after training): a linear map, folded
        # into the projection, unless the statistics of the query are being gathered (`recalibrate_query_statistics`)
        per_token = not (self.training and self.training_step)
        folds = per_token and self._folds() and not self.across_tokens.collecting
        if folds and x.shape[1] == 1 and inputs.sequence_ids is None and self._folds_conv():  # a decode step
            window = self.conv.window(x, inputs)  # (B, D, k)
            *taps, weight_t, bias = self.inference_cache.get("window_projection", *self._window_projection_entry())
            query = torch.addmm(bias, _window_features(window, taps), weight_t)  # (B, H * (1|2) * Dk)
            return self._parts(query, x.shape[:-1])
        if self.conv is not None:
            x = self.conv(x, inputs)
        if folds:
            weight_t, bias = self.inference_cache.get("projection", *self._projection_entry())
            query = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight_t)  # (B*T, H * (1|2) * Dk)
        else:
            query = self.proj(x)  # (B, T, H * (1|2) * Dk)
            if self.across_tokens is not None:
                counted = inputs.padding_mask if self.counted_tokens is None else self.counted_tokens
                query = self.across_tokens(query, counted, self.training_step)
        return self._parts(query, x.shape[:-1])

    def decode_step(self) -> Callable[[torch.Tensor, MemoryInputs], torch.Tensor] | None:
        """`forward` for a decode step (x (B, 1, D) -> (B, 1, H, Q, r, Dk/r)) on the folded weights as they are now:
        for the steps of one `generate` call, whose weights do not change (`UltraMemModel.fixed_weights`). The same
        operators as `forward`, without its module calls, checks and cache look-ups. None where `forward` does not
        fold (an adapter on the projection, statistics being gathered, a conv of another kind)."""
        if self.training or not self._folds() or self.across_tokens.collecting:
            return None
        if type(self.norm) not in (ScaledLayerNorm, nn.Identity) or not held_here(*self.norm.parameters()):
            return None
        shape = (self.num_heads, self.num_queries, self.rank, self.part_dim)
        norm = self.norm if isinstance(self.norm, nn.LayerNorm) else None
        if self.conv is None:
            weight_t, bias = self.inference_cache.get("projection", *self._projection_entry())

            def features(x: torch.Tensor, inputs: MemoryInputs) -> torch.Tensor:
                return x.reshape(-1, x.shape[-1])  # (B, D)

        elif self._folds_conv():
            *taps, weight_t, bias = self.inference_cache.get("window_projection", *self._window_projection_entry())
            window_of = self.conv.window

            def features(x: torch.Tensor, inputs: MemoryInputs) -> torch.Tensor:
                return _window_features(window_of(x, inputs), taps)

        else:
            return None

        def query(x: torch.Tensor, inputs: MemoryInputs) -> torch.Tensor:
            parts = torch.addmm(bias, features(x, inputs), weight_t).view(*x.shape[:-1], *shape)
            return parts if norm is None else F.layer_norm(parts, shape[-1:], norm.weight, norm.bias, norm.eps)

        return query

    def _parts(self, query: torch.Tensor, tokens: torch.Size) -> torch.Tensor:
        """The projected queries (B, T, H * Q * Dk) or (B*T, ...) -> their LayerNorm'd parts (B, T, H, Q, r, Dk/r)."""
        return self.norm(query.view(*tokens, self.num_heads, self.num_queries, self.rank, self.part_dim))
