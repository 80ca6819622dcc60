"""Tensors derived from parameters, kept between forwards of an eval-mode model while they cannot change.

Under torch.compile the version check cannot run: Dynamo (torch 2.13) guards a tensor on its dtype, device, shape,
strides and requires_grad, not on its version counter (in a graph `_version` is an unbacked SymInt, which
functionalization drops), so a compiled step cannot tell that an optimizer step or `load_state_dict` changed the
weights in place. Forward pre-hooks are no eager point either: Dynamo traces them into the graph of a compiled
`module.__call__`. What Dynamo does guard on is a Python value read from a module, such as a bool in a dict: a flip
selects between two compiled graphs, with no recompilation per step. So an eager `refresh` (the model's
`refresh_inference_cache`, which `prepare_inputs_for_generation` calls before every step of `generate`) brings an
entry up to date and sets its `refreshed` flag, and the next forward uses it up: a compiled forward then reads the
cached tensors (Dynamo writes the flag back after the graph), and a compiled forward without a refresh just before
it computes them in its graph, correct and as slow as before. A refresh is for the call that follows it: weights
changed between the two are not seen.

The cached tensors are non-persistent buffers, updated in place and never rebound, so that a CUDA graph captured on
them reads the new values at the same address; they stay out of `state_dict` and `parameters()`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Derived = torch.Tensor | tuple[torch.Tensor, ...]
CacheEntry = tuple[tuple[torch.Tensor, ...], Callable[[], Derived]]  # the parameters, and what computes from them


def held_here(*parameters: torch.Tensor) -> bool:
    """Whether the parameters are whole outside their module's forward: not partitioned by DeepSpeed ZeRO-3 nor
    offloaded by accelerate (meta), whose hooks make them whole only inside it. Only such weights can be cached or
    folded."""
    return not any(hasattr(p, "ds_id") or p.device.type == "meta" for p in parameters)


class InferenceCache(nn.Module):
    """Tensors derived from parameters, kept between forwards of an eval-mode model while they cannot change.

    For what every decode step would otherwise recompute from fixed weights (the LayerNorm'd keys, the cores'
    singular vectors). An entry is reused only in eval mode with grad off (a graph through a cached tensor
    would be stale), and only while its parameters keep their storage, dtype, device and version counter, which
    every in-place write bumps (optimizer steps, `load_state_dict`, `copy_`). An entry holds the storages it was
    computed from, so a new tensor (after `.to()`, say) cannot reuse their address and pass for them. Under
    torch.compile an entry is read only right after an eager `refresh` (see the module's docstring). `train()`
    empties the cache. Writes through `.data` bypass the version counter: call `clear()` after them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.versions: dict[str, tuple[list, tuple[torch.UntypedStorage, ...]]] = {}
        self.refreshed: dict[str, bool] = {}  # whether a compiled forward may read the entry (once)
        self.entries: dict[str, Derived] = {}  # each entry's buffers, as `compute` returns them

    def get(self, name: str, parameters: tuple[torch.Tensor, ...], compute: Callable[[], Derived]) -> Derived:
        """compute(), or its cached result for `name` while `parameters` are unchanged.

        A plain method, not `forward`: module hooks (DeepSpeed ZeRO-3's gather/release of parameters) must see
        the modules `compute` calls, not a parameterless wrapper around them.
        """
        if self.training or torch.is_grad_enabled():
            return compute()
        if torch.compiler.is_compiling():
            if not self.refreshed.get(name, False):
                return compute()
            self.refreshed[name] = False  # Dynamo replays this write after the graph
            return self.entries[name]
        key = [(p.data_ptr(), p._version, p.dtype, p.device) for p in parameters]  # a decode step's host time
        if name not in self.versions or self.versions[name][0] != key:
            self._store(name, compute())
            self.versions[name] = (key, tuple(p.untyped_storage() for p in parameters))
        self.refreshed[name] = False  # any read uses up a refresh: a later weight change cannot follow it unseen
        return self.entries[name]

    def refresh(self, name: str, parameters: tuple[torch.Tensor, ...], compute: Callable[[], Derived]) -> None:
        """Brings the entry up to date eagerly and lets the next compiled forward read it. Skipped (the compiled
        forward then computes) in training, and for parameters not held here: ZeRO-3 partitions, accelerate's
        offloaded (meta) weights."""
        if self.training or not held_here(*parameters):
            return
        with torch.no_grad():
            self.get(name, parameters, compute)
        self.refreshed[name] = True

    def _store(self, name: str, value: Derived) -> None:
        """Into the entry's buffers in place (a captured CUDA graph keeps reading them); new ones where the shape,
        dtype or device differ. Copies, never aliases: an identity `compute` returns the parameter itself."""
        tensors = value if isinstance(value, tuple) else (value,)
        for i, tensor in enumerate(tensors):
            old = self._buffers.get(f"{name}_{i}")
            if old is not None and (old.shape, old.dtype, old.device) == (tensor.shape, tensor.dtype, tensor.device):
                old.copy_(tensor)
            else:  # not an inference tensor, which a later refresh outside `torch.inference_mode` could not write
                with torch.inference_mode(False):
                    self.register_buffer(f"{name}_{i}", tensor.detach().clone(), persistent=False)
        buffers = tuple(self._buffers[f"{name}_{i}"] for i in range(len(tensors)))
        self.entries[name] = buffers if isinstance(value, tuple) else buffers[0]

    def clear(self) -> None:
        """Forgets what the buffers were computed from: the next read recomputes them (in place)."""
        self.versions.clear()
        self.refreshed.clear()

    def __getstate__(self) -> dict:
        """Pickled (`torch.save(model)`, `copy.deepcopy`) empty: the storages the entries hold alias parameters
        under another type, which `torch.save` refuses."""
        return {**self.__dict__, "versions": {}, "refreshed": {}}

    def train(self, mode: bool = True) -> InferenceCache:
        if mode:
            self.clear()
        return super().train(mode)
