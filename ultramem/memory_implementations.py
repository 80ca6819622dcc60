"""How a memory layer's kernels are computed: a registry, as Transformers' `AttentionInterface` is for attention.

The choice is a private, unsaved setting (`config._memory_implementation`), given as
`from_pretrained(path, memory_implementation=...)` or `model.set_memory_implementation(...)`; unset, it follows the
device (`default_memory_implementation`). A checkpoint therefore never carries the machine it was trained on.

Registered: "torch" (the pure-PyTorch reference, `memory_ops`), "embedding_bag" (the reference with its lookup as one
`F.embedding_bag`, the fast path on CPU) and, on `import ultramem`, "triton" (`ultramem.kernels`) and "cpp" (C++ CPU
kernels built on first use, `ultramem.cpp_kernels`). A new kernel is one
`MemoryImplementations.register(name, ops)` call.

This file is copied beside `modeling_ultramem.py` into checkpoints (remote code). A copy loaded without the
`ultramem` package knows only the PyTorch implementations; with the package installed it also finds what the package
registered.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Protocol

import torch
from transformers.utils.generic import GeneralInterface

from .embedding_bag_ops import lookup_dot_embedding_bag, lookup_reduce_embedding_bag, lookup_reduce_embedding_bag_on
from .memory_ops import (
    lookup_dot,
    lookup_reduce,
    lookup_reduce_on,
    tucker_candidate_topk,
    tucker_topk,
    tucker_topk_on,
)
from .package_registry import package_registry


class MemoryOps(Protocol):
    """The memory layer's kernels, with the contract of their reference in `memory_ops`."""

    def lookup_reduce(
        self, values: torch.Tensor, rows: torch.Tensor, groups: torch.Tensor, scores: torch.Tensor, num_groups: int
    ) -> torch.Tensor: ...

    def tucker_candidate_topk(
        self, row_scores: torch.Tensor, col_scores: torch.Tensor, cores: torch.Tensor, topk: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def tucker_topk(
        self,
        axis_scores: torch.Tensor,
        cores: torch.Tensor,
        leading_vectors: torch.Tensor,
        topk: int,
        signed: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def lookup_dot(self, table: torch.Tensor, rows: torch.Tensor, query: torch.Tensor) -> torch.Tensor: ...


# Optional, for decode steps on weights that stay as they are (`memory_ops.tucker_topk_on`, `lookup_reduce_on`): an
# implementation may prepare `tucker_topk` on its cores and `lookup_reduce` on its table once per `generate` call
TORCH_MEMORY_OPS: MemoryOps = SimpleNamespace(
    lookup_reduce=lookup_reduce,
    tucker_candidate_topk=tucker_candidate_topk,
    tucker_topk=tucker_topk,
    lookup_dot=lookup_dot,
    tucker_topk_on=tucker_topk_on,
    lookup_reduce_on=lookup_reduce_on,
)
EMBEDDING_BAG_MEMORY_OPS: MemoryOps = SimpleNamespace(
    lookup_reduce=lookup_reduce_embedding_bag,
    tucker_candidate_topk=tucker_candidate_topk,
    tucker_topk=tucker_topk,
    lookup_dot=lookup_dot_embedding_bag,
    tucker_topk_on=tucker_topk_on,
    lookup_reduce_on=lookup_reduce_embedding_bag_on,
)


class MemoryImplementations(GeneralInterface):
    """Name -> `MemoryOps`. An entry may define `available()`; the device default skips entries that say False."""

    _global_mapping = {"torch": TORCH_MEMORY_OPS, "embedding_bag": EMBEDDING_BAG_MEMORY_OPS}


ALL_MEMORY_IMPLEMENTATIONS = MemoryImplementations()


def registered_memory_implementations() -> list[str]:
    package = package_registry(ALL_MEMORY_IMPLEMENTATIONS)
    return sorted({*ALL_MEMORY_IMPLEMENTATIONS, *(package or ())})


def _lookup(name: str) -> MemoryOps | None:
    if name in ALL_MEMORY_IMPLEMENTATIONS:
        return ALL_MEMORY_IMPLEMENTATIONS[name]
    package = package_registry(ALL_MEMORY_IMPLEMENTATIONS)
    return package[name] if package is not None and name in package else None


def _usable(name: str) -> bool:
    ops = _lookup(name)
    return ops is not None and getattr(ops, "available", lambda: True)()


def default_memory_implementation(device: torch.device) -> str:
    """embedding_bag on CPU, Triton on CUDA where it is registered and can launch, the reference elsewhere."""
    if device.type == "cpu":
        return "embedding_bag"
    if device.type == "cuda" and _usable("triton"):
        return "triton"
    return "torch"


def _unregistered(name: str) -> ValueError:
    hint = " (`pip install 'ultramem[triton]'` and `import ultramem` register it)" if name == "triton" else ""
    return ValueError(
        f"memory_implementation={name!r} is not registered; choose one of "
        f"{registered_memory_implementations()} or None (the device's default){hint}"
    )


def check_memory_implementation(name: str | None) -> None:
    """One line naming the allowed names, for a name no registry knows (None means the device default)."""
    if name is not None and _lookup(name) is None:
        raise _unregistered(name)


def memory_ops_for(name: str | None, device: torch.device) -> MemoryOps:
    """The ops of implementation `name` (None: the default for `device`); one registry look-up per call (every
    memory layer's forward)."""
    name = name or default_memory_implementation(device)
    ops = _lookup(name)
    if ops is None:
        raise _unregistered(name)
    return ops
