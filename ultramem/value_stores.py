"""Where a memory layer's value table lives: one interface, one registry, one way to choose at load and after.

A value store is a module whose forward is the lookup-reduce of the selected rows:
`store(rows, groups, scores, num_groups, ops) -> (T, E, Dv)`, `ops` being the model's `MemoryOps` (how to compute,
a separate axis: `memory_implementations`), and whose `lookup_dot(rows, query, ops) -> (T, K)` is the inner product
of each selected row with its token's query (PEER's gate, read from a pre-value table). Where the rows live is the store's business: this device (`"local"`,
`MemoryValueTable`, the default), host memory or a memory-mapped file (`"cpu"`, `"disk"`, `ultramem.offload`), shards
on other ranks (`"number"`, `"dimension"`, `ultramem.parallel`). Stores register in `VALUE_STORES` as attention
functions do in Transformers' `AttentionInterface`; `import ultramem` registers all of the package's.

Every table of a model is a store of the same kind: each memory layer's `values` and `pre_values`, or the
model's `value_pool` and `pre_value_pool` shared by all memory layers, and each n-gram memory's `values`
(`get_value_table_names` lists them). An n-gram memory reads its rows as they are, through the same lookup-reduce
(each row a token of its own with one slot weighted 1), so every store serves it.

Choosing a store:
- at load: `from_pretrained(path, memory_offload="cpu" | "disk")` (the tables are never loaded whole: they are left
  out of the load, see `DeferredValueTable`, and the store reads the checkpoint);
- on a model: `model.set_value_store(name, **options)`.

A store may also offer `lookup_reduce_async(...)` (same arguments) returning an object whose `result()` is the pooled
tensor: the memory layer then starts the read at its read block and collects it after its write block.

This file is copied beside `modeling_ultramem.py` into checkpoints (remote code); such a copy finds the package's
stores when the `ultramem` package is installed.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any, Protocol

import torch
from torch import nn
from transformers import initialization as init
from transformers.utils import logging
from transformers.utils.generic import GeneralInterface

from .configuration_ultramem import MEMORY_OFFLOADS, UltraMemConfigError
from .package_registry import package_registry

logger = logging.get_logger(__name__)


class MemoryValueTable(nn.Embedding):
    """The physical value table V (N, Dv) of one memory layer, whole on this process's device: the "local" store.

    An `nn.Embedding` so that Accelerate's `device_map`, PEFT's `modules_to_save` and the Trainer treat it as the
    embedding table it is; its forward is the store's lookup-reduce, not an embedding.
    """

    def __init__(self, num_values: int, value_dim: int, init_std: float):
        super().__init__(num_values, value_dim)
        self.init_std = init_std

    def init_ultramem(self) -> None:
        init.normal_(self.weight, std=self.init_std)

    @classmethod
    def from_table(cls, table: nn.Module, name: str, **options: Any) -> nn.Module:
        if options:
            raise TypeError(f"the local value store takes no options, got {sorted(options)}")
        return table

    def forward(
        self, rows: torch.Tensor, groups: torch.Tensor, scores: torch.Tensor, num_groups: int, ops
    ) -> torch.Tensor:
        """rows, groups (T, K), scores (T, K, h) -> (T, E, Dv): see `memory_ops.lookup_reduce`."""
        return ops.lookup_reduce(self.weight, rows, groups, scores, num_groups)

    def lookup_dot(self, rows: torch.Tensor, query: torch.Tensor, ops) -> torch.Tensor:
        """rows (T, K), query (T, Dp) -> (T, K): see `memory_ops.lookup_dot`."""
        return ops.lookup_dot(self.weight, rows, query)


class ValueStore(Protocol):
    """What a registered store class provides, besides the module's `forward` (lookup-reduce) and `lookup_dot`.

    `from_table` builds the store from a layer's `MemoryValueTable` or `DeferredValueTable` (`name` is the weight's
    state-dict key, e.g. to find it in a checkpoint). A store that reads a checkpoint at load defines
    `find_checkpoint(path, **from_pretrained_kwargs)`, called before anything else is loaded.
    """

    @classmethod
    def from_table(cls, table: nn.Module, name: str, **options: Any) -> nn.Module: ...


class ValueStores(GeneralInterface):
    """Name -> store class (`ValueStore`)."""

    _global_mapping = {"local": MemoryValueTable}


VALUE_STORES = ValueStores()


class TableFormats(GeneralInterface):
    """Storage format of the value tables (e.g. "int8", registered by `ultramem.quantized`) -> the loader that
    `from_pretrained` hands over to when a format is set: `loader(model_class, path, *args, **kwargs)`."""

    _global_mapping = {}


def table_format_loader(name: str):
    """The registered loader of table format `name` (the package's registry for a remote-code copy)."""
    formats = TableFormats()
    if name in formats:
        return formats[name]
    package = package_registry(formats)
    if package is None:
        raise ImportError(f"memory_quantization={name!r} needs the `ultramem` package installed (pip install ultramem)")
    if name not in package:
        raise ValueError(f"memory_quantization={name!r} is not a registered table format: {sorted(package)}")
    return package[name]


def value_store(name: str) -> type[ValueStore]:
    """The registered store class `name`, or one line naming the registered ones."""
    if name in VALUE_STORES:
        return VALUE_STORES[name]
    package = package_registry(VALUE_STORES)
    if package is not None and name in package:
        return package[name]
    if package is None and ValueStores._global_mapping.keys() == {"local"}:
        raise ImportError(f"value store {name!r} needs the `ultramem` package installed (pip install ultramem)")
    raise ValueError(
        f"value store {name!r} is not registered; choose one of {sorted({*VALUE_STORES, *(package or ())})}"
    )


class DeferredValueTable(nn.Module):
    """Stands for a table that a value store attaches after construction (no parameter).

    Having no `weight`, the loader never reads the checkpoint's table into memory nor initializes one; the store reads
    or initializes (with `init_std`) only what it keeps.
    """

    def __init__(self, num_values: int, value_dim: int, init_std: float):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.init_std = num_values, value_dim, init_std

    def forward(self, *args, **kwargs) -> torch.Tensor:
        raise RuntimeError(_NOT_ATTACHED)

    def lookup_dot(self, *args, **kwargs) -> torch.Tensor:
        raise RuntimeError(_NOT_ATTACHED)


_NOT_ATTACHED = (
    "a value store attaches the value tables in from_pretrained(path, memory_offload=...), or in "
    "set_value_store('number' | 'dimension') after deferred_value_tables(); this model has none. Build it "
    "with memory_offload=None and call model.set_value_store('cpu') to offload an in-memory model."
)


_tables_deferred: ContextVar[bool] = ContextVar("tables_deferred", default=False)


@contextmanager
def deferred_value_tables() -> Iterator[None]:
    """Models built (or loaded) inside get `DeferredValueTable`s, so no process ever holds a whole table before
    `set_value_store` installs a store that allocates or reads only its part (memory parallelism)."""
    token = _tables_deferred.set(True)
    try:
        yield
    finally:
        _tables_deferred.reset(token)


def tables_deferred(config) -> bool:
    """Inside `deferred_value_tables()`, or for a config loaded with `memory_offload` (its store reads the tables)."""
    return _tables_deferred.get() or bool(getattr(config, "memory_offload", None))


def offloaded_by_accelerate(module: nn.Module) -> bool:
    """Whether Accelerate offloads the module (`device_map` "disk", or "cpu" beside an accelerator): its hooks
    load the weights for each of its forwards and leave meta tensors otherwise."""
    return getattr(getattr(module, "_hf_hook", None), "offload", False)


def offloaded_weights_loaded(modules: list[nn.Module]) -> AbstractContextManager:
    """Loads the weights of those `modules` that are `offloaded_by_accelerate`, for a read outside their forward
    (a no-op context otherwise, which torch.compile traces)."""
    offloaded = [module for module in modules if offloaded_by_accelerate(module)]
    return _weights_loaded(offloaded) if offloaded else nullcontext()


@contextmanager
def _weights_loaded(modules: list[nn.Module]) -> Iterator[None]:
    from accelerate.utils import align_module_device

    with ExitStack() as loaded:
        for module in modules:
            loaded.enter_context(align_module_device(module))
        yield


def _saved_quantization(path, kwargs: dict) -> str | None:
    """`memory_quantization` in the checkpoint's config.json (a model class's `from_pretrained` called without a
    config reads the format there: a quantized checkpoint loads as what it is)."""
    from transformers import PretrainedConfig

    hub = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "subfolder", "local_files_only") if k in kwargs}
    try:
        saved, _ = PretrainedConfig.get_config_dict(str(path), **hub)
    except OSError:
        return None  # no config.json: Transformers' own loading says so
    return saved.get("memory_quantization")


# The value tables' module names, the one place they are spelled: a memory layer's own, the pools the model owns for
# all its memory layers, which of them are PEER pre-value tables (width Dp), and each n-gram memory's table (Engram,
# `ngram_memory`: rows read as they are, never pooled)
LAYER_TABLES = ("values", "pre_values")
POOL_TABLES = ("value_pool", "pre_value_pool")
PRE_VALUE_TABLES = ("pre_values", "pre_value_pool")
NGRAM_TABLES = ("values",)
# regular expressions of their module names (the layer pattern covers the n-gram memories' tables too)
NGRAM_TABLE_PATTERN = rf"ngram_memories\.\d+\.(?:{'|'.join(NGRAM_TABLES)})"
LAYER_TABLE_PATTERN = rf"(?:memory_layers\.\d+\.(?:{'|'.join(LAYER_TABLES)})|{NGRAM_TABLE_PATTERN})"
POOL_TABLE_PATTERN = rf"(?:{'|'.join(POOL_TABLES)})"


def shared_by_layers(name: str) -> bool:
    """Whether the table with state-dict key `name` is a value pool that every memory layer reads a window of."""
    return name.removesuffix(".weight").rpartition(".")[2] in POOL_TABLES


def is_ngram_table(name: str) -> bool:
    """Whether the table with state-dict key or module name `name` is an n-gram memory's (rows of `ngram_head_dim`,
    read as they are: `NGramMemory.read`)."""
    return re.search(rf"(?:^|\.){NGRAM_TABLE_PATTERN}(?:\.weight)?$", name) is not None


def is_pre_value_table(name: str) -> bool:
    """Whether the table with state-dict key `name` is a pre-value table (read by `lookup_dot`, width Dp)."""
    return name.removesuffix(".weight").rpartition(".")[2] in PRE_VALUE_TABLES


def value_tables(model: nn.Module) -> dict[str, nn.Module]:
    """State-dict key of each value table (`model.get_value_table_names()`) -> the module serving it."""
    return {name: model.get_submodule(name.removesuffix(".weight")) for name in model.get_value_table_names()}


# Module names of the value tables (per memory layer, pre-value tables and shared pools included), as the
# `modules_to_not_convert` patterns of Transformers' quantizers
VALUE_TABLE_MODULES = rf".*{LAYER_TABLE_PATTERN}|.*{POOL_TABLE_PATTERN}"


def leave_value_tables_alone(quantization_config: Any) -> Any:
    """The backbone's quantization config (torchao, bitsandbytes, ...) with the value tables kept out of it.

    Quantizers replace `nn.Linear` weights; torchao's `include_input_output_embeddings=True` also lets a
    `FqnToConfig`'s default reach every `nn.Embedding`, which a float value table is. Its tensor subclasses would
    dequantize a whole table per lookup: the tables' own format is `memory_quantization`. With that flag the
    quantizer's default skips are the input/output embeddings it removes again, so the tables' pattern replaces
    nothing. Returns a copy; other configs unchanged.
    """
    if not getattr(quantization_config, "include_input_output_embeddings", False):
        return quantization_config
    quantization_config = copy.copy(quantization_config)
    skipped = quantization_config.modules_to_not_convert or []
    quantization_config.modules_to_not_convert = [*skipped, VALUE_TABLE_MODULES]
    return quantization_config


class ValueStoreMixin:
    """The `PreTrainedModel` side of value stores: `set_value_store`, and `memory_offload=` in `from_pretrained`."""

    def set_value_store(self, store: str, **options: Any) -> None:
        """Put every value table (values, pre-values, pools, n-gram tables: `get_value_table_names`) in the registered
        store `store`.

        Parameter names do not change (`...values.weight`), so optimizer groups and checkpoints keep their keys. The
        stores take the model's train/eval mode.
        """
        store_class = value_store(store)
        if getattr(store_class, "needs_config", False):  # e.g. the quantized stores' MCS chunk and group size
            options.setdefault("config", self.config)
        for name, table in value_tables(self).items():
            module_name = name.removesuffix(".weight")
            if not isinstance(table, (MemoryValueTable, DeferredValueTable)):
                raise ValueError(f"{module_name} is already a {type(table).__name__} store")
            parent, _, attribute = module_name.rpartition(".")
            served = store_class.from_table(table, name, **options)
            served.train(self.training)
            setattr(self.get_submodule(parent), attribute, served)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, plus two loading settings that are never saved:

        - `memory_offload="cpu" | "disk"`: the value tables are left out of the load and served by that store, read
          from the checkpoint's safetensors (checked before anything loads); everything else goes where
          `device_map` / `dtype` say;
        - `memory_implementation=...`: how the memory layers compute (see `memory_implementations`).

        Returns what `PreTrainedModel.from_pretrained` returns (`(model, info)` with `output_loading_info=True`).
        """
        # Auto classes hand these to the config first (it takes them as load-time keywords)
        config = kwargs.get("config")
        offload = kwargs.pop("memory_offload", None) or getattr(config, "memory_offload", None)
        implementation = kwargs.pop("memory_implementation", None)
        if "quantization_config" in kwargs:  # the backbone's: the value tables stay as they are
            kwargs["quantization_config"] = leave_value_tables_alone(kwargs["quantization_config"])
        quantization = kwargs.pop("memory_quantization", None) or getattr(config, "memory_quantization", None)
        group_size = kwargs.pop("memory_quantization_group_size", None)
        if offload not in MEMORY_OFFLOADS:
            raise UltraMemConfigError(
                f"UltraMemConfig.memory_offload={offload!r} is invalid: must be one of {MEMORY_OFFLOADS}."
            )
        if quantization is None and config is None:
            quantization = _saved_quantization(pretrained_model_name_or_path, kwargs)
        if quantization is not None:  # quantized tables: their format's loader (checked there first) places them too
            loaded = table_format_loader(quantization)(
                cls,
                pretrained_model_name_or_path,
                *args,
                memory_quantization=quantization,
                memory_quantization_group_size=group_size,
                memory_offload=offload,
                **kwargs,
            )
        elif offload:
            try:
                store = value_store(offload)
            except ImportError as error:
                raise ImportError(
                    f"memory_offload={offload!r} needs the `ultramem` package installed (pip install ultramem); "
                    "without it load with memory_offload=None."
                ) from error
            checkpoint = store.find_checkpoint(pretrained_model_name_or_path, **kwargs)
            with deferred_value_tables():
                loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        else:
            loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        if implementation is not None:
            model.set_memory_implementation(implementation)
        if offload and quantization is None:
            model.set_value_store(offload, checkpoint=checkpoint, device=model.device, dtype=model.dtype)
        elif not offload and any(offloaded_by_accelerate(table) for table in value_tables(model).values()):
            logger.warning(
                "device_map offloads UltraMem value tables: Accelerate loads each of them whole at every "
                "forward. from_pretrained(..., memory_offload='cpu' | 'disk') reads only the selected rows."
            )
        return loaded
