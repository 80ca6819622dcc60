"""A full-size random-weight checkpoint of any UltraMem preset, streamed to safetensors, never held in memory.

    python -m ultramem.offload.random_checkpoint --preset ultramem-1.6b-x12 --dtype bfloat16 --output /tmp/u16b

Everything but the value tables is built and initialized in memory as the model would be (for 1.6B-x12 about
4 GB in bf16: the backbone, keys, projectors, the IVE bijection), then written; each value table is streamed
in chunks. Its rows are N(0, value_std) numbers from one random pool per checkpoint, each chunk taken at its
own random offset in the pool: rows differ, generating is free, and the write runs at disk speed (decoding
speed does not depend on the values). The file is written under a temporary name and renamed when complete.
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
from ..modeling_ultramem import MemoryInitScales, UltraMemForCausalLM
from ..tokenization import load_tokenizer
from .safetensors_file import INDEX_FILE

DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64"}
CHUNK_BYTES = 64 << 20
POOL_SLACK_BYTES = 4 << 20


def build_without_tables(config: UltraMemConfig, dtype: torch.dtype) -> UltraMemForCausalLM:
    """The model with every weight initialized except the value tables (left as `DeferredValueTable`)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = UltraMemForCausalLM(UltraMemConfig(**{**config.to_dict(), "memory_offload": "disk"}))
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def write_random_checkpoint(config: UltraMemConfig, folder: str | Path, dtype: torch.dtype, seed: int = 0) -> Path:
    """Write `config.json`, the tokenizer and a sharded safetensors checkpoint of a random `config` model; returns
    the index.

    One shard holds every weight but the value tables, then one shard per table: Transformers' loader maps each
    file whole with copy-on-write (commit charge), which Linux refuses for one file larger than memory.
    """
    torch.manual_seed(seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = build_without_tables(config, dtype)
    dense = {k: v for k, v in model.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    tables = {name: (config.memory_num_values, config.memory_value_dim) for name in model.get_value_table_names()}
    layouts = [[(k, v.dtype, list(v.shape)) for k, v in dense.items()]]
    layouts += [[(name, dtype, list(shape))] for name, shape in tables.items()]
    headers = [_header(layout) for layout in layouts]
    size = sum(total for _, total in headers)
    free = shutil.disk_usage(folder).free
    if size > free:
        raise OSError(
            f"not enough disk space in {folder}: the checkpoint needs {size / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
        )
    files = [f"model-{i + 1:05d}-of-{len(layouts):05d}.safetensors" for i in range(len(layouts))]
    std = MemoryInitScales.from_config(config).value_std
    pool = (torch.randn((CHUNK_BYTES + POOL_SLACK_BYTES) // dtype.itemsize) * std).to(dtype).view(torch.uint8)
    for file, (header, _), layout in zip(files, headers, layouts, strict=True):
        partial = folder / (file + ".partial")
        with open(partial, "wb") as handle:
            handle.write(struct.pack("<Q", len(header)) + header)
            if layout is layouts[0]:
                for tensor in dense.values():
                    handle.write(tensor.contiguous().view(-1).view(torch.uint8).numpy())
            else:
                ((_, _, (rows, cols)),) = layout
                _stream_random(handle, pool, rows * cols * dtype.itemsize, dtype.itemsize)
        os.replace(partial, folder / file)
    weight_map = {name: file for file, layout in zip(files, layouts, strict=True) for name, _, _ in layout}
    index = folder / INDEX_FILE
    index.write_text(json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=2))
    save_config_and_code(model, folder)
    load_tokenizer(model_max_length=config.max_position_embeddings).save_pretrained(folder)  # loadable as a whole
    return index


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


def _header(layout: list[tuple[str, torch.dtype, list[int]]]) -> tuple[bytes, int]:
    """The safetensors header of (name, dtype, shape) entries (padded to 8 bytes) and the file's total size."""
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, tensor_dtype, shape in layout:
        nbytes = torch.Size(shape).numel() * tensor_dtype.itemsize
        entries[name] = {"dtype": DTYPE_NAMES[tensor_dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return header, 8 + len(header) + offset


def _stream_random(handle, pool: torch.Tensor, nbytes: int, itemsize: int) -> None:
    """`nbytes` of the random pool, chunk by chunk, each chunk from its own element-aligned random offset."""
    view = memoryview(pool.numpy())
    slack = POOL_SLACK_BYTES // itemsize
    while nbytes > 0:
        length = min(CHUNK_BYTES, nbytes)
        start = int(torch.randint(slack, ())) * itemsize
        handle.write(view[start : start + length])
        nbytes -= length


def main(argv: list[str] | None = None) -> None:
    from ..presets import get_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, help="any UltraMem or dense preset of ultramem.presets")
    parser.add_argument("--output", type=Path, required=True, help="checkpoint folder")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--override", action="append", default=[], help="config field=json value, e.g. memory_num_keys=896"
    )
    args = parser.parse_args(argv)
    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.override)}
    config = get_config(args.preset, **overrides)
    if not isinstance(config, UltraMemConfig):
        raise SystemExit(f"--preset {args.preset}: only UltraMem and dense presets (UltraMemConfig) are supported")
    path = write_random_checkpoint(config, args.output, getattr(torch, args.dtype), args.seed)
    print(f"wrote {path} ({json.loads(path.read_text())['metadata']['total_size'] / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
