"""Where the Triton kernels can run (`ultramem.memory_implementations` decides when to use them)."""

from __future__ import annotations

import importlib.util
import os

import torch

# Decided at import: installing a package does not change what this process can import, and the memory layers ask at
# every forward, where torch.compile cannot trace `find_spec` (torch 2.11 refuses it, breaking the graph).
TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def triton_available() -> bool:
    """Triton is importable and can launch here: a CUDA device is present, or the interpreter is on.

    CUDA is asked first: torch.compile folds `torch.cuda.is_available()` to a constant, so a compiled forward on a GPU
    never reads the environment."""
    return TRITON_IMPORTABLE and (torch.cuda.is_available() or interpreting())


def require_launchable(device: torch.device) -> None:
    """Raise a clear error before a launch that Triton could not perform on `device`. Skipped while torch.compile
    traces: the check reads the environment, which has no place in a graph, and such a launch fails when it runs."""
    if torch.compiler.is_compiling():
        return
    if not triton_available() or (device.type != "cuda" and not interpreting()):
        raise RuntimeError(
            f"the Triton memory kernels need triton and CUDA tensors (or TRITON_INTERPRET=1 for CPU "
            f"tensors); got tensors on {device}, triton importable: {TRITON_IMPORTABLE}. "
            "Choose another with model.set_memory_implementation('torch' | 'embedding_bag') or leave it unset."
        )
