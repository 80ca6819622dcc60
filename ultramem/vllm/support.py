"""What the vLLM model class serves: every other checkpoint or engine setting is refused with one line, instead of
serving tokens that differ from Transformers'.

The check runs twice: in the main process while vLLM resolves its config (`UltraMemConfigHook`, registered by
`ultramem.vllm.register` in vLLM's per-architecture config hooks), so the refusal is the first error a user sees,
seconds after the start and before any engine process exists; and again when a worker builds the model, for
engines configured some other way.
"""

from __future__ import annotations

from typing import Any

from ultramem.ngram_memory import ngram_table_rows

# config field -> (its value when the feature is off, what it is, what to do instead)
UNSUPPORTED_FIELDS: dict[str, tuple[Any, str, str]] = {
    "memory_offload": (
        None,
        "value tables offloaded to host memory or disk",
        "serve the tables in memory (on vLLM's CPU backend they are in host memory already), shrink them with "
        "`python -m ultramem.quantize CKPT OUT --format int4`, or use Transformers' generate with memory_offload",
    ),
}


class UnsupportedByVllm(RuntimeError):
    """A checkpoint or engine setting the vLLM model class does not serve; the message names it and the way out.

    Not a ValueError: vLLM's config classes are pydantic dataclasses, which would rewrap a ValueError raised in their
    validation into a multi-line ValidationError whose first line does not say what is refused.
    """


def check_supported(vllm_config: Any) -> None:
    """Raise `UnsupportedByVllm` (one line) for an UltraMem variant or an engine setting not verified against
    Transformers' `generate`."""
    config = vllm_config.model_config.hf_config
    for field, (off, what, instead) in UNSUPPORTED_FIELDS.items():
        value = getattr(config, field, off)
        if value != off:
            raise UnsupportedByVllm(
                f"UltraMemConfig.{field}={value!r} ({what}) is not served by ultramem.vllm: {instead}."
            )
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise UnsupportedByVllm(
            f"pipeline_parallel_size={parallel.pipeline_parallel_size} is not supported by ultramem.vllm (a memory "
            "layer's output may be added blocks after it reads, across a stage boundary): use tensor_parallel_size."
        )
    _check_tensor_parallel(config, parallel.tensor_parallel_size)
    if config.ngram_layers and getattr(vllm_config.model_config, "enable_prompt_embeds", False):
        raise UnsupportedByVllm(
            f"enable_prompt_embeds=True is not supported by ultramem.vllm with UltraMemConfig.ngram_layers="
            f"{config.ngram_layers} (the n-gram memories hash the token ids): prompt with token ids or text."
        )
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise UnsupportedByVllm(
            "speculative decoding is not supported by ultramem.vllm (the conv states, the n-gram memories' token "
            "window included, are not rolled back for rejected draft tokens): remove speculative_config."
        )


def _check_tensor_parallel(config: Any, size: int) -> None:
    """Each rank holds an equal block of every value table's rows (n-gram tables included) and an equal share of the
    attention heads."""
    if size == 1:
        return
    # a shared pool holds every table; otherwise each memory layer holds its own
    field = "memory_num_values" if config.value_pool_size is None else "value_pool_size"
    rows = getattr(config, field)
    if config.memory_layers and rows % size:
        raise UnsupportedByVllm(
            f"tensor_parallel_size={size} does not divide UltraMemConfig.{field}={rows} (each rank holds an equal "
            f"block of the value rows): use a tensor_parallel_size dividing {rows}."
        )
    for idx, rows in enumerate(ngram_table_rows(config)):
        if rows % size:
            raise UnsupportedByVllm(
                f"tensor_parallel_size={size} does not divide the {rows} rows of n-gram memory {idx}'s table (the sum "
                f"of its hash heads' primes near UltraMemConfig.ngram_table_size={config.ngram_table_size} / "
                f"{(config.ngram_order - 1) * config.ngram_heads}; each rank holds an equal block of the rows): use a "
                f"tensor_parallel_size dividing {rows}."
            )
    if config.num_attention_heads % size:
        raise UnsupportedByVllm(
            f"tensor_parallel_size={size} does not divide num_attention_heads={config.num_attention_heads}: use a "
            f"tensor_parallel_size dividing it."
        )


def config_hook() -> type:
    """The class vLLM's `MODELS_CONFIG_MAP` takes for an architecture: its `verify_and_update_config(vllm_config)`
    runs in the main process, in `VllmConfig.__post_init__`, before the engine core is started."""
    from vllm.model_executor.models.config import VerifyAndUpdateConfig

    class UltraMemConfigHook(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_config(vllm_config: Any) -> None:
            check_supported(vllm_config)

    return UltraMemConfigHook
