"""Where the Triton kernels can run, and which path a `memory_kernel` setting selects."""

from __future__ import annotations

import importlib.util
import os

import torch

MEMORY_KERNELS = ("auto", "triton", "torch")


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def triton_available() -> bool:
    """Triton is importable and can launch here: a CUDA device is present, or the interpreter is on."""
    if importlib.util.find_spec("triton") is None:
        return False
    return interpreting() or torch.cuda.is_available()


def use_triton(memory_kernel: str, device: torch.device | str) -> bool:
    """Resolve `config.memory_kernel` for tensors on `device`.

    "auto" picks Triton on CUDA (when available) and the PyTorch path elsewhere; "triton" insists and
    raises if the kernels cannot run on `device`; "torch" always picks the PyTorch path.
    """
    if memory_kernel not in MEMORY_KERNELS:
        raise ValueError(f"memory_kernel must be one of {MEMORY_KERNELS}, got {memory_kernel!r}")
    device = torch.device(device)
    runnable = triton_available() and (device.type == "cuda" or interpreting())
    if memory_kernel == "triton" and not runnable:
        raise RuntimeError(
            f"memory_kernel='triton' needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU); "
            f"tensors are on {device}, triton importable: {importlib.util.find_spec('triton') is not None}. "
            "Use memory_kernel='auto' or 'torch'."
        )
    if memory_kernel == "auto":
        return runnable and device.type == "cuda"
    return memory_kernel == "triton"


def require_launchable(device: torch.device) -> None:
    """Raise a clear error before a launch that Triton could not perform on `device`."""
    use_triton("triton", device)
