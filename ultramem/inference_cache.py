"""Tensors derived from parameters, kept between forwards of an eval-mode model while they cannot change."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

Derived = TypeVar("Derived")


class InferenceCache(nn.Module):
    """Tensors derived from parameters, kept between forwards of an eval-mode model while they cannot change.

    For what every decode step would otherwise recompute from fixed weights (the LayerNorm'd keys, the cores'
    singular vectors). An entry is reused only in eval mode with grad off (a graph through a cached tensor
    would be stale) and outside torch.compile (which traces the computation instead), and only while its
    parameters keep their storage, dtype, device and version counter, which every in-place write bumps
    (optimizer steps, `load_state_dict`, `copy_`). An entry holds the storages it was computed from, so a
    new tensor (after `.to()`, say) cannot reuse their address and pass for them. `train()` empties the
    cache. Writes through `.data` bypass the version counter: call `clear()` after them. It is a module only so
    that `train()` / `eval()` reach it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.entries: dict[str, tuple[tuple, tuple[torch.UntypedStorage, ...], object]] = {}

    def get(self, name: str, parameters: tuple[torch.Tensor, ...], compute: Callable[[], Derived]) -> Derived:
        """compute(), or its cached result for `name` while `parameters` are unchanged.

        A plain method, not `forward`: module hooks (DeepSpeed ZeRO-3's gather/release of parameters) must see
        the modules `compute` calls, not a parameterless wrapper around them.
        """
        if self.training or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return compute()
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in parameters)
        entry = self.entries.get(name)
        if entry is None or entry[0] != key:
            entry = self.entries[name] = (key, tuple(p.untyped_storage() for p in parameters), compute())
        return entry[2]

    def clear(self) -> None:
        self.entries.clear()

    def __getstate__(self) -> dict:
        """Pickled (`torch.save(model)`, `copy.deepcopy`) empty: the entries are derived, and the storages they hold
        alias parameters under another type, which `torch.save` refuses."""
        return {**self.__dict__, "entries": {}}

    def train(self, mode: bool = True) -> InferenceCache:
        if mode:
            self.clear()
        return super().train(mode)
