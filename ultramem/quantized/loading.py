"""Loading a model with quantized value tables: the format from the checkpoint's config or given once, the location
from `memory_offload`, checked against the checkpoint's tables before anything else loads."""

from __future__ import annotations

import sys
from contextlib import ExitStack
from types import ModuleType
from typing import Any

from .. import value_stores
from ..value_stores import ValueStoreMixin
from .format import QuantizationError, check_format
from .stores import (
    QUANTIZED_STORES,
    QuantizedCheckpoint,
    check_quantizable,
    model_group_size,
    saved_quantization,
    store_name,
)


def from_pretrained_quantized(
    model_class: type,
    pretrained_model_name_or_path: Any,
    *args: Any,
    memory_quantization: str | None = None,
    memory_quantization_group_size: int | None = None,
    memory_offload: str | None = None,
    **kwargs: Any,
):
    """`model_class.from_pretrained` with the value tables in a quantized store.

    - `memory_quantization`: "int8" | "int4"; None takes the checkpoint's (its config.json records the format of a
      converted checkpoint, so it loads as what it is). Given on a float checkpoint, the tables are quantized while
      loading, row block by row block from the mapped file (peak memory: the quantized tables and one block).
    - `memory_quantization_group_size`: int4's group (default: the saved one, else `format.DEFAULT_INT4_GROUP_SIZE`).
    - `memory_offload`: None (the table on the model's device), "cpu" (host memory) or "disk" (mapped; needs a
      converted checkpoint).

    The model's config then records the format, so `save_pretrained` writes a quantized checkpoint. Loaded inside
    `deferred_value_tables()` (and without `memory_offload`), the tables stay deferred for
    `ultramem.parallel.apply_memory_parallel(model, ..., checkpoint=path)`, which reads each rank's part only.
    Returns what `from_pretrained` returns.
    """
    config = kwargs.get("config")
    saved_format, saved_group = saved_quantization(pretrained_model_name_or_path)
    format = memory_quantization or getattr(config, "memory_quantization", None) or saved_format
    check_format(format)
    if format is None:
        raise QuantizationError(
            "from_pretrained_quantized needs memory_quantization='int8' or 'int4' for a checkpoint of float tables"
        )
    if saved_format is not None and format != saved_format:
        raise QuantizationError(
            f"the checkpoint holds {saved_format} tables: load it with memory_quantization={saved_format!r} (or "
            "None); re-quantizing quantized tables would add the errors of both"
        )
    if config is None:
        hub = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "subfolder", "local_files_only") if k in kwargs}
        config = model_class.config_class.from_pretrained(pretrained_model_name_or_path, **hub)
    check_quantizable(config, format)
    configured = getattr(config, "memory_quantization_group_size", None)  # an Auto class hands the keyword over
    group_size = memory_quantization_group_size or configured or (saved_group if saved_format == format else None)
    if saved_format is not None and saved_group is not None and group_size != saved_group:
        raise QuantizationError(
            f"the checkpoint's {format} tables have group size {saved_group}, not {group_size}: leave "
            "memory_quantization_group_size unset"
        )
    group_size = model_group_size(format, config, group_size)
    name = store_name(memory_offload, format)
    checkpoint = QUANTIZED_STORES[name].find_checkpoint(pretrained_model_name_or_path, **kwargs)
    checkpoint.check_tables(format, group_size, config, memory_offload)
    # the mixin model_class derives from: a checkpoint's remote-code copy (trust_remote_code=True) has its own
    mixin = next(base for base in model_class.__mro__ if base.__name__ == ValueStoreMixin.__name__)
    modules = _value_store_modules(mixin)
    with ExitStack() as deferred:  # the tables are left out of the load: the store reads them
        for module in modules:
            deferred.enter_context(module.deferred_value_tables())
        loaded = super(mixin, model_class).from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    model.config.memory_quantization, model.config.memory_quantization_group_size = format, group_size
    if memory_offload is None and any(module.tables_deferred(None) for module in modules):  # (only the context)
        return loaded  # inside deferred_value_tables(): memory parallelism reads each rank's part of the tables
    model.set_value_store(name, config=model.config, checkpoint=checkpoint, device=model.device, dtype=model.dtype)
    return loaded


def _value_store_modules(mixin: type) -> list[ModuleType]:
    """This package's `value_stores`, and the copy `mixin` comes from when it is a checkpoint's remote code: the
    model's tables are deferred by the copy's own context (a separate `ContextVar`), so both are entered (without
    the copy's, a converted checkpoint's uint8 tables met float ones: a size mismatch)."""
    copy = sys.modules[mixin.__module__]
    return [value_stores] if copy is value_stores else [value_stores, copy]


__all__ = ["QuantizedCheckpoint", "from_pretrained_quantized"]
