"""The memory layers on vLLM's flat token batch (T, D): `modeling_ultramem`'s own modules, not a second copy.

Each memory layer is the Transformers model's `UltraMemMemoryLayer` (its query module with the query normalisation,
retrieval, PEER / Memory+ gates, IVE, projectors, value stores), run on the batch as one sequence (1, T, D) with no
cache and no padding. Everything in it is per token except the query convolution, which needs each request's last k-1
inputs: that one submodule is swapped for `QueryConv`, a vLLM state layer with the same parameter names. Quantized
tables are the package's `QuantizedValueTable` (the uint8 table, read by the quantized lookup op; never dequantized
whole). So whatever the Transformers model computes at inference, the served model computes with the same code.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import CacheConfig, ModelConfig
from vllm.distributed import get_tensor_model_parallel_world_size

from ultramem.memory_query import MemoryInputs
from ultramem.modeling_ultramem import MemoryInitScales, UltraMemMemoryLayer, build_value_tables
from ultramem.quantized import QuantizedValueTable
from ultramem.quantized.format import quantized_width
from ultramem.quantized.stores import table_geometry, table_group_size
from ultramem.value_stores import DeferredValueTable, MemoryValueTable, deferred_value_tables

from .query_conv import QueryConv
from .tensor_parallel import TensorParallelRows


def build_memory_layer(
    config, memory_idx: int, model_config: ModelConfig | None, cache_config: CacheConfig | None, prefix: str
) -> UltraMemMemoryLayer:
    """The Transformers memory layer `memory_idx`, its query conv (kernel > 1) a vLLM state layer, its tables this
    rank's (`served_tables`). `prefix`: the layer's module name (the conv's state is bound by name)."""
    with deferred_value_tables():
        layer = UltraMemMemoryLayer(config, memory_idx)
    conv = layer.query.conv
    if conv is not None and conv.kernel_size > 1:
        layer.query.conv = QueryConv(
            config.hidden_size,
            conv.kernel_size,
            model_config,
            cache_config,
            f"{prefix}.query.conv",
            span=state_span(config),
        )
    if layer.values is not None:
        layer.values, layer.pre_values = served_tables(
            config, f"memory_layers.{memory_idx}.values", layer.values, layer.pre_values, config.memory_quantization
        )
    return layer


def state_span(config) -> int:
    """The inputs every conv state layer of the model spans (its state: the last span - 1, in (D, span - 1)): the
    longest of the query conv's kernel, an n-gram memory's dilated conv ((k-1) N + 1) and its token window (N). One
    shape for all of them, so that vLLM keeps them in one KV cache group (`QueryConv`)."""
    spans = [config.query_conv_kernel_size] if config.use_query_conv and config.memory_layers else []
    if config.ngram_layers:
        spans += [(config.ngram_conv_kernel_size - 1) * config.ngram_order + 1, config.ngram_order]
    return max(spans, default=1)


def build_value_pool(config) -> tuple[nn.Module | None, nn.Module | None]:
    """The value pool and pre-value pool shared by the memory layers (`value_pool_size`), this rank's rows of them."""
    if config.value_pool_size is None:
        return None, None
    with deferred_value_tables():
        values, pre_values = build_value_tables(config, config.value_pool_size, MemoryInitScales.from_config(config))
    return served_tables(config, "value_pool", values, pre_values, None)


def served_tables(
    config, name: str, values: DeferredValueTable, pre_values: DeferredValueTable | None, quantization: str | None
) -> tuple[nn.Module, nn.Module | None]:
    """The value (and pre-value) table in place of their placeholders: float, or the values (module `name`) in
    `quantization`'s format; across a tensor-parallel group of P ranks, this rank's N/P rows behind
    `TensorParallelRows`."""
    size = get_tensor_model_parallel_world_size()

    def table(deferred: DeferredValueTable, quantized: bool) -> nn.Module:
        rows = deferred.num_embeddings // size
        if quantized:
            local = quantized_table(config, name, rows)
        else:
            local = MemoryValueTable(rows, deferred.embedding_dim, deferred.init_std)
        return local if size == 1 else TensorParallelRows(local, deferred.num_embeddings)

    return table(values, bool(quantization)), None if pre_values is None else table(pre_values, False)


def quantized_table(config, name: str, num_rows: int) -> QuantizedValueTable:
    """An empty uint8 table `name` of the config's format, with the group size the checkpoint's has (an n-gram
    table's rows may take another than the memory layers'); the loader fills it with the checkpoint's."""
    format = config.memory_quantization
    value_dim = table_geometry(config, name)[0]
    group_size = table_group_size(format, config, name, config.memory_quantization_group_size)
    width = quantized_width(format, value_dim, group_size)
    return QuantizedValueTable(torch.empty(num_rows, width, dtype=torch.uint8), format, group_size, value_dim)


def run_memory_layers(
    layers: list[UltraMemMemoryLayer], hidden_states: torch.Tensor, stores: tuple | None
) -> torch.Tensor:
    """The summed outputs (T, D) of `layers` on the flat batch (T, D), as `modeling_ultramem` sums them."""
    batch = hidden_states.unsqueeze(0)  # one "sequence": no mask, no cache; the conv state is vLLM's
    outputs = [layer(batch, MemoryInputs(stores=stores))[0] for layer in layers]
    return outputs[0] if len(outputs) == 1 else torch.stack(outputs).sum(0)
