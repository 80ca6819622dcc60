"""Build a model for any config this project knows (UltraMem/PKM/dense, Mixtral) and count its parameters.

Kept apart from the named presets so that evaluation, model cards and training can count a checkpoint's
parameters without importing the preset table.
"""

from __future__ import annotations

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
    H*m value rows per memory layer; for MoE, the shared weights plus k of the experts. FLOPs per token
    = 2 x activated parameters (attention over the context excluded), as in the paper's FLOPs column.
    """
    with torch.device("meta"):
        model = build_model(config)
    excluded = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    params = {name: p for name, p in model.named_parameters() if id(p) not in excluded}
    total = sum(p.numel() for p in params.values())
    activated = total
    memory_slots = physical_values = 0
    if isinstance(config, MixtralConfig):
        expert_params = sum(p.numel() for name, p in params.items() if ".experts." in name)
        activated = total - expert_params + expert_params * config.num_experts_per_tok // config.num_local_experts
    else:
        for layer in model.model.memory_layers:
            table = layer.values.weight
            activated += config.memory_heads * config.memory_topk * table.shape[1] - table.numel()
            physical_values += table.shape[0]
            memory_slots += config.memory_num_keys**2
    return {
        "total": total,
        "activated": activated,
        "flops_per_token": 2 * activated,
        "memory_slots": memory_slots,
        "physical_values": physical_values,
    }
