"""Writing sharded value tables into an ordinary safetensors checkpoint, one shard in memory at a time.

`save_pretrained` writes everything else; the tables go into their own safetensors file, which rank 0 lays
out and memory-maps, then fills shard by shard as the owners send them (rank 0 never holds a whole table),
and a `model.safetensors.index.json` maps every weight to its file, so `from_pretrained` loads it in one
process like any sharded checkpoint.
"""

from __future__ import annotations

import json
import os
import struct

import torch
import torch.distributed as dist
from torch import nn

from ultramem.parallel.sharded import ShardedValueStore

DENSE_FILE, TABLES_FILE = "model-dense.safetensors", "model-values.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.uint8: "U8",  # quantized tables (`ultramem.quantized`)
}


def sharded_tables(model: nn.Module) -> dict[str, ShardedValueStore]:
    """State-dict key of each sharded value table -> its store."""
    return {f"{name}.weight": module for name, module in model.named_modules() if isinstance(module, ShardedValueStore)}


def _layout(tables: dict[str, ShardedValueStore]) -> tuple[bytes, dict[str, int]]:
    """Safetensors header (padded to 8 bytes) and each table's byte offset in the file."""
    header, offsets, position = {"__metadata__": {"format": "pt"}}, {}, 0
    for name, store in tables.items():
        weight = store.weight
        size = weight.numel() * weight.element_size()
        dtype, shape = SAFETENSORS_DTYPES[weight.dtype], list(weight.shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [position, position + size]}
        offsets[name], position = position, position + size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, {name: 8 + len(text) + offset for name, offset in offsets.items()}


def _write_tables(tables: dict[str, ShardedValueStore], path: str, is_writer: bool) -> None:
    """Rank 0 memory-maps the file and copies in each shard of the first replica group, received one by one."""
    header, offsets = _layout(tables)
    store = next(iter(tables.values()))
    owners = store.mesh.mesh[0].tolist()  # global ranks holding shards 0..P-1 (first replica group)
    mapped = None
    if is_writer:
        total = len(header) + sum(s.weight.numel() * s.weight.element_size() for s in tables.values())
        with open(path, "wb") as handle:
            handle.write(header)
            handle.truncate(total)
        mapped = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    for name, store in tables.items():
        local = store.weight.to_local().detach().contiguous()
        full = None
        if mapped is not None:
            full = mapped[offsets[name] : offsets[name] + local.element_size() * store.weight.numel()]
            full = full.view(local.dtype).view(store.weight.shape)
        for shard, owner in enumerate(owners):
            if dist.get_rank() == owner and not is_writer:
                dist.send(local, dst=0)
            if is_writer:
                received = local if owner == 0 else torch.empty_like(local)
                if owner != 0:
                    dist.recv(received, src=owner)
                store.shard_view(full, shard, store.size, store.cyclic).copy_(received)
    del mapped


def save_value_tables(model: nn.Module, output_dir: str, is_writer: bool) -> None:
    """Every rank calls this after rank 0's `save_pretrained` wrote the rest as `model.safetensors`."""
    tables = sharded_tables(model)
    _write_tables(tables, os.path.join(output_dir, TABLES_FILE), is_writer)
    if is_writer:
        from safetensors import safe_open

        os.replace(os.path.join(output_dir, "model.safetensors"), os.path.join(output_dir, DENSE_FILE))
        with safe_open(os.path.join(output_dir, DENSE_FILE), "pt") as dense:
            weight_map = dict.fromkeys(dense.keys(), DENSE_FILE)
        weight_map.update(dict.fromkeys(tables, TABLES_FILE))
        with open(os.path.join(output_dir, INDEX_FILE), "w", encoding="utf-8") as handle:
            json.dump({"metadata": {}, "weight_map": weight_map}, handle, indent=2)
    dist.barrier()
