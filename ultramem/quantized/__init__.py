"""Quantized value tables: rowwise int8 / int4 tables (scale and bias fused to each group of a row) for inference.

- `format`: the storage format, `quantize` / `dequantize`;
- `ops`: the lookup-reduce over a quantized table (`ultramem::quantized_bag_sum` on CPU, the dequantize-then-pool
  reference elsewhere);
- `stores`: the quantized value stores, registered in `ultramem.value_stores.VALUE_STORES` on import ("int8", "int4",
  "cpu-int8", "cpu-int4", "disk-int8", "disk-int4");
- `sharded`: the memory-parallel stores over quantized shards ("number-int8", "dimension-int4", ...), which
  `ultramem.parallel.apply_memory_parallel` picks for a model whose config has `memory_quantization`;
- `loading.from_pretrained_quantized`: load a model with its tables quantized (or a converted checkpoint);
- `python -m ultramem.quantize CKPT OUT --format int8|int4`: convert a checkpoint, streaming its tables.
"""

from ..value_stores import TableFormats, ValueStores
from .format import DEFAULT_INT4_GROUP_SIZE, FORMATS, QuantizationError, dequantize, quantize
from .loading import from_pretrained_quantized
from .ops import lookup_reduce_quantized, lookup_reduce_quantized_reference
from .sharded import SHARDED_STORES, QuantizedDimensionShardedValues, QuantizedNumberShardedValues
from .stores import (
    QUANTIZED_STORES,
    QuantizedCheckpoint,
    QuantizedDiskValueStore,
    QuantizedHostValueStore,
    QuantizedValueTable,
    store_name,
)

for _name, _store in {**QUANTIZED_STORES, **SHARDED_STORES}.items():
    ValueStores.register(_name, _store)
for _format in FORMATS:
    TableFormats.register(_format, from_pretrained_quantized)

__all__ = [
    "DEFAULT_INT4_GROUP_SIZE",
    "FORMATS",
    "QUANTIZED_STORES",
    "QuantizationError",
    "SHARDED_STORES",
    "QuantizedCheckpoint",
    "QuantizedDimensionShardedValues",
    "QuantizedDiskValueStore",
    "QuantizedHostValueStore",
    "QuantizedNumberShardedValues",
    "QuantizedValueTable",
    "dequantize",
    "from_pretrained_quantized",
    "lookup_reduce_quantized",
    "lookup_reduce_quantized_reference",
    "quantize",
    "store_name",
]
