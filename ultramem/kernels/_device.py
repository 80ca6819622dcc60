"""Where the Triton kernels can run (`ultramem.memory_implementations` decides when to use them)."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def triton_available() -> bool:
    """Triton is importable and can launch here: a CUDA device is present, or the interpreter is on."""
    return _triton_importable() and (interpreting() or torch.cuda.is_available())


def require_launchable(device: torch.device) -> None:
    """Raise a clear error before a launch that Triton could not perform on `device`. Skipped while torch.compile
    traces (Dynamo cannot trace `find_spec`; the eager call before it checked, and the launch itself would fail)."""
    if torch.compiler.is_compiling():
        return
    if not triton_available() or (device.type != "cuda" and not interpreting()):
        raise RuntimeError(
            f"the Triton memory kernels need triton and CUDA tensors (or TRITON_INTERPRET=1 for CPU "
            f"tensors); got tensors on {device}, triton importable: {_triton_importable()}. "
            "Choose another with model.set_memory_implementation('torch' | 'embedding_bag') or leave it unset."
        )
