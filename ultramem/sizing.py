"""Build a model for any config this project knows (UltraMem/PKM/dense, Mixtral) and count its parameters.

Kept apart from the named presets so that evaluation, model cards and training can count a checkpoint's
parameters without importing the preset table.
"""

from __future__ import annotations

import torch
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedConfig, PreTrainedModel

from .modeling_ultramem import UltraMemForCausalLM
from .value_stores import is_ngram_table


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
        tables = {name: params[name] for name in model.get_value_table_names() if not is_ngram_table(name)}
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
