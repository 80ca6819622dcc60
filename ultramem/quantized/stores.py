"""Value stores over quantized tables: one per location, each parameterised by the format.

- `QuantizedValueTable`: the uint8 table as a buffer of the model (moves with `model.to`), the quantized "local";
- `QuantizedHostValueStore`: in host memory, like memory_offload="cpu";
- `QuantizedDiskValueStore`: memory-mapped from a quantized checkpoint, like memory_offload="disk".

They are registered as "int8", "int4", "cpu-int8", "cpu-int4", "disk-int8", "disk-int4" (`store_name(offload,
format)`): `model.set_value_store("int8", config=model.config)` quantizes an in-memory model's tables, and loading
goes through `from_pretrained_quantized` (the format comes from the checkpoint's config, or is given once as
`memory_quantization=`; the location is `memory_offload` as for float tables). Every store reads a quantized
checkpoint's uint8 table as it is, or quantizes a float one row block by row block ("disk" excepted: a mapping
cannot be quantized in place, convert the checkpoint with `python -m ultramem.quantize`).

The format applies to every memory layer's value table and every n-gram memory's (`TABLE_KEY`). An n-gram table's
rows (`ngram_head_dim`) are one chunk; they take the model's group size where it divides them, else the format's
default for them (`table_group_size`), and are read as they are through the same lookup.

The tables are frozen: training through these stores updates every other weight (scores and queries get their
gradients through `ultramem::quantized_bag_sum`'s autograd) and says so once.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.utils import logging

from ..offload.safetensors_file import (
    OffloadCheckpointError,
    SafetensorsCheckpoint,
    TensorLocation,
    advise_will_need,
    read_header,
)
from ..offload.stores import DiskValueStore, HostValueStore
from ..value_stores import is_ngram_table, is_pre_value_table, shared_by_layers
from .format import FORMATS, QuantizationError, check_format, quantize, quantized_width, resolve_group_size
from .ops import lookup_reduce_quantized

logger = logging.get_logger(__name__)

# the tables a format applies to: each memory layer's value table and each n-gram memory's
TABLE_KEY = re.compile(r"(^|\.)(?:memory_layers|ngram_memories)\.\d+\.values\.weight$")
METADATA_FORMAT, METADATA_GROUP = "ultramem_quantization", "ultramem_quantization_group_size"
FROZEN_WARNING = (
    "Quantized value tables are frozen: training updates every other weight (scores and queries get their "
    "gradients) but not the tables. Load without memory_quantization to train them."
)


def _field(config: Any, name: str) -> Any:
    """A config field, from an `UltraMemConfig` or a config.json dict (the converter's)."""
    return config.get(name) if isinstance(config, dict) else getattr(config, name)


def table_geometry(config: Any, name: str) -> tuple[int, int]:
    """(value dim, MCS chunks) of the table `name`: a memory layer's rows are pooled chunk by chunk with its cores'
    scores; an n-gram memory's rows (`ngram_head_dim`) are read as they are, one chunk."""
    if is_ngram_table(name):
        return _field(config, "ngram_head_dim"), 1
    return _field(config, "memory_value_dim"), _field(config, "mcs_cores")


def model_group_size(format: str, config: Any, group_size: int | None = None) -> int:
    """The group size a quantized model's config records (`memory_quantization_group_size`): `group_size` checked, or
    the format's default, for its memory layers' tables, or for its n-gram tables when it has no memory layers."""
    table = "memory_layers.0.values" if _field(config, "memory_layers") else "ngram_memories.0.values"
    return resolve_group_size(format, *table_geometry(config, table), group_size)


def table_group_size(format: str, config: Any, name: str, group_size: int | None = None) -> int:
    """The group size of table `name` in a model whose group size is `group_size`: that one, except for an n-gram
    table whose rows it does not divide, which takes the format's default for its rows (int8: the row; int4: 64
    columns where they divide the row, else the row)."""
    value_dim, num_cores = table_geometry(config, name)
    if group_size is not None and is_ngram_table(name) and value_dim % group_size:
        group_size = None
    return resolve_group_size(format, value_dim, num_cores, group_size)


def check_quantizable(config: Any, format: str | None, name: str = "") -> None:
    """One line when the model has tables no quantized store serves: PEER pre-value tables (read by dots) and a value
    pool shared by the memory layers (the config refuses both with memory_quantization)."""
    gate, pool = str(getattr(config, "value_gate", "none")), getattr(config, "value_pool_size", None)
    if gate.startswith("peer") or is_pre_value_table(name):
        tables = f"the pre-value tables of value_gate={gate!r}" if gate.startswith("peer") else name
    elif pool or shared_by_layers(name):
        tables = f"a value pool shared by the memory layers (value_pool_size={pool})" if pool else name
    else:
        return
    raise QuantizationError(
        f"memory_quantization={format!r} covers each memory layer's value table, not {tables}: use "
        "memory_quantization=None for this model (float tables; memory_offload still applies)"
    )


class QuantizedCheckpoint(SafetensorsCheckpoint):
    """`SafetensorsCheckpoint` that also locates uint8 tensors (the quantized tables) and reads each file's metadata."""

    def __init__(self, files: list[Path]):
        super().__init__(files)
        self.metadata: dict[Path, dict[str, str]] = {}
        for path in files:
            header, data_start = read_header(path)
            self.metadata[path] = header.get("__metadata__") or {}
            for name, entry in header.items():
                if name != "__metadata__" and entry["dtype"] == "U8":
                    offset = data_start + entry["data_offsets"][0]
                    self.locations[name] = TensorLocation(path, torch.uint8, tuple(entry["shape"]), offset)

    def table_names(self) -> list[str]:
        return sorted(name for name in self.locations if TABLE_KEY.search(name))

    def check_tables(self, format: str | None, group_size: int | None, config: Any, offload: str | None) -> None:
        """One line before any loading when the tables do not hold what `format` says (`group_size`: the model's)."""
        for name in self.table_names():
            location = self.locations[name]
            quantized = location.dtype == torch.uint8
            if format is None and quantized:
                raise QuantizationError(
                    f"{name} is a quantized (uint8) table but the config has no memory_quantization: load it with "
                    "memory_quantization='int8' or 'int4' (the format it was converted to)"
                )
            if format is None:
                continue
            if not quantized and offload == "disk":
                raise QuantizationError(
                    f"{name} is a {location.dtype} table: memory_offload='disk' maps the file as it is, so it needs "
                    f"a quantized checkpoint: python -m ultramem.quantize CHECKPOINT OUT --format {format}"
                )
            saved = self.metadata[location.path].get(METADATA_FORMAT)
            if quantized and saved is not None and saved != format:
                raise QuantizationError(
                    f"{name} holds {saved} tables, not {format}: load with memory_quantization={saved!r}"
                )
            value_dim, group = table_geometry(config, name)[0], table_group_size(format, config, name, group_size)
            width = quantized_width(format, value_dim, group)
            if quantized and location.shape[1] != width:
                raise QuantizationError(
                    f"{name} is {location.shape}, a {format} table of value dim {value_dim} with group size "
                    f"{group} has {width} bytes a row: the checkpoint's format or group size differs from the "
                    "config's"
                )


def _quantized_table(
    table: nn.Module, name: str, format: str, num_cores: int, group_size: int, checkpoint: SafetensorsCheckpoint | None
) -> torch.Tensor:
    """The checkpoint's quantized table as it is (read into memory), or its float table (or `table`'s weight)
    quantized row block by row block."""
    value_dim = table.embedding_dim
    width = quantized_width(format, value_dim, group_size)
    if checkpoint is None:
        if not hasattr(table, "weight"):
            raise QuantizationError(
                f"{name} has no table to quantize: load with from_pretrained(path, memory_quantization=...)"
            )
        source = table.weight.detach()
        if source.dtype == torch.uint8:
            raise QuantizationError(f"{name} is already quantized")
        return quantize(source, format, num_cores, group_size)
    location = checkpoint.locate(name)
    if location.dtype == torch.uint8:
        if location.shape != (table.num_embeddings, width):
            raise QuantizationError(
                f"{name} is {location.shape} in the checkpoint; {format} with group size {group_size} needs "
                f"{(table.num_embeddings, width)}"
            )
        return checkpoint.read(name)
    if location.shape != (table.num_embeddings, value_dim):
        raise OffloadCheckpointError(
            f"{name} is {location.shape} in the checkpoint, the config needs {(table.num_embeddings, value_dim)}"
        )
    return quantize(checkpoint.map(name), format, num_cores, group_size)


class QuantizedStoreMixin:
    """Format, group size and the lookup shared by the quantized stores. `format` is set on the registered
    subclasses (`bound`); `from_table` takes the model's config (or `num_cores`) for the MCS chunk."""

    format: str | None = None
    needs_config = True  # `set_value_store` passes the model's config (with the integration in value_stores)
    group_size: int
    value_dim: int

    @classmethod
    def bound(cls, format: str) -> type:
        """This store with its format fixed (the registered "int8", "cpu-int4", ... classes)."""
        return type(f"{cls.__name__}{format.capitalize()}", (cls,), {"format": format, "__module__": cls.__module__})

    @classmethod
    def _settings(
        cls,
        table: nn.Module,
        name: str,
        config: Any,
        num_cores: int | None,
        group_size: int | None,
        format: str | None,
    ) -> tuple[str, int, int]:
        format = format or cls.format
        check_format(format)
        check_quantizable(config, format, name)
        if format is None:
            raise QuantizationError(f"{cls.__name__} needs format='int8' or 'int4'")
        if num_cores is None and config is None:
            raise QuantizationError(
                "a quantized value store needs the MCS core count for its groups: pass config=model.config "
                "(or num_cores=...) to set_value_store"
            )
        if config is None:
            return format, num_cores, resolve_group_size(format, table.embedding_dim, num_cores, group_size)
        num_cores = 1 if is_ngram_table(name) else num_cores or config.mcs_cores  # n-gram rows: one chunk
        if group_size is None and getattr(config, "memory_quantization", None) == format:
            group_size = getattr(config, "memory_quantization_group_size", None)
        model_group = model_group_size(format, config, group_size)
        group_size = table_group_size(format, config, name, model_group)
        # the model now holds quantized tables: its config (and so save_pretrained) says so
        config.memory_quantization, config.memory_quantization_group_size = format, model_group
        return format, num_cores, group_size

    @staticmethod
    def find_checkpoint(path: Any, **from_pretrained_kwargs: Any) -> QuantizedCheckpoint:
        return QuantizedCheckpoint.find(path, **from_pretrained_kwargs)

    def _warn_if_training(self) -> None:
        if self.training and torch.is_grad_enabled():
            logger.warning_once(FROZEN_WARNING)

    def _lookup(self, table: torch.Tensor, rows, groups, scores, num_groups) -> torch.Tensor:
        return lookup_reduce_quantized(table, rows, groups, scores, num_groups, self.format, self.group_size)


class QuantizedValueTable(QuantizedStoreMixin, nn.Module):
    """The quantized table on the model's device: a uint8 buffer `weight` (saved under the table's key, so
    `save_pretrained` writes a quantized checkpoint), no parameter, not an `nn.Embedding` (PEFT and torchao's
    embedding quantization leave it alone)."""

    def __init__(self, weight: torch.Tensor, format: str, group_size: int, value_dim: int):
        super().__init__()
        self.format, self.group_size, self.value_dim = format, group_size, value_dim
        self.register_buffer("weight", weight)

    @property
    def num_embeddings(self) -> int:
        return self.weight.shape[0]

    @property
    def embedding_dim(self) -> int:
        return self.value_dim

    @classmethod
    def from_table(
        cls,
        table: nn.Module,
        name: str,
        config: Any = None,
        num_cores: int | None = None,
        group_size: int | None = None,
        format: str | None = None,
        checkpoint: SafetensorsCheckpoint | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> QuantizedValueTable:
        format, num_cores, group_size = cls._settings(table, name, config, num_cores, group_size, format)
        weight = _quantized_table(table, name, format, num_cores, group_size, checkpoint)
        if device is None and hasattr(table, "weight"):
            device = table.weight.device
        return cls(weight.to(device) if device is not None else weight, format, group_size, table.embedding_dim)

    def forward(self, rows, groups, scores, num_groups, ops=None) -> torch.Tensor:
        """rows, groups (T, K), scores (T, K, h) -> (T, E, Dv) float32."""
        self._warn_if_training()
        return self._lookup(self.weight, rows, groups, scores, num_groups)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.value_dim}, format={self.format!r}, group_size={self.group_size}"


class _QuantizedOffloadedStore(QuantizedStoreMixin):
    """The offloaded stores' reading (sorted unique rows, background thread, side-stream copy), with the quantized
    op pooling straight from the host table (no gather copy: the op reads the selected rows in place)."""

    @classmethod
    def from_table(
        cls,
        table: nn.Module,
        name: str,
        config: Any = None,
        num_cores: int | None = None,
        group_size: int | None = None,
        format: str | None = None,
        checkpoint: SafetensorsCheckpoint | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        format, num_cores, group_size = cls._settings(table, name, config, num_cores, group_size, format)
        store = cls(cls._load_quantized(table, name, format, num_cores, group_size, checkpoint, device), name)
        store.format, store.group_size, store.value_dim = format, group_size, table.embedding_dim
        return store

    @property
    def embedding_dim(self) -> int:
        return self.value_dim

    def _pool(self, rows, groups, scores, num_groups) -> torch.Tensor:
        """The quantized op pools straight from the host table (no gather copy: it reads the selected rows in place)."""
        unique = torch.unique(rows)  # sorted: for the count and the disk's read-ahead advice
        self.rows_read += unique.numel()
        self._will_read(unique)
        return self._lookup(self.table, rows, groups, scores, num_groups)

    def _read(self, rows: torch.Tensor) -> torch.Tensor:
        """Each row dequantized (float32): the quantized op's lookup, one slot of weight 1 a row."""
        slots = rows.reshape(-1, 1)
        ones = torch.ones(*slots.shape, 1)
        return self._pool(slots, torch.zeros_like(slots), ones, 1).view(*rows.shape, -1)


class QuantizedHostValueStore(_QuantizedOffloadedStore, HostValueStore):
    """memory_offload="cpu" with quantized tables: the uint8 table in host memory (pinned beside a GPU)."""

    @staticmethod
    def _load_quantized(table, name, format, num_cores, group_size, checkpoint, device) -> torch.Tensor:
        values = _quantized_table(table, name, format, num_cores, group_size, checkpoint).cpu()
        return values.pin_memory() if device is not None and torch.device(device).type == "cuda" else values


class QuantizedDiskValueStore(_QuantizedOffloadedStore, DiskValueStore):
    """memory_offload="disk" with quantized tables: the checkpoint's uint8 table memory-mapped; only the selected
    rows are read (the quantized op reads them from the mapping)."""

    @staticmethod
    def _load_quantized(table, name, format, num_cores, group_size, checkpoint, device) -> torch.Tensor:
        if checkpoint is None:
            raise OffloadCheckpointError(
                "the 'disk' value store maps a checkpoint's table: load with "
                "from_pretrained_quantized(path, memory_offload='disk')"
            )
        location = checkpoint.locate(name)
        expected = (table.num_embeddings, quantized_width(format, table.embedding_dim, group_size))
        if location.dtype != torch.uint8:
            raise QuantizationError(
                f"{name} is a {location.dtype} table: the 'disk' store maps a quantized checkpoint as it is; "
                f"convert it first: python -m ultramem.quantize CHECKPOINT OUT --format {format}"
            )
        if location.shape != expected:
            raise QuantizationError(f"{name} is {location.shape} in the checkpoint, {format} needs {expected}")
        return checkpoint.map(name)

    def _will_read(self, rows: torch.Tensor) -> None:
        advise_will_need(self.table, rows)


LOCATIONS: dict[str | None, type] = {
    None: QuantizedValueTable,
    "cpu": QuantizedHostValueStore,
    "disk": QuantizedDiskValueStore,
}


def store_name(offload: str | None, format: str) -> str:
    """The registered name of the quantized store for a `memory_offload` location and a format: "int8",
    "cpu-int4", ..."""
    return format if offload is None else f"{offload}-{format}"


QUANTIZED_STORES: dict[str, type] = {
    store_name(offload, format): store.bound(format) for offload, store in LOCATIONS.items() for format in FORMATS
}


def saved_quantization(path: Any, **from_pretrained_kwargs: Any) -> tuple[str | None, int | None]:
    """(memory_quantization, memory_quantization_group_size) saved in a checkpoint's config.json."""
    config_file = Path(path) / "config.json"
    if config_file.is_file():
        saved = json.loads(config_file.read_text())
    else:
        from transformers import PretrainedConfig

        saved, _ = PretrainedConfig.get_config_dict(str(path), **from_pretrained_kwargs)
    return saved.get("memory_quantization"), saved.get("memory_quantization_group_size")
