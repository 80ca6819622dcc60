"""Where the model code meets Transformers beyond its classes: the cache's name across the supported releases, and
the static causal-LM table the Trainer reads. Imported by `modeling_ultramem`, which checks the release first.

This file is copied beside `modeling_ultramem.py` into checkpoints (remote code), so it imports only relatively.
"""

from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils.deprecation import deprecate_kwarg

from .configuration_ultramem import UltraMemConfig

# Transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache`. The model uses `cache`;
# on 5.17-5.23, whose `generate` passes and reads `past_key_values`, the old name is taken silently (there it is the
# current name) and outputs carry the field those releases define.
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
accepts_past_key_values = deprecate_kwarg(
    "past_key_values", "5.40.0" if CACHE_FIELD == "cache" else "5.0.0", new_name="cache"
)

# The Trainer's label smoothing shifts the labels only for models named in Transformers' static causal-LM table,
# which `AutoModelForCausalLM.register` (and `trust_remote_code` loading) leave as they are: without this entry
# it would train UltraMem to predict the current token. Here so that remote-code copies of the model code add it too.
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(UltraMemConfig.model_type, "UltraMemForCausalLM")
