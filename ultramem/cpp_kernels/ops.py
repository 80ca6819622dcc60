"""`tucker_topk` and `lookup_reduce` through the C++ CPU kernels (`memory_kernels.cpp`), same contracts as their
references in `ultramem.memory_ops`; the kernels are built on first use.

Where no gradient is wanted (inference, decoding) each is one operator: a decode step's selection was about 35 small
aten operators a memory layer, and its lookup nine, each paying its dispatch and, in a model's step, cold caches. Where
a gradient is wanted the selection's winners come from the kernel and their per-core scores are recomputed with
autograd (as the Triton path does), and the lookup is the embedding_bag path's. Signed candidates, and tensors on
other devices, take the reference.
"""

from __future__ import annotations

import functools
import logging
import shutil
from pathlib import Path

import torch

from ultramem.embedding_bag_ops import lookup_reduce_embedding_bag
from ultramem.kernels.candidate_topk import fused_selection_outputs
from ultramem.memory_ops import tucker_topk as reference_tucker_topk

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("memory_kernels.cpp")
LIBRARY = "ultramem_cpu_kernels"  # built under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions)


def _buildable() -> bool:
    """A C++ compiler and ninja are there, which `torch.utils.cpp_extension` needs to build the kernels."""
    from torch.utils import cpp_extension  # imports setuptools: only where the kernels are asked for

    return shutil.which(cpp_extension.get_cxx_compiler()) is not None and cpp_extension.is_ninja_available()


@functools.cache
def _build() -> str | None:
    """Build (once per machine and source, about ten seconds) and load the kernels as `torch.ops.ultramem_cpu`; the
    reason they could not be, else None. Cached, so a machine that cannot build them tries once per process."""
    from torch.utils import cpp_extension

    if not _buildable():
        return f"no C++ compiler ({cpp_extension.get_cxx_compiler()}) or no ninja on PATH"
    logger.info("loading ultramem's C++ CPU kernels (built on first use on this machine)")
    try:
        cpp_extension.load(
            name=LIBRARY,
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-ffp-contract=off"],  # no fused multiply-add: the reference's rounding
            is_python_module=False,
        )
    except (OSError, RuntimeError, ImportError) as error:
        return f"{type(error).__name__}: {str(error).strip().splitlines()[-1]}"
    torch.library.register_fake("ultramem_cpu::tucker_topk")(_tucker_topk_fake)
    torch.library.register_fake("ultramem_cpu::lookup_reduce")(_lookup_reduce_fake)
    return None


def load_cpp_kernels() -> None:
    """Build and load the kernels, or raise one line saying why they cannot be. Nothing while torch.compile traces (a
    build has no place in a graph): an eager call, or this one, loads them before."""
    if torch.compiler.is_compiling():
        return
    failure = _build()
    if failure is not None:
        raise RuntimeError(
            f"memory_implementation='cpp' builds its C++ kernels on first use and could not: {failure}. Install a C++ "
            "compiler and ninja (`pip install ninja`), or choose 'embedding_bag' (the CPU default) or 'torch'."
        )


def _tucker_topk_fake(axis_scores, leading_vectors, cores, topk):
    batch, num_heads = axis_scores.shape[0], axis_scores.shape[2]
    index = axis_scores.new_empty((batch, num_heads, topk), dtype=torch.int64)
    return index, axis_scores.new_empty((batch, num_heads, topk, cores.shape[1]))


def _lookup_reduce_fake(values, rows, groups, scores, num_groups):
    return values.new_empty((rows.shape[0], num_groups, values.shape[1]))


def _wants_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)


def tucker_topk(
    axis_scores: torch.Tensor,
    cores: torch.Tensor,
    leading_vectors: torch.Tensor,
    topk: int,
    signed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Virtual addresses x * n + y (..., H, m) and per-core scores (..., H, m, h); see memory_ops for the contract."""
    if signed or axis_scores.device.type != "cpu":
        return reference_tucker_topk(axis_scores, cores, leading_vectors, topk, signed)
    load_cpp_kernels()
    inputs = axis_scores.reshape(-1, *axis_scores.shape[-4:]), leading_vectors, cores  # (B, 2, H, r, n): a view
    if not axis_scores.dtype == cores.dtype == leading_vectors.dtype:  # as the reference promotes them
        dtype = torch.promote_types(torch.promote_types(axis_scores.dtype, cores.dtype), leading_vectors.dtype)
        inputs = [tensor.to(dtype) for tensor in inputs]
    if _wants_grad(axis_scores, cores):
        inputs = [tensor.detach() for tensor in inputs]
    index, scores = torch.ops.ultramem_cpu.tucker_topk(*inputs, topk)
    return fused_selection_outputs(index, scores, axis_scores, cores)


def lookup_reduce(
    values: torch.Tensor, rows: torch.Tensor, groups: torch.Tensor, scores: torch.Tensor, num_groups: int
) -> torch.Tensor:
    """(T, E, Dv) pooled values in the dtype of `values`; see memory_ops for the contract."""
    if values.device.type != "cpu" or _wants_grad(values, scores):
        return lookup_reduce_embedding_bag(values, rows, groups, scores, num_groups)
    load_cpp_kernels()
    return torch.ops.ultramem_cpu.lookup_reduce(values, rows, groups, scores, num_groups)
