"""A full-size random-weight checkpoint of any UltraMem preset, streamed to safetensors, never held in memory.

    python -m ultramem.offload.random_checkpoint --preset ultramem-1.6b-x12 --dtype bfloat16 --output /tmp/u16b
    python -m ultramem.offload.random_checkpoint --preset ultramem-1.6b-x12 --memory-quantization int4 --output /tmp/q4

Everything but the value tables is built and initialized in memory as the model would be (for 1.6B-x12 about
4 GB in bf16: the backbone, keys, projectors, the IVE bijection), then written; each value table is streamed
in chunks. Its rows come from one random pool per table width, N(0, init_std) numbers, each chunk taken at its own
random offset in the pool: rows differ, generating is free, and the write runs at disk speed (decoding speed does
not depend on the values). With `--memory-quantization int8|int4` the pool is random rows quantized by
`ultramem.quantized.format.quantize` and the offsets are whole rows, so every row is a valid quantized row (its
dequantization is a row of N(0, init_std) numbers, rounded) and the checkpoint loads as a converted one would. Each
file is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
from pathlib import Path

import torch

from ..configuration_ultramem import UltraMemConfig
from ..modeling_ultramem import UltraMemForCausalLM
from ..quantized.format import FORMATS, QuantizationError, quantize, quantized_width, resolve_group_size
from ..quantized.stores import (
    METADATA_FORMAT,
    METADATA_GROUP,
    TABLE_KEY,
    check_quantizable,
    model_group_size,
    table_geometry,
    table_group_size,
)
from ..tokenization import load_tokenizer
from .safetensors_file import INDEX_FILE

DTYPE_NAMES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.uint8: "U8",
}
CHUNK_BYTES = 64 << 20
POOL_SLACK_BYTES = 4 << 20
POOL_BLOCK_ROWS = 8192  # float rows generated and quantized at once while building a quantized pool


def build_without_tables(config: UltraMemConfig, dtype: torch.dtype) -> UltraMemForCausalLM:
    """The model with every weight initialized except the value tables (left as `DeferredValueTable`)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = UltraMemForCausalLM(UltraMemConfig(**{**config.to_dict(), "memory_offload": "disk"}))
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def write_random_checkpoint(
    config: UltraMemConfig,
    folder: str | Path,
    dtype: torch.dtype,
    seed: int = 0,
    memory_quantization: str | None = None,
    group_size: int | None = None,
) -> Path:
    """Write `config.json`, the tokenizer and a sharded safetensors checkpoint of a random `config` model; returns
    the index.

    One shard holds every weight but the value tables, then one shard per table: Transformers' loader maps each
    file whole with copy-on-write (commit charge), which Linux refuses for one file larger than memory.
    `memory_quantization` ("int8" | "int4", `group_size` columns per scale/bias group, default the format's) writes
    the tables in the layout of `ultramem.quantized.format` and records the format in config.json and each table
    shard's metadata, as `python -m ultramem.quantize` does; `dtype` is then the rest of the model's.
    """
    if memory_quantization is not None:  # checked (one line) before any model is built
        if not config.memory_layers and not config.ngram_layers:
            raise QuantizationError(f"memory_quantization={memory_quantization!r}: this config has no value tables")
        check_quantizable(config, memory_quantization)
        group_size = model_group_size(memory_quantization, config, group_size)
    torch.manual_seed(seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = build_without_tables(config, dtype)
    dense = {k: v for k, v in model.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    tables = {name: model.get_submodule(name.removesuffix(".weight")) for name in model.get_value_table_names()}
    # the tables `memory_quantization` applies to are quantized (as the converter does); any other stays in `dtype`
    formats = {name: memory_quantization if TABLE_KEY.search(name) else None for name in tables}
    writers = {name: _TableWriter(table, dtype, table_geometry(config, name)[1], formats[name],
                                  formats[name] and table_group_size(formats[name], config, name, group_size))
               for name, table in tables.items()}  # fmt: skip
    table_metadata = {}
    if memory_quantization is not None:
        table_metadata = {METADATA_FORMAT: memory_quantization, METADATA_GROUP: str(group_size)}
    layouts = [([(k, v.dtype, list(v.shape)) for k, v in dense.items()], {})]
    layouts += [([(name, writer.dtype, writer.shape)], table_metadata) for name, writer in writers.items()]
    headers = [_header(layout, metadata) for layout, metadata in layouts]
    size = sum(total for _, total in headers)
    free = shutil.disk_usage(folder).free
    if size > free:
        raise OSError(
            f"not enough disk space in {folder}: the checkpoint needs {size / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
        )
    files = [f"model-{i + 1:05d}-of-{len(layouts):05d}.safetensors" for i in range(len(layouts))]
    pools: dict[tuple, torch.Tensor] = {}  # one random pool per table kind (width, init scale, format)
    for file, (header, _), (layout, _) in zip(files, headers, layouts, strict=True):
        partial = folder / (file + ".partial")
        with open(partial, "wb") as handle:
            handle.write(struct.pack("<Q", len(header)) + header)
            if file == files[0]:
                for tensor in dense.values():
                    handle.write(tensor.contiguous().view(-1).view(torch.uint8).numpy())
            else:
                ((name, _, _),) = layout
                writers[name].write(handle, pools)
        os.replace(partial, folder / file)
    weight_map = {name: file for file, (layout, _) in zip(files, layouts, strict=True) for name, _, _ in layout}
    index = folder / INDEX_FILE
    index.write_text(json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=2))
    if memory_quantization is not None:
        model.config.memory_quantization, model.config.memory_quantization_group_size = memory_quantization, group_size
    save_config_and_code(model, folder)
    load_tokenizer(model_max_length=config.max_position_embeddings).save_pretrained(folder)  # loadable as a whole
    return index


class _TableWriter:
    """Streams one random value table: its shape and dtype in the file, and its rows from a shared random pool.

    Float tables take each chunk at an element-aligned random offset of a pool of N(0, init_std) numbers; quantized
    tables at a row-aligned offset of a pool of quantized random rows (a quantized row is only valid whole). The
    table's shape comes from the model's `DeferredValueTable` (value, pre-value and n-gram tables differ in width; an
    n-gram table's rows, zero at init, are zero here too)."""

    def __init__(self, table: torch.nn.Module, dtype: torch.dtype, num_cores: int, format: str | None, group: int):
        self.rows, self.value_dim, self.std = table.num_embeddings, table.embedding_dim, table.init_std
        self.format, self.num_cores = format, num_cores
        if format is None:
            self.dtype, self.unit = dtype, dtype.itemsize
            self.shape = [self.rows, self.value_dim]
        else:
            self.group_size = resolve_group_size(format, self.value_dim, num_cores, group)
            self.dtype, self.unit = torch.uint8, quantized_width(format, self.value_dim, self.group_size)
            self.shape = [self.rows, self.unit]
        self.pool_key = (self.dtype, self.value_dim, self.std, format, num_cores, getattr(self, "group_size", None))

    def _pool(self) -> torch.Tensor:
        """Random bytes to copy from: CHUNK_BYTES plus the slack of random offsets, in whole units."""
        units = -(-(CHUNK_BYTES + POOL_SLACK_BYTES) // self.unit)
        if self.format is None:
            return (torch.randn(units) * self.std).to(self.dtype).view(torch.uint8)
        pool = torch.empty(units, self.unit, dtype=torch.uint8)
        for start in range(0, units, POOL_BLOCK_ROWS):
            rows = torch.randn(min(POOL_BLOCK_ROWS, units - start), self.value_dim) * self.std
            pool[start : start + rows.shape[0]] = quantize(rows, self.format, self.num_cores, self.group_size)
        return pool.view(-1)

    def write(self, handle, pools: dict[tuple, torch.Tensor]) -> None:
        """The table's rows * unit bytes, chunk by chunk, each chunk from its own unit-aligned random offset."""
        if self.pool_key not in pools:
            pools[self.pool_key] = self._pool()
        view = memoryview(pools[self.pool_key].numpy())
        chunk, slack = CHUNK_BYTES - CHUNK_BYTES % self.unit, POOL_SLACK_BYTES // self.unit
        nbytes = self.rows * self.value_dim * self.dtype.itemsize if self.format is None else self.rows * self.unit
        while nbytes > 0:
            length = min(chunk, nbytes)
            start = int(torch.randint(slack, ())) * self.unit
            handle.write(view[start : start + length])
            nbytes -= length


def save_config_and_code(model: UltraMemForCausalLM, folder: Path) -> None:
    """What `save_pretrained` writes besides the weights, the way it writes it: the dtype and architecture in the
    config, the model code files with every class in `auto_map` (`custom_object_save`), the generation config. So the
    folder loads like a saved one: `ultramem` installed and not imported, or not installed (`trust_remote_code`)."""
    from transformers.dynamic_module_utils import custom_object_save

    model.config.dtype = str(model.dtype).removeprefix("torch.")
    model.config.architectures = [type(model).__name__]
    custom_object_save(model, folder, config=model.config)
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)


def _header(layout: list[tuple[str, torch.dtype, list[int]]], metadata: dict[str, str]) -> tuple[bytes, int]:
    """The safetensors header of (name, dtype, shape) entries (padded to 8 bytes) and the file's total size."""
    entries, offset = {"__metadata__": {"format": "pt", **metadata}}, 0
    for name, tensor_dtype, shape in layout:
        nbytes = torch.Size(shape).numel() * tensor_dtype.itemsize
        entries[name] = {"dtype": DTYPE_NAMES[tensor_dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return header, 8 + len(header) + offset


def main(argv: list[str] | None = None) -> None:
    from ..presets import get_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, help="any UltraMem or dense preset of ultramem.presets")
    parser.add_argument("--output", type=Path, required=True, help="checkpoint folder")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--memory-quantization", choices=FORMATS, default=None, help="write quantized value tables")
    parser.add_argument("--group-size", type=int, default=None, help="columns per scale/bias group (divides Dv/h)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--override", action="append", default=[], help="config field=json value, e.g. memory_num_keys=896"
    )
    args = parser.parse_args(argv)
    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.override)}
    config = get_config(args.preset, **overrides)
    if not isinstance(config, UltraMemConfig):
        raise SystemExit(f"--preset {args.preset}: only UltraMem and dense presets (UltraMemConfig) are supported")
    if args.group_size is not None and args.memory_quantization is None:
        raise SystemExit("--group-size is the quantized tables' group: give --memory-quantization int8|int4 with it")
    try:
        path = write_random_checkpoint(
            config, args.output, getattr(torch, args.dtype), args.seed, args.memory_quantization, args.group_size
        )
    except QuantizationError as error:
        raise SystemExit(f"error: {error}") from None
    print(f"wrote {path} ({json.loads(path.read_text())['metadata']['total_size'] / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
