"""Serving UltraMem with vLLM: a native model class, registered through vLLM's `vllm.general_plugins` entry point.

`pip install "ultramem[vllm]"` declares the entry point; vLLM then calls `register()` in every process it starts, and
`LLM(model=path)` or `python -m vllm.entrypoints.openai.api_server --model path` resolves the checkpoint's
`UltraMemForCausalLM` architecture to `ultramem.vllm.model.UltraMemForCausalLM` (see docs/serving.md).

Nothing here imports vLLM until vLLM calls `register()`, and the registry takes the class by its import string, so the
model module is imported only in the processes that build the model.
"""

from __future__ import annotations

ARCHITECTURE = "UltraMemForCausalLM"
MODEL_MODULE, MODEL_CLASS = "ultramem.vllm.model", "UltraMemForCausalLM"


def register() -> None:
    """Register the model class with vLLM's `ModelRegistry`, and `support.check_supported` as the architecture's
    config hook (so a refusal is raised in the main process, before the engine starts); idempotent (vLLM calls
    plugins in every process).

    Importing `ultramem` registers `UltraMemConfig` with `AutoConfig`, so a checkpoint's config loads without
    `trust_remote_code`.
    """
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    import ultramem  # noqa: F401  (registers the config with AutoConfig)

    from .support import config_hook

    current = ModelRegistry.models.get(ARCHITECTURE)
    if (getattr(current, "module_name", None), getattr(current, "class_name", None)) != (MODEL_MODULE, MODEL_CLASS):
        ModelRegistry.register_model(ARCHITECTURE, f"{MODEL_MODULE}:{MODEL_CLASS}")
    if ARCHITECTURE not in MODELS_CONFIG_MAP:
        MODELS_CONFIG_MAP[ARCHITECTURE] = config_hook()
