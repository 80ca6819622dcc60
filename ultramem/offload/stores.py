"""The offloaded value stores: a table in host memory ("cpu") or memory-mapped from a safetensors file ("disk").

Both answer the memory layer's lookup-reduce (their `forward`) the same way: the selected rows are deduplicated and sorted
(each row, and so each page of a mapped file, is read once and in file order), gathered on the host, pooled
into the IVE groups by the PyTorch reference (`memory_ops.lookup_reduce`), and only the pooled (T, E, Dv)
result goes to the model's device. `lookup_reduce_async` does the host part in one background thread, so
it overlaps the blocks between a memory layer's read and write blocks; on CUDA the copy runs on a side stream.
A pre-value table's `lookup_dot` reads its rows the same way, on the caller's thread: the layer needs the (T, K)
dots before it can pool, so there is nothing to overlap them with. An n-gram memory pools nothing: `read_async` gives
its rows as they are, read the same way in the background.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import logging

from ..memory_ops import lookup_dot, lookup_reduce
from .safetensors_file import OffloadCheckpointError, SafetensorsCheckpoint, advise_will_need, write_tensor

logger = logging.get_logger(__name__)

# One reader: lookups overlap the model's blocks, and each other only through this queue (host cores are few).
_READER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ultramem-offload")


class PendingLookup:
    """A lookup started on the host: `result()` is the pooled (T, E, Dv) tensor, ready on the caller's stream."""

    def __init__(self, future: Future):
        self.future = future

    def result(self) -> torch.Tensor:
        pooled, copied = self.future.result()
        if copied is not None:  # a side-stream copy to a CUDA device: order it before the caller's next kernels
            stream = torch.cuda.current_stream(pooled.device)
            stream.wait_event(copied)
            pooled.record_stream(stream)
        return pooled


class OffloadedValueStore(nn.Module):
    """A (N, Dv) table outside the accelerator, read row by row; `model.to(device)` leaves it where it is.

    The table is a plain attribute (no parameter or buffer), and a state-dict hook puts it back under the
    table's key, so `save_pretrained` of an offloaded model writes an ordinary checkpoint. `rows_read` counts
    the distinct rows gathered (for tests and benchmarks); `asynchronous=False` makes every lookup blocking.
    The table is read-only: a store serves inference (training a model through it leaves the table as is).
    """

    def __init__(self, table: torch.Tensor, name: str):
        super().__init__()
        self.table = table
        self.name = name
        self.asynchronous = True
        self.rows_read = 0
        self.register_state_dict_post_hook(_table_into_state_dict)

    def __deepcopy__(self, memo: dict) -> OffloadedValueStore:
        """A copy (`copy.deepcopy(model)`, e.g. a frozen reference model) shares the read-only table: a mapped one
        would otherwise be read whole into memory."""
        memo[id(self.table)] = self.table
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone

    @property
    def num_embeddings(self) -> int:
        return self.table.shape[0]

    @property
    def embedding_dim(self) -> int:
        return self.table.shape[1]

    @classmethod
    def from_table(
        cls,
        table: nn.Module,
        name: str,
        checkpoint: SafetensorsCheckpoint | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> OffloadedValueStore:
        """`ValueStore.from_table`: the table is `checkpoint`'s tensor `name` (else `table`'s weight); `device` and
        `dtype` are the model's."""
        return cls(cls._load(table, name, checkpoint, device, dtype), name)

    @staticmethod
    def find_checkpoint(path: Any, **from_pretrained_kwargs: Any) -> SafetensorsCheckpoint:
        """Checked before the rest of the model loads, so a bad checkpoint fails first."""
        return SafetensorsCheckpoint.find(path, **from_pretrained_kwargs)

    def forward(self, rows, groups, scores, num_groups, ops=None) -> torch.Tensor:
        """rows, groups (T, K), scores (T, K, h) -> (T, E, Dv) on the device of `scores` (ops: host reference)."""
        return self._start(rows, groups, scores, num_groups, background=False).result()

    def lookup_reduce_async(self, rows, groups, scores, num_groups, ops=None) -> PendingLookup:
        return self._start(rows, groups, scores, num_groups, background=self.asynchronous)

    def read_async(self, rows: torch.Tensor, background: bool = True) -> PendingLookup:
        """The table's `rows` (...) as they are, (..., Dv) on the device of `rows`, each distinct row read once: in the
        background unless `background` is False or the store reads synchronously (`asynchronous`)."""
        return self._submit(background and self.asynchronous, self._rows_on, rows.device, rows.cpu())

    def lookup_dot(self, rows: torch.Tensor, query: torch.Tensor, ops=None) -> torch.Tensor:
        """rows (T, K), query (T, Dp) -> (T, K) on the device of `query` (ops: host reference); the query gets its
        gradient through the host copy."""
        self._warn_if_training()
        gathered, inverse = self._gather(rows.cpu())
        return lookup_dot(gathered, inverse, query.cpu()).to(query.device)

    def _warn_if_training(self) -> None:
        if self.training and torch.is_grad_enabled():
            logger.warning_once(
                "The value tables served by `memory_offload` are read-only: training updates every other weight "
                "(scores and queries get their gradients) but not the tables. Load without `memory_offload` to "
                "train them; to shard tables larger than a device, see `memory_parallel`."
            )

    def _start(self, rows, groups, scores, num_groups, background: bool) -> PendingLookup:
        self._warn_if_training()
        device = scores.device
        host = rows.cpu(), groups.cpu(), scores.cpu()  # on a GPU this waits for retrieval, not for later blocks
        return self._submit(background, self._pooled_on, device, *host, num_groups)

    @staticmethod
    def _submit(background: bool, work: Callable[..., tuple[torch.Tensor, Any]], *args: Any) -> PendingLookup:
        """`work(*args)` in the reader thread, or now."""
        if background:
            return PendingLookup(_READER.submit(work, *args))
        done: Future = Future()
        done.set_result(work(*args))
        return PendingLookup(done)

    def _will_read(self, rows: torch.Tensor) -> None:
        """Called before the rows are gathered (a disk store starts their reads here)."""

    def _gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The selected rows, each read once (U, Dv), and where each slot's row lies among them (T, K)."""
        unique, inverse = torch.unique(rows, return_inverse=True)  # sorted: each row once, in file order
        self.rows_read += unique.numel()
        self._will_read(unique)
        return self.table.index_select(0, unique), inverse

    def _pool(self, rows, groups, scores, num_groups) -> torch.Tensor:
        """The pooled (T, E, Dv) values on the host, each selected row read once."""
        return lookup_reduce(*self._gather(rows), groups, scores, num_groups)

    def _pooled_on(self, device: torch.device, rows, groups, scores, num_groups) -> tuple[torch.Tensor, Any]:
        return self._moved_to(device, self._pool(rows, groups, scores, num_groups))

    def _rows_on(self, device: torch.device, rows: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self._moved_to(device, self._read(rows))

    def _read(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows (...) as they are, (..., Dv) on the host, each distinct row read once."""
        gathered, inverse = self._gather(rows)
        return F.embedding(inverse, gathered)

    @staticmethod
    def _moved_to(device: torch.device, values: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """`values` on `device`, and on CUDA the event its side-stream copy records (`PendingLookup.result`)."""
        if device.type != "cuda":
            return values.to(device), None
        stream = _side_stream(device)
        with torch.cuda.stream(stream):
            values = values.pin_memory().to(device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        return values, copied


class HostValueStore(OffloadedValueStore):
    """memory_offload="cpu": the whole table in host memory (pinned when the model is on a GPU).

    PyTorch's pinned allocator rounds each block up to a power of two, so a pinned table takes up to 2x its size
    (ultramem-1.6b-x12: 6 x 8.6 GB pinned for 6 x 6.6 GB), and pinning copies it once more while it runs.
    """

    @staticmethod
    def _load(table, name, checkpoint, device, dtype) -> torch.Tensor:
        """The checkpoint's table, read once (or an in-memory table's weight), in the model's dtype."""
        values = checkpoint.read(name) if checkpoint is not None else table.weight.detach().cpu()
        values = values.to(dtype) if dtype is not None else values
        if device is not None and torch.device(device).type == "cuda":
            values = values.pin_memory()
        return values


class DiskValueStore(OffloadedValueStore):
    """memory_offload="disk": the table stays in the checkpoint file, memory-mapped; only selected rows are read.

    It keeps the file's dtype (a mapping cannot be cast); the pooled result is cast where it is projected. On a model
    already in memory, `set_value_store("disk", directory=...)` writes each table to its own safetensors file there
    and maps that: the in-memory copy is freed once the store replaces it.
    """

    @classmethod
    def from_table(
        cls,
        table: nn.Module,
        name: str,
        checkpoint: SafetensorsCheckpoint | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        directory: str | os.PathLike | None = None,
    ) -> DiskValueStore:
        """`ValueStore.from_table`: `checkpoint`'s tensor `name`, or with `directory` the in-memory table written
        to `directory/<name>.safetensors` first (a folder on the disk that should serve it: not a RAM-backed /tmp)."""
        if checkpoint is None and directory is not None:
            checkpoint = write_table(table, name, Path(directory))
        return super().from_table(table, name, checkpoint, device, dtype)

    @staticmethod
    def _load(table, name, checkpoint, device, dtype) -> torch.Tensor:
        if checkpoint is None:
            raise OffloadCheckpointError(
                "the 'disk' value store maps a table from a file: pass set_value_store('disk', directory=...) to "
                "write an in-memory model's tables there, or load with from_pretrained(path, memory_offload='disk')"
            )
        values = checkpoint.map(name)
        expected = (table.num_embeddings, table.embedding_dim)
        if tuple(values.shape) != expected:
            raise OffloadCheckpointError(
                f"{name} is {tuple(values.shape)} in the checkpoint, the config needs {expected}"
            )
        return values

    def _will_read(self, rows: torch.Tensor) -> None:
        """Queue the reads of all selected rows at once (the disk serves them in parallel), then fault them in."""
        advise_will_need(self.table, rows)


def write_table(table: nn.Module, name: str, directory: Path) -> SafetensorsCheckpoint:
    """Writes a `MemoryValueTable`'s weight to `directory/<name>.safetensors` and returns that file's checkpoint.

    The file is written beside its final name and renamed over it, so a store still mapping an earlier file of that
    name keeps reading the old one (rewriting it in place would change, or cut, the pages under its map).
    """
    weight = getattr(table, "weight", None)
    if weight is None:
        raise OffloadCheckpointError(
            f"{name} has no table in memory to write (a model built with memory_offload set): "
            "load it with from_pretrained(path, memory_offload='disk')"
        )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.safetensors"
    partial = path.with_name(f".{path.name}.partial")
    try:
        write_tensor(partial, name, weight)
    except OSError as error:  # a full disk (ENOSPC): the partial file goes, an earlier complete one stays
        partial.unlink(missing_ok=True)
        raise OffloadCheckpointError(f"could not write {path} ({error.strerror or error})") from None
    os.replace(partial, path)
    return SafetensorsCheckpoint([path])


def _table_into_state_dict(module: OffloadedValueStore, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    state_dict[prefix + "weight"] = module.table


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One copy stream per device, made on first use."""
    return torch.cuda.Stream(device)
