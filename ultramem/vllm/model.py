"""UltraMem for vLLM: the GPT-NeoX-shaped backbone on vLLM's layers (paged attention with rotary embeddings,
parallel linear layers, vocab-parallel embedding and head), the memory layers of `ultramem.vllm.memory` and the
n-gram memories of `ultramem.vllm.ngram`.

vLLM hands the model every scheduled request's tokens as one flat batch (T,) with their positions; attention, the
query convolutions and the n-gram memories' token windows and convolutions find each request's past in vLLM's caches
(KV pages, conv states), the rest is per token. The memory layer [a, b] reads the stream entering block a and its
output is added to the stream leaving block b; an n-gram memory adds to the stream entering its block; as in
`modeling_ultramem.UltraMemModel`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import get_act_fn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.sequence import IntermediateTensors

from ultramem.configuration_ultramem import BLOCK_SITE
from ultramem.quantized import quantize
from ultramem.quantized.stores import table_geometry

from .memory import build_memory_layer, build_value_pool, run_memory_layers, state_span
from .ngram import TokenWindow, build_ngram_memory, start_ngram_reads
from .support import check_supported


class UltraMemAttention(nn.Module):
    """Multi-head causal self-attention, rotate-half RoPE over the full head (Llama's, no grouped KV heads)."""

    def __init__(self, config, cache_config: CacheConfig | None, prefix: str):
        super().__init__()
        num_heads, self.head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
        local_heads = num_heads // get_tensor_model_parallel_world_size()  # this rank's heads
        self.q_size = local_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            num_heads,
            num_heads,
            bias=config.attention_bias,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias, prefix=f"{prefix}.o_proj"
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=config.max_position_embeddings,
            is_neox_style=True,
            rope_parameters=config.rope_parameters,
        )
        self.attn = Attention(
            local_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=local_heads, cache_config=cache_config,
            prefix=f"{prefix}.attn",
        )  # fmt: skip

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size] * 3, dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        output, _ = self.o_proj(self.attn(q, k, v))
        return output


class UltraMemMLP(nn.Module):
    """up -> activation (exact GeLU by default) -> down."""

    def __init__(self, config, prefix: str):
        super().__init__()
        size, inner = config.hidden_size, config.intermediate_size
        self.up_proj = ColumnParallelLinear(size, inner, bias=config.mlp_bias, prefix=f"{prefix}.up_proj")
        self.down_proj = RowParallelLinear(inner, size, bias=config.mlp_bias, prefix=f"{prefix}.down_proj")
        self.act = get_act_fn(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, _ = self.up_proj(x)
        down, _ = self.down_proj(self.act(up))
        return down


class UltraMemDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(LN(x)), then + the MLP-site memory layers' outputs and mlp(LN(x)) (either may be
    absent: "instead_of_mlp" blocks have no MLP), then + the block-site memory outputs that write after it; the order
    of `modeling_ultramem.UltraMemDecoderLayer`'s sums."""

    def __init__(self, config, layer_idx: int, cache_config: CacheConfig | None, prefix: str):
        super().__init__()
        self.self_attn = UltraMemAttention(config, cache_config, f"{prefix}.self_attn")
        has_mlp = layer_idx not in config.blocks_without_mlp
        self.mlp = UltraMemMLP(config, f"{prefix}.mlp") if has_mlp else None
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if has_mlp else None

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        memory_output: torch.Tensor | None,
        parallel_memory: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(positions, self.input_layernorm(hidden_states))
        update = parallel_memory(hidden_states) if parallel_memory is not None else None
        if self.mlp is not None:
            mlp_output = self.mlp(self.post_attention_layernorm(hidden_states))
            update = mlp_output if update is None else update + mlp_output
        if update is not None:
            hidden_states = hidden_states + update
        return hidden_states if memory_output is None else hidden_states + memory_output


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0})
class UltraMemModel(nn.Module):
    """Embedding, the blocks with their memory layers, final LayerNorm: token ids (T,) -> hidden states (T, D).

    Block-site memory layer [a, b] reads the stream entering block a, its output is added to the stream leaving block
    b; MLP-site ones (UltraMemV2, Memory+) read the stream after block a's attention, beside its MLP; an n-gram memory
    adds to the stream entering its block, its rows read from before the first block; as in
    `modeling_ultramem.UltraMemModel`. A value pool shared by the memory layers is held here, as there.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config, cache_config = vllm_config.model_config.hf_config, vllm_config.cache_config
        self.mlp_site = config.memory_site != BLOCK_SITE
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [
                UltraMemDecoderLayer(config, i, cache_config, f"{prefix}.layers.{i}")
                for i in range(config.num_hidden_layers)
            ]
        )
        self.memory_layers = nn.ModuleList(
            [
                build_memory_layer(config, j, vllm_config.model_config, cache_config, f"{prefix}.memory_layers.{j}")
                for j in range(config.num_memory_layers)
            ]
        )
        self.value_pool, self.pre_value_pool = build_value_pool(config)
        self.ngram_memories = nn.ModuleList(
            [
                build_ngram_memory(config, j, vllm_config.model_config, cache_config, f"{prefix}.ngram_memories.{j}")
                for j in range(len(config.ngram_layers))
            ]
        )
        self.token_window = None  # each token's last ngram_order ids, read by every n-gram memory
        if config.ngram_layers:
            # its state's name: vLLM orders the state layers by the one integer in their names (read before block 0)
            self.token_window = TokenWindow(config, vllm_config.model_config, cache_config, f"{prefix}.token_window.0")
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None):
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        stores = (self.value_pool, self.pre_value_pool) if self.value_pool is not None else None
        ngram_reads = start_ngram_reads(self.ngram_memories, self.token_window, input_ids)  # before the first block
        outputs: dict[int, torch.Tensor] = {}  # block-site memory layer -> its output, until its write block
        for block_idx, block in enumerate(self.layers):
            for ngram, read in zip(self.ngram_memories, ngram_reads, strict=True):
                if ngram.block == block_idx:
                    hidden_states = hidden_states + ngram(hidden_states[None], input_ids, started=read)[0]
            reading = [layer for layer in self.memory_layers if layer.read_block == block_idx]
            parallel_memory = None
            if reading and self.mlp_site:
                parallel_memory = functools.partial(run_memory_layers, reading, stores=stores)
            for layer in reading if parallel_memory is None else ():
                outputs[layer.memory_idx] = run_memory_layers([layer], hidden_states, stores)
            writes = [
                outputs.pop(j)
                for j, layer in enumerate(self.memory_layers)
                if layer.write_block == block_idx and j in outputs
            ]
            hidden_states = block(
                positions, hidden_states, torch.stack(writes).sum(0) if writes else None, parallel_memory
            )
        return self.norm(hidden_states)


class UltraMemForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """vLLM's UltraMem causal LM. Hybrid: each memory layer's query convolution, each n-gram memory's convolution and
    the n-gram memories' token window keep a conv state per request, all of one shape (D, span - 1) (`state_span`).

    Under tensor parallelism the attention heads, the MLP and the value tables' rows are split across the group (the
    memory layers' other parts are replicated). Pipeline parallelism, speculative decoding and offloaded tables are
    refused with one line (`support.check_supported`, which vLLM also runs in the main process before the engine
    starts).
    """

    # checkpoint name -> (this model's parameter, shard of the fused QKV projection)
    stacked_params_mapping = (
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        check_supported(vllm_config)
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = UltraMemModel(vllm_config=vllm_config, prefix=_join(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=_join(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    # The conv state of every state layer: (D, span - 1) in the model's dtype (`memory.state_span`), copied by vLLM as a
    # short conv's is
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...]]:
        config = vllm_config.model_config.hf_config
        return MambaStateShapeCalculator.short_conv_state_shape(1, config.hidden_size, state_span(config))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return MambaStateDtypeCalculator.short_conv_state_dtype(
            vllm_config.model_config.dtype, vllm_config.cache_config.mamba_cache_dtype
        )

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.short_conv_state_copy_func()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a checkpoint by its Transformers names, buffers included (the IVE shuffle, the query normalisation's
        statistics, quantized tables). A float table whose config asks for a quantized one (`memory_quantization`
        given as an override) is quantized as it loads, row block by row block as `quantize` does."""
        targets = dict(self.named_parameters())
        targets.update((name, buffer) for name, buffer in self.named_buffers() if buffer is not None)
        loaded: set[str] = set()
        for name, weight in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for fused, part, shard in self.stacked_params_mapping:
                if part in name and ".self_attn." in name:
                    name = name.replace(part, fused)
                    targets[name].weight_loader(targets[name], weight, shard)
                    break
            else:
                if name not in targets:
                    raise ValueError(f"checkpoint weight {name!r} has no place in ultramem.vllm's UltraMemForCausalLM")
                target = targets[name]
                if target.dtype == torch.uint8 and weight.dtype != torch.uint8:  # a float table, served quantized
                    num_cores = table_geometry(self.config, name)[1]  # an n-gram table's rows: one chunk
                    weight = quantize(weight, self.config.memory_quantization, num_cores, self._group_size(name))
                getattr(target, "weight_loader", default_weight_loader)(target, weight)
            loaded.add(name)
        return loaded

    def _group_size(self, table_name: str) -> int:
        store = self.get_submodule(table_name.rsplit(".", 1)[0])
        return getattr(store, "table", store).group_size  # a TensorParallelRows holds this rank's table


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
