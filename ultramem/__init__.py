"""UltraMem: Ultra-Sparse Memory Network (ICLR 2025) as a Hugging Face Transformers model.

Importing the package registers the config and models with the Auto classes, every value store (`value_stores`:
"local", "cpu", "disk", "number", "dimension"; `quantized`: "int8", "int4", "cpu-int8", "cpu-int4", "disk-int8",
"disk-int4") and every memory implementation (`memory_implementations`: "torch", "embedding_bag", "triton", "cpp").
"""

import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from . import cpp_kernels, kernels, offload, parallel, quantized  # noqa: F401  (they register their kernels and value stores)
from .configuration_ultramem import UltraMemConfig, UltraMemConfigError
from .missing_tokenizer import MissingTokenizer
from .modeling_ultramem import (
    TASK_HEADS,
    UltraMemCausalLMOutputWithPast,
    UltraMemForCausalLM,
    UltraMemForQuestionAnswering,
    UltraMemForSequenceClassification,
    UltraMemForTokenClassification,
    UltraMemModel,
    UltraMemPreTrainedModel,
)

AutoConfig.register(UltraMemConfig.model_type, UltraMemConfig, exist_ok=True)
AutoModel.register(UltraMemConfig, UltraMemModel, exist_ok=True)
AutoModelForCausalLM.register(UltraMemConfig, UltraMemForCausalLM, exist_ok=True)
AutoTokenizer.register(
    UltraMemConfig, MissingTokenizer, exist_ok=True
)  # a folder without tokenizer: one line naming the fix
UltraMemConfig.register_for_auto_class()
UltraMemModel.register_for_auto_class("AutoModel")
UltraMemForCausalLM.register_for_auto_class("AutoModelForCausalLM")
for auto_class, head in TASK_HEADS.items():
    getattr(transformers, auto_class).register(UltraMemConfig, head, exist_ok=True)
    head.register_for_auto_class(auto_class)

__all__ = [
    "UltraMemCausalLMOutputWithPast",
    "UltraMemConfig",
    "UltraMemConfigError",
    "UltraMemForCausalLM",
    "UltraMemForQuestionAnswering",
    "UltraMemForSequenceClassification",
    "UltraMemForTokenClassification",
    "UltraMemModel",
    "UltraMemPreTrainedModel",
]
