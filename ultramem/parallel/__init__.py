"""Memory parallelism: value tables sharded over data-parallel ranks, number-wise or dimension-wise.

Importing this package registers the "number" and "dimension" value stores (`ultramem.value_stores`).
"""

from ultramem.parallel.comm import count_bytes
from ultramem.parallel.dimension import DimensionShardedValues
from ultramem.parallel.number import NumberShardedValues
from ultramem.parallel.setup import MEMORY_PARALLEL_CHOICES, apply_memory_parallel, plan_memory_parallel
from ultramem.value_stores import ValueStores

ValueStores.register("number", NumberShardedValues)
ValueStores.register("dimension", DimensionShardedValues)

__all__ = [
    "MEMORY_PARALLEL_CHOICES",
    "DimensionShardedValues",
    "NumberShardedValues",
    "apply_memory_parallel",
    "count_bytes",
    "plan_memory_parallel",
]
