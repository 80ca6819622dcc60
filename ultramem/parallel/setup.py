"""The `memory_parallel` setting: validate it against the config and world, build the mesh, install the stores.

It only changes where the values live during training or loading; a saved checkpoint means the same thing.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ultramem.configuration_ultramem import TUCKER
from ultramem.ngram_memory import ngram_table_rows
from ultramem.parallel.dimension import check_dimension_split
from ultramem.parallel.number import NumberShardedValues
from ultramem.parallel.volume import VOLUMES, LookupShape
from ultramem.value_stores import DeferredValueTable, MemoryValueTable, value_store, value_tables

MEMORY_PARALLEL_CHOICES = ("none", "number", "dimension", "auto")
logger = logging.getLogger(__name__)


def memory_parallel_mesh(size: int | None = None) -> DeviceMesh:
    """A (replicate, shard) mesh over all ranks: tables are split inside groups of `size` consecutive ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "memory_parallel needs an initialized torch.distributed process group (launch with torchrun, "
            "accelerate launch or deepspeed); without one the only allowed choice is memory_parallel='none'"
        )
    world = dist.get_world_size()
    size = size or world
    if size < 1 or world % size:
        allowed = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"memory_parallel_size={size} does not divide the world size {world}; allowed: {allowed}")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, (world // size, size), mesh_dim_names=("replicate", "shard"))


def check_quantization_groups(
    format: str, value_dim: int, group_size: int, size: int, field: str = "memory_value_dim"
) -> None:
    """Quantized tables split dimension-wise only along whole quantization groups (their scale and bias stay with
    their columns): the size must divide each row's group count (`field`: the row width's config field)."""
    num_groups = value_dim // group_size
    group = "memory_quantization_group_size" if field == "memory_value_dim" else "its group size"
    if num_groups % size:
        raise ValueError(
            f"memory_parallel='dimension' splits each {format} row's {num_groups} quantization groups "
            f"({field}={value_dim} / {group}={group_size}) over {size} ranks: the "
            f"size must divide {num_groups}; choose another memory_parallel_size, or memory_parallel='number'"
        )


def sharded_store_name(partitioning: str, format: str | None) -> str:
    """The registered store of a partitioning for tables of quantization `format`: "number", "dimension-int4", ..."""
    return f"{partitioning}-{format}" if format else partitioning


def lookup_shape(config, tokens: int) -> LookupShape:
    """The formulas' inputs for an UltraMem config and `tokens` per rank per memory layer call; the bytes of a row
    and of a pooled element as the number-wise store of the config's tables sends them (the same for dimension)."""
    return LookupShape(
        tokens=tokens,
        slots=config.memory_heads * config.memory_topk,
        value_dim=config.memory_value_dim,
        num_cores=config.mcs_cores if config.retrieval_mode == TUCKER else 1,
        num_groups=config.ive_expansion,
        value_bytes=torch.empty((), dtype=config.dtype or torch.float32).element_size(),
        **value_store(sharded_store_name("number", config.memory_quantization)).sent_sizes(config),
    )


def fitting_partitionings(config, size: int) -> dict[str, str]:
    """Partitioning -> why it does not fit ('' when it fits), for a shard group of `size` ranks: the memory layers'
    tables and the n-gram memories' (whose rows are sums of primes, and whose row width is `ngram_head_dim`)."""
    reasons = {}
    shape = lookup_shape(config, 1)
    num_rows = getattr(config, "value_pool_size", None) or config.memory_num_values  # a pool's rows, else a layer's
    pre_value_dim = getattr(config, "pre_value_dim", 0)
    has_memory_layers = bool(getattr(config, "memory_layers", None))
    ngram_rows = ngram_table_rows(config) if getattr(config, "ngram_layers", None) else []
    ngram_name = "model.ngram_memories.{}.values.weight".format

    def check_number() -> None:
        if has_memory_layers:
            NumberShardedValues.check_fits(torch.Size([num_rows, 0]), size)
        for idx, rows in enumerate(ngram_rows):
            NumberShardedValues.check_fits(torch.Size([rows, 0]), size, name=ngram_name(idx))

    def check_dimension() -> None:
        if has_memory_layers:
            check_dimension_split(shape.value_dim, shape.num_cores, size)
            if config.memory_quantization and config.memory_quantization_group_size:  # recorded when the tables load
                check_quantization_groups(
                    config.memory_quantization, shape.value_dim, config.memory_quantization_group_size, size
                )
        if pre_value_dim:
            check_dimension_split(pre_value_dim, shape.num_cores, size, "pre_value_dim")
        if ngram_rows:  # (quantized: the store checks the groups of the n-gram rows when it shards them)
            check_dimension_split(config.ngram_head_dim, 1, size, "ngram_head_dim")

    for name, check in (("number", check_number), ("dimension", check_dimension)):
        try:
            check()
            reasons[name] = ""
        except ValueError as error:
            reasons[name] = str(error)
    return reasons


def plan_memory_parallel(config, mode: str, size: int, tokens: int) -> tuple[str, dict[str, str]]:
    """(value store name, its options) for `mode`; `auto` and the number-wise pooling site follow the volumes."""
    if mode not in MEMORY_PARALLEL_CHOICES:
        raise ValueError(f"memory_parallel={mode!r}: allowed: {', '.join(MEMORY_PARALLEL_CHOICES)}")
    reasons = fitting_partitionings(config, size)
    if mode != "auto" and reasons[mode]:
        raise ValueError(reasons[mode])
    shape = lookup_shape(config, tokens)
    volumes = {name: sum(formula(shape, size).values()) for name, formula in VOLUMES.items()}
    family = {"number": ("number", "number_owner"), "dimension": ("dimension",), "auto": tuple(VOLUMES)}[mode]
    candidates = [name for name in family if not reasons[name.removesuffix("_owner")]]
    if not candidates:
        raise ValueError(f"memory_parallel='auto' with memory_parallel_size={size}: {'; '.join(reasons.values())}")
    choice = min(candidates, key=volumes.__getitem__)
    logger.warning(
        "memory_parallel=%s over %d ranks: %s (predicted bytes sent per rank and memory layer forward, %d tokens: %s)",
        mode, size, choice, tokens, ", ".join(f"{name} {volumes[name]:.0f}" for name in VOLUMES),
    )  # fmt: skip
    if choice == "dimension":
        return "dimension", {"num_cores": shape.num_cores}
    return "number", {"pool_at": "owner" if choice == "number_owner" else "source"}


def check_tables_shardable(model: torch.nn.Module, mode: str) -> None:
    """One line when a table is already served by another store (offloaded, or quantized whole in memory): the
    sharded stores take float tables in memory, or deferred ones that each rank reads its part of."""
    for name, table in value_tables(model).items():
        if isinstance(table, (MemoryValueTable, DeferredValueTable)):
            continue
        raise ValueError(
            f"memory_parallel={mode!r} shards tables each rank reads its part of, but {name} is already served by "
            f"{type(table).__name__} (memory_offload / memory_quantization loaded it whole): allowed: memory_offload="
            "None, and quantized tables loaded inside ultramem.value_stores.deferred_value_tables() with "
            "apply_memory_parallel(..., checkpoint=path)"
        )


def apply_memory_parallel(
    model: torch.nn.Module, mode: str, size: int | None = None, tokens: int = 1, checkpoint: str | None = None
) -> str:
    """Shard every value table of `model` per `mode` over a mesh of `size` ranks; returns the store chosen.

    `tokens` (per rank and step) feeds `auto`. Tables built deferred (`deferred_value_tables`) are read from
    the safetensors of `checkpoint` (a folder or Hub id) when given, else drawn shard by shard. The tables leave
    DDP's gradient all-reduce: their shards' gradients are made data-parallel means by the stores themselves.
    A config with `memory_quantization` gets the quantized stores ("number-int8", ...: `ultramem.quantized.sharded`).
    """
    if mode not in MEMORY_PARALLEL_CHOICES:
        raise ValueError(f"memory_parallel={mode!r}: allowed: {', '.join(MEMORY_PARALLEL_CHOICES)}")
    if mode == "none":
        return "local"
    check_tables_shardable(model, mode)
    mesh = memory_parallel_mesh(size)
    store, options = plan_memory_parallel(model.config, mode, mesh.size(1), tokens)
    store = sharded_store_name(store, model.config.memory_quantization)  # quantized: `ultramem.quantized.sharded`
    if checkpoint is not None:
        options["checkpoint"] = value_store(store).find_checkpoint(checkpoint)
    model.set_value_store(store, mesh=mesh, dtype=model.dtype, **options)
    model._ddp_params_and_buffers_to_ignore = model.get_value_table_names()
    return store
