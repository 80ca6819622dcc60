"""Worker of `test_memory_parallel_load.py`: one gloo process of 2 building a sharded model from a checkpoint
and fresh, as `ultramem-train --memory_parallel` does, watching the largest tensor allocated meanwhile."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from memory_parallel_worker import LargestTensor
from model_support import small_config
from safetensors import safe_open

from ultramem import UltraMemConfig, UltraMemForCausalLM
from ultramem.parallel import apply_memory_parallel
from ultramem.training.model_setup import build_model

MODES = ("number", "dimension")


def table_config() -> UltraMemConfig:
    """Tables (4096 x 16) larger than any other tensor of the model, so a whole one would show."""
    return small_config(memory_implementation="torch", memory_num_keys=64, memory_value_dim=16)


class _RecordedSlice:
    """A safetensors slice that notes its key when read (Transformers' loader reads tensors through slices)."""

    def __init__(self, tensor_slice: Any, key: str, read: list[str]):
        self._slice, self._key, self._read = tensor_slice, key, read

    def __getattr__(self, name: str) -> Any:
        return getattr(self._slice, name)

    def __getitem__(self, index: Any) -> torch.Tensor:
        self._read.append(self._key)
        return self._slice[index]


class _RecordedFile:
    def __init__(self, handle: Any, read: list[str]):
        self._handle, self._read = handle, read

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def __enter__(self) -> _RecordedFile:
        self._handle.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._handle.__exit__(*exc)

    def get_tensor(self, key: str) -> torch.Tensor:
        self._read.append(key)
        return self._handle.get_tensor(key)

    def get_slice(self, key: str) -> _RecordedSlice:
        return _RecordedSlice(self._handle.get_slice(key), key, self._read)


@contextmanager
def keys_loaded() -> Iterator[list[str]]:
    """The checkpoint keys `from_pretrained` reads while active."""
    read: list[str] = []
    with mock.patch("transformers.modeling_utils.safe_open", lambda *a, **k: _RecordedFile(safe_open(*a, **k), read)):
        yield read


def sharded_model(mode: str, checkpoint: str | None) -> tuple[UltraMemForCausalLM, int, list[str]]:
    """The model `ultramem-train` sets up, the largest tensor (elements) allocated while setting it up, and the
    table keys the loader read."""
    with LargestTensor() as largest, keys_loaded() as read:
        model = build_model(SimpleNamespace(model_name_or_path=checkpoint), table_config(), defer_tables=True)
        apply_memory_parallel(model, mode, checkpoint=checkpoint)
    return model, largest.largest, [key for key in read if key.endswith("values.weight")]


def load_checks(mode: str, checkpoint: str) -> dict:
    """Logits and loss of the sharded load vs the one-process load, on the same batch on every rank."""
    reference = UltraMemForCausalLM.from_pretrained(checkpoint)
    input_ids = torch.randint(1, reference.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    expected = reference(input_ids, labels=input_ids)
    model, largest, tables_loaded = sharded_model(mode, checkpoint)
    found = model(input_ids, labels=input_ids)
    table = model.model.memory_layers[0].values.weight
    return {
        "logits": float((found.logits - expected.logits).abs().max()),
        "loss": abs(float(found.loss) - float(expected.loss)),
        "largest": largest,
        "tables_loaded": tables_loaded,
        "table_numel": table.numel(),
        "local_numel": table.to_local().numel(),
    }


def fresh_checks(mode: str) -> dict:
    """Each shard's std against the table's init std, and whether the two ranks' shards differ."""
    torch.manual_seed(0)
    model, largest, _ = sharded_model(mode, None)
    values = model.model.memory_layers[0].values
    shard = values.weight.to_local().detach()
    shards = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, shard)
    return {
        "std": float(shard.std()),
        "init_std": UltraMemForCausalLM(table_config()).model.memory_layers[0].values.init_std,
        "mean": float(shard.mean()),
        "shards_differ": not torch.equal(shards[0], shards[1]),
        "largest": largest,
        "table_numel": values.weight.numel(),
    }


def run(rank: int, world: int, init_file: str, out_dir: str, checkpoint: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {f"load/{mode}": load_checks(mode, checkpoint) for mode in MODES}
    results.update({f"fresh/{mode}": fresh_checks(mode) for mode in MODES})
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
