"""Triton kernels of the memory layer, with the contract of `ultramem.memory_ops` (their reference).

`lookup_reduce`, `lookup_dot`, `tucker_candidate_topk` and `tucker_topk` take exactly the arguments of the functions
of the same name in `ultramem.memory_ops`; `fused_selection()` turns on `tucker_topk`'s one-kernel selection
(opt-in). Importing this package never imports Triton: kernels are compiled on first launch. See README.md in this
folder.
"""

from types import SimpleNamespace

from ultramem.kernels._device import triton_available
from ultramem.kernels.candidate_topk import tucker_candidate_topk
from ultramem.kernels.lookup_dot import lookup_dot
from ultramem.kernels.lookup_reduce import lookup_reduce
from ultramem.kernels.tucker_topk import fused_selection, tucker_topk
from ultramem.memory_implementations import MemoryImplementations

TRITON_MEMORY_OPS = SimpleNamespace(
    lookup_reduce=lookup_reduce,
    tucker_candidate_topk=tucker_candidate_topk,
    tucker_topk=tucker_topk,
    lookup_dot=lookup_dot,
    available=triton_available,
)
MemoryImplementations.register("triton", TRITON_MEMORY_OPS)

__all__ = [
    "TRITON_MEMORY_OPS",
    "fused_selection",
    "lookup_dot",
    "lookup_reduce",
    "triton_available",
    "tucker_candidate_topk",
    "tucker_topk",
]
