"""Where each tensor of a safetensors checkpoint lies, read from the headers only, and zero-copy views of it.

A single `model.safetensors` or a sharded one (`model.safetensors.index.json`, each tensor found in its shard).
Views come from one read-only `mmap` per file advised `MADV_RANDOM`: a lookup of a few rows reads their pages
and no read-ahead around them, so a table is never read whole.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")


class OffloadCheckpointError(ValueError):
    """The checkpoint cannot serve offloaded value tables; the message says why and what to do."""


@dataclass(frozen=True)
class TensorLocation:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of the first byte in the file

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors JSON header of `path` and the file offset where its data begin. A file that is not whole (cut
    by an interrupted copy or download: its header describes more bytes than it holds) is one error naming it."""
    if not path.is_file():
        raise OffloadCheckpointError(f"{path}: missing; copy or save the checkpoint again")
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else size
        try:
            header = json.loads(handle.read(length)) if 8 + length <= size else None
        except ValueError:  # not JSON, not UTF-8
            header = None
    tensors = (entry for name, entry in (header or {}).items() if name != "__metadata__")
    described = 8 + length + max((entry["data_offsets"][1] for entry in tensors), default=0)
    if not isinstance(header, dict) or described != size:
        extent = f", its header describes {described:,}" if isinstance(header, dict) else ""
        raise OffloadCheckpointError(
            f"{path}: not a complete safetensors file ({size:,} bytes{extent}): it was truncated or damaged; "
            "copy or save the checkpoint again"
        )
    return header, 8 + length


class SafetensorsCheckpoint:
    """Tensor locations of a checkpoint (one file or shards), and the maps that serve them."""

    def __init__(self, files: list[Path]):
        self.locations: dict[str, TensorLocation] = {}
        for path in files:
            header, data_start = read_header(path)
            for name, entry in header.items():
                if name != "__metadata__" and entry["dtype"] in SAFETENSORS_DTYPES:
                    dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"])
                    self.locations[name] = TensorLocation(path, dtype, shape, data_start + entry["data_offsets"][0])
        self._maps: dict[Path, mmap.mmap] = {}

    @classmethod
    def find(cls, path: str | Path, **from_pretrained_kwargs: Any) -> SafetensorsCheckpoint:
        """The safetensors files of a local folder or a Hub repo; anything else is one clear error."""
        hub = {k: from_pretrained_kwargs[k] for k in HUB_KWARGS if from_pretrained_kwargs.get(k) is not None}
        for name in (SINGLE_FILE, INDEX_FILE):
            found = _resolve(path, name, hub)
            if found is not None and name == SINGLE_FILE:
                return cls([found])
            if found is not None:
                shards = sorted(set(json.loads(found.read_text())["weight_map"].values()))
                return cls([_resolve(path, shard, hub) or found.parent / shard for shard in shards])
        raise OffloadCheckpointError(
            f"memory_offload needs the checkpoint in safetensors ({SINGLE_FILE} or {INDEX_FILE}); {path} has neither "
            "(a pytorch_model.bin checkpoint: load it once and re-save with save_pretrained)"
        )

    def locate(self, name: str) -> TensorLocation:
        """The location of state-dict key `name`, also when the file was saved with or without the `model.` prefix."""
        for key in (name, f"model.{name}", name.removeprefix("model.")):
            if key in self.locations:
                return self.locations[key]
        raise OffloadCheckpointError(f"the checkpoint has no tensor {name!r} to offload")

    def map(self, name: str) -> torch.Tensor:
        """A read-only view of tensor `name` on the mapped file: nothing is read until rows are indexed."""
        location = self.locate(name)
        if location.path not in self._maps:
            with open(location.path, "rb") as handle:
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            mapped.madvise(mmap.MADV_RANDOM)
            self._maps[location.path] = mapped
        with warnings.catch_warnings():  # read-only by design: the stores never write
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(
                self._maps[location.path], dtype=location.dtype, count=location.numel, offset=location.offset
            )
        return flat.view(location.shape)

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name` read into memory with one sequential read (no map left behind)."""
        location = self.locate(name)
        tensor = torch.empty(location.shape, dtype=location.dtype)
        with open(location.path, "rb") as handle:
            handle.seek(location.offset)
            handle.readinto(tensor.view(-1).view(torch.uint8).numpy())
        return tensor


def write_tensor(path: Path, name: str, tensor: torch.Tensor) -> None:
    """Writes one tensor as a safetensors file, straight from its memory: no serialized copy of it is made first
    (`safetensors.torch.save_file` builds one, twice the table's size at the peak)."""
    dtype = next(key for key, value in SAFETENSORS_DTYPES.items() if value == tensor.dtype)
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    entry = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [0, data.numel()]}
    header = json.dumps({name: entry}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.write(memoryview(data.numpy()))


def _resolve(path: str | Path, filename: str, hub: dict[str, Any]) -> Path | None:
    folder = Path(path) / hub.get("subfolder", "")
    if Path(path).is_dir():
        return folder / filename if (folder / filename).is_file() else None
    from transformers.utils import cached_file

    found = cached_file(
        str(path),
        filename,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
        **hub,
    )
    return Path(found) if found else None


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def advise_will_need(table: torch.Tensor, rows: torch.Tensor) -> None:
    """Ask the kernel to start reading rows (sorted indices) of a mapped 2-D `table` now, without waiting
    (MADV_WILLNEED on their pages, runs of adjacent pages merged): the gather that follows then waits for reads
    already in flight together instead of faulting its pages in one at a time."""
    page, row_bytes = mmap.PAGESIZE, table.shape[1] * table.element_size()
    starts = table.data_ptr() + rows * row_bytes
    first, last = (starts // page).tolist(), ((starts + row_bytes - 1) // page).tolist()
    begin = 0
    for i in range(len(first)):
        if i + 1 == len(first) or first[i + 1] > last[i] + 1:  # end of a run of adjacent pages
            _LIBC.madvise(first[begin] * page, (last[i] + 1 - first[begin]) * page, mmap.MADV_WILLNEED)
            begin = i + 1
