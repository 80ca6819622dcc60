"""Trainer checkpoints of the value tables and their optimizer state with `torch.distributed.checkpoint` (DCP).

Every rank writes only its shards; DCP records the global shapes, so a checkpoint resumes at another world
size, with the other partitioning, or in one process (plain tensors) and each rank reads only what it holds.
The tables' optimizer state is kept out of the Trainer's `optimizer.pt` (rank 0's copy would hold only its
shard) and lives here beside the weights. A cyclically owned table (a value pool, number-wise) is written and read
in the table's own row order: its shards are exchanged into contiguous blocks (`cyclic_to_blocks`) around DCP.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from ultramem.parallel.number import blocks_to_cyclic, cyclic_to_blocks

TABLES_DIR = "value_tables"


def _tables(model: nn.Module) -> dict[str, nn.Parameter]:
    """Each value table's weight by name, read from its module (beside a DeepSpeed engine they are no parameters)."""
    return {name: model.get_submodule(name.removesuffix(".weight")).weight for name in model.get_value_table_names()}


def _state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor, nn.Module]]]:
    """Each table under its own name and its optimizer state under `<name>/<key>`, in the table's row order; and
    (entry, tensor, store) for the entries that are reordered copies of a cyclically owned tensor."""
    entries, copies = {}, []
    for name, param in _tables(model).items():
        store = model.get_submodule(name.removesuffix(".weight"))
        states = {f"{name}/{key}": value for key, value in optimizer.state.get(param, {}).items()}
        for entry, tensor in {name: param.data, **states}.items():
            entries[entry] = tensor
            if getattr(store, "cyclic", False) and tensor.shape == param.shape:
                local = cyclic_to_blocks(tensor.to_local(), store.size, store.rank, store.group)
                entries[entry] = DTensor.from_local(local, store.mesh, tensor.placements, run_check=False)
                copies.append((entries[entry], tensor, store))
    return entries, copies


@contextmanager
def tables_left_out_of(optimizer: torch.optim.Optimizer, model: nn.Module) -> Iterator[None]:
    """The optimizer without the tables' state while the Trainer pickles it."""
    held = {param: optimizer.state.pop(param) for param in _tables(model).values() if param in optimizer.state}
    try:
        yield
    finally:
        optimizer.state.update(held)


def save_table_states(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: str) -> None:
    """Every rank writes its shards of the tables and of their optimizer state to `checkpoint/value_tables`."""
    dcp.save(_state_dict(model, optimizer)[0], checkpoint_id=os.path.join(checkpoint, TABLES_DIR))


def has_table_states(checkpoint: str) -> bool:
    return os.path.isdir(os.path.join(checkpoint, TABLES_DIR))


def load_table_states(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: str) -> None:
    """Read this process's part of the tables and their optimizer state, whatever partitioning wrote them."""
    path = os.path.join(checkpoint, TABLES_DIR)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for name, param in _tables(model).items():
        state = optimizer.state[param]
        for key in (entry.split("/", 1)[1] for entry in saved if entry.startswith(f"{name}/")):
            if key not in state:
                shaped = saved[f"{name}/{key}"].size == param.shape
                state[key] = torch.zeros_like(param) if shaped else _scalar_state(optimizer, param)
    entries, copies = _state_dict(model, optimizer)
    dcp.load(entries, checkpoint_id=path, no_dist=not dist.is_initialized())  # in place
    for entry, tensor, store in copies:  # back into cyclic ownership
        tensor.to_local().copy_(blocks_to_cyclic(entry.to_local(), store.size, store.rank, store.group))


def _scalar_state(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> torch.Tensor:
    """A zero scalar state (AdamW's `step`) where the optimizer keeps it: on the parameter's device when its group
    is fused or capturable (the fused CUDA kernel reads it there), on the host otherwise, as `Adam._init_group`."""
    group = next((group for group in optimizer.param_groups if any(p is param for p in group["params"])), {})
    on_device = group.get("fused") or group.get("capturable")
    return torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu")


def load_dense_weights(model: nn.Module, checkpoint: str) -> None:
    """Load every weight of the checkpoint's safetensors files but the value tables (they come from DCP)."""
    skip = set(model.get_value_table_names())
    weights = {}
    for file in sorted(f for f in os.listdir(checkpoint) if f.endswith(".safetensors")):
        with safe_open(os.path.join(checkpoint, file), "pt") as handle:
            weights.update({key: handle.get_tensor(key) for key in handle.keys() if key not in skip})
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = set(missing) - skip - set(getattr(model, "_tied_weights_keys", None) or {})
    if unexpected or missing:
        raise ValueError(f"checkpoint {checkpoint} does not fit the model: missing {missing}, unexpected {unexpected}")
