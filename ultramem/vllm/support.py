"""What the vLLM model class serves: every other checkpoint or engine setting is refused with one line, before weights
load, instead of serving tokens that differ from Transformers'."""

from __future__ import annotations

from typing import Any

# config field -> (its value when the variant is off, what it is): variants the vLLM class does not implement yet
UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    "value_gate": ("none", "gated values (UltraMemV2's PEER gate, Memory+'s SwiLU)"),
    "ive_single_projector": (False, "UltraMemV2's single IVE projector"),
    "value_pool_size": (None, "a value pool shared by the memory layers"),
    "memory_site": ("block", "memory layers at an MLP site"),
    "memory_quantization": (None, "quantized value tables"),
    "memory_offload": (None, "offloaded value tables"),
}


class UnsupportedByVllm(ValueError):
    """A checkpoint or engine setting the vLLM model class does not serve; the message names it and the way out."""


def check_supported(vllm_config) -> None:
    """Raise `UnsupportedByVllm` (one line) for an UltraMem variant or an engine setting not verified against
    Transformers' `generate`."""
    config = vllm_config.model_config.hf_config
    for field, (off, what) in UNSUPPORTED_FIELDS.items():
        value = getattr(config, field, off)
        if value != off:
            raise UnsupportedByVllm(
                f"UltraMemConfig.{field}={value!r} ({what}) is not served by ultramem.vllm yet (only {field}={off!r}); "
                "use Transformers' generate."
            )
    parallel = vllm_config.parallel_config
    for setting, size in (
        ("tensor_parallel_size", parallel.tensor_parallel_size),
        ("pipeline_parallel_size", parallel.pipeline_parallel_size),
    ):
        if size > 1:
            raise UnsupportedByVllm(
                f"{setting}={size} is not supported by ultramem.vllm (the value tables do not shard yet): use 1."
            )
    if vllm_config.speculative_config is not None:
        raise UnsupportedByVllm(
            "speculative decoding is not supported by ultramem.vllm (the query-conv states are not rolled back for "
            "rejected draft tokens): remove speculative_config."
        )
