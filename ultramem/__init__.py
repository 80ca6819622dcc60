"""UltraMem: Ultra-Sparse Memory Network (ICLR 2025) as a Hugging Face Transformers model.

Importing the package registers the config and models with the Auto classes.
"""

import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_ultramem import UltraMemConfig, UltraMemConfigError
from . import modeling_ultramem, offload  # offload registers the "cpu" and "disk" value stores
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
UltraMemConfig.register_for_auto_class()
UltraMemModel.register_for_auto_class("AutoModel")
UltraMemForCausalLM.register_for_auto_class("AutoModelForCausalLM")
for auto_class, head in TASK_HEADS.items():
    getattr(transformers, auto_class).register(UltraMemConfig, head, exist_ok=True)
    head.register_for_auto_class(auto_class)

__all__ = ["UltraMemCausalLMOutputWithPast", "UltraMemConfig", "UltraMemConfigError", *modeling_ultramem.__all__]
