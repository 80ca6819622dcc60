"""Where the model code meets Transformers beyond its classes: the cache's name across the supported releases,
continuous batching's limits, and the static causal-LM table the Trainer reads. Imported by `modeling_ultramem`,
which checks the release first.

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


class ContinuousBatchingCheck:
    """The causal LM's refusals of continuous batching, before Transformers builds its paged cache."""

    def init_continuous_batching(self, *args, **kwargs):
        """Continuous batching (`generate_batch`, `transformers serve`) works without query convs: every other part
        of a memory layer is per token. Its paged cache has no place for conv states, so it is refused with them,
        and before Transformers 5.24, whose paged cache travels under the name this model gives the generation cache."""
        if CACHE_FIELD != "cache":
            raise NotImplementedError(
                "Continuous batching of UltraMem needs Transformers >= 5.24: use model.generate(), which batches "
                "with left padding."
            )
        if self.config.memory_conv_state_slots:
            raise NotImplementedError(
                "Continuous batching (generate_batch, init_continuous_batching) has no cache for UltraMem's query-conv "
                "states (use_query_conv=True with query_conv_kernel_size > 1): use model.generate(), which batches "
                "with left padding."
            )
        return super().init_continuous_batching(*args, **kwargs)


# The Trainer's label smoothing shifts the labels only for models named in Transformers' static causal-LM table,
# which `AutoModelForCausalLM.register` (and `trust_remote_code` loading) leave as they are: without this entry
# it would train UltraMem to predict the current token. Here so that remote-code copies of the model code add it too.
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(UltraMemConfig.model_type, "UltraMemForCausalLM")
