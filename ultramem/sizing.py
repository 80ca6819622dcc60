"""Build a model for any config this project knows (UltraMem/PKM/dense, Mixtral), count its parameters, and the
bytes one decoding step must read (the paper's memory-access model).

Kept apart from the named presets so that evaluation, model cards and training can count a checkpoint's
parameters without importing the preset table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedConfig, PreTrainedModel

from .modeling_ultramem import UltraMemForCausalLM


def build_model(config: PreTrainedConfig) -> PreTrainedModel:
    """A randomly initialised model for a preset's config.

    `save_pretrained` writes no tokenizer: save `ultramem.tokenization.load_tokenizer()` into the same folder (or
    run `python -m ultramem.tokenization FOLDER`); until then `AutoTokenizer`, `pipeline` and lm-eval refuse the
    folder with that hint.
    """
    if isinstance(config, MixtralConfig):
        return MixtralForCausalLM(config)
    return UltraMemForCausalLM(config)


def count_parameters(config: PreTrainedConfig) -> dict[str, float]:
    """Total and activated parameters and FLOPs per token, embeddings and head excluded, on the meta device.

    Activated parameters are those a token multiplies: all dense weights, all keys (scored in full), and
    H*m value rows (and pre-value rows) per memory layer; for MoE, the shared weights plus k of the experts. FLOPs
    per token = 2 x activated parameters (attention over the context excluded), as in the paper's FLOPs column. A
    value pool shared by the memory layers counts once in the total. `sparse`: the parameters a token reads a few rows
    or experts of (value, pre-value and n-gram tables; MoE experts).
    """
    with torch.device("meta"):
        model = build_model(config)
    excluded = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    params = {name: p for name, p in model.named_parameters() if id(p) not in excluded}
    total = sum(p.numel() for p in params.values())
    activated = total
    memory_slots = physical_values = sparse = 0
    if isinstance(config, MixtralConfig):
        expert_params = sum(p.numel() for name, p in params.items() if ".experts." in name)
        activated = total - expert_params + expert_params * config.num_experts_per_tok // config.num_local_experts
        sparse = expert_params
    elif config.memory_layers:
        tables = {name: params[name] for name in model.get_value_table_names()}
        sparse = sum(table.numel() for table in tables.values())
        activated -= sparse
        row_width = config.memory_value_dim + config.pre_value_dim  # a slot reads a value row and its pre-value row
        activated += config.num_memory_layers * config.memory_heads * config.memory_topk * row_width
        physical_values = sum(table.shape[0] for name, table in tables.items() if ".pre_value" not in name)
        memory_slots = config.num_memory_layers * config.memory_num_keys**2
    if getattr(config, "ngram_layers", None):  # each token reads (N-1) K rows of each n-gram table
        ngram_tables = [
            p
            for name, p in params.items()
            if name.startswith("model.ngram_memories.") and name.endswith(".values.weight")
        ]
        sparse += sum(table.numel() for table in ngram_tables)
        activated -= sum(table.numel() for table in ngram_tables)
        activated += len(ngram_tables) * (config.ngram_order - 1) * config.ngram_heads * config.ngram_head_dim
    return {
        "total": total,
        "activated": activated,
        "flops_per_token": 2 * activated,
        "memory_slots": memory_slots,
        "physical_values": physical_values,
        "sparse": sparse,
    }


@dataclass(frozen=True)
class DecodeAccess:
    """Bytes one decoding step must read, split as in the paper's section "Why UltraMem instead of MoE"."""

    dense_weights: int  # every weight read once per step regardless of batch (attention, MLP, keys, projectors, head)
    sparse_weights: int  # MoE: min(k*B, N_moe) experts per layer; UltraMem: min(B*H*m, N) value rows per memory layer
    kv_cache: int  # keys and values of the context

    @property
    def total(self) -> int:
        return self.dense_weights + self.sparse_weights + self.kv_cache


def decode_memory_access(model: PreTrainedModel, batch: int, context: int, bytes_per_value: int) -> DecodeAccess:
    """The paper's memory-access model for one step of `batch` tokens with a KV cache of `context` tokens.

    MoE layer: min(k*B, N_moe) x (one expert's weights); the paper's experts are 2-matrix GeLU (2 x D x 2D),
    Mixtral's are SwiGLU (3 x D x 2/3*2D), the same bytes. UltraMem memory layer: min(B*H*m, N) x Dv for the
    values; keys, query and projectors are read whole. Input embeddings count B rows; everything else once.
    `model` may live on the meta device: only parameter shapes are read.
    """
    config = model.config
    embedding = model.get_input_embeddings().weight
    value_tables = set(model.get_value_table_names()) if hasattr(model, "get_value_table_names") else set()
    dense = sparse = 0
    for name, param in model.named_parameters():
        if param is embedding and not config.tie_word_embeddings:
            dense += min(batch, param.shape[0]) * param.shape[1]
        elif name in value_tables:
            slots = config.memory_heads * config.memory_topk * batch
            sparse += min(slots, param.shape[0]) * param.shape[1]
        elif ".experts." in name:
            experts = param.shape[0]
            sparse += min(config.num_experts_per_tok * batch, experts) * (param.numel() // experts)
        else:
            dense += param.numel()
    kv_width = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * batch * context * config.num_hidden_layers * kv_width * head_dim
    return DecodeAccess(dense * bytes_per_value, sparse * bytes_per_value, kv * bytes_per_value)
