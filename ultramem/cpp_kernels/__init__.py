"""C++ kernels of the memory layer for CPU tensors, with the contract of `ultramem.memory_ops` (their reference):
TDQKR's whole selection and the lookup-reduce, one operator each where no gradient is wanted.

`import ultramem` registers them as the memory implementation "cpp" (`from_pretrained(..., memory_implementation=
"cpp")` or `model.set_memory_implementation("cpp")`). They are compiled on first use with the machine's C++ compiler
and ninja (`torch.utils.cpp_extension`, about ten seconds, cached per machine), so the implementation is opted into
rather than the CPU default.
"""

from types import SimpleNamespace

from ultramem.cpp_kernels.ops import load_cpp_kernels, lookup_reduce, tucker_topk
from ultramem.embedding_bag_ops import lookup_dot_embedding_bag
from ultramem.memory_implementations import MemoryImplementations
from ultramem.memory_ops import tucker_candidate_topk

CPP_MEMORY_OPS = SimpleNamespace(
    lookup_reduce=lookup_reduce,
    tucker_candidate_topk=tucker_candidate_topk,
    tucker_topk=tucker_topk,
    lookup_dot=lookup_dot_embedding_bag,
)  # no `available()`: never a device's default, it is only used where asked for
MemoryImplementations.register("cpp", CPP_MEMORY_OPS)

__all__ = ["CPP_MEMORY_OPS", "load_cpp_kernels", "lookup_reduce", "tucker_topk"]
