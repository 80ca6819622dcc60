"""Convert an UltraMem checkpoint's value tables to int8 / int4, streaming: never a whole table in memory.

    python -m ultramem.quantize CHECKPOINT OUT --format int8|int4 [--group-size N]

Each table stays one tensor under its key (uint8, the layout of `ultramem.quantized.format`), quantized row block by
row block from the memory-mapped source; every other tensor is copied byte for byte, in the same files (a sharded
checkpoint stays sharded, its index rewritten); the tokenizer and other files are copied, and config.json records the
format (`memory_quantization`, `memory_quantization_group_size`) so the result loads as what it is. The model code is
the installed package's, as `save_pretrained` writes it: `trust_remote_code=True` runs that copy, which must know the
quantized format (a float checkpoint's copy may predate it).
The tables are each memory layer's value table and each n-gram memory's (Engram); an n-gram table's rows take the
group size where it divides them, else the format's default for them (`ultramem.quantized.stores.table_group_size`).
Refused with one line before any work: a checkpoint already quantized, one with neither memory layers nor n-gram
memories, one whose tables the quantized stores do not serve (UltraMemV2's and Memory+'s shared value pool, PEER
pre-values), a group size that does not divide the MCS chunk, an output folder that is not empty, not enough free
disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
from pathlib import Path

import torch

from .configuration_ultramem import PEER, PEER_GELU, UltraMemConfig, UltraMemConfigError
from .offload.safetensors_file import INDEX_FILE, SAFETENSORS_DTYPES, SINGLE_FILE, read_header
from .quantized.format import FORMATS, QuantizationError, quantize, quantized_width
from .quantized.stores import (
    METADATA_FORMAT,
    METADATA_GROUP,
    TABLE_KEY,
    model_group_size,
    table_geometry,
    table_group_size,
)
from .value_stores import is_ngram_table

COPY_BYTES = 64 << 20


def _files(checkpoint: Path) -> list[str]:
    if (checkpoint / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    if (checkpoint / INDEX_FILE).is_file():
        return sorted(set(json.loads((checkpoint / INDEX_FILE).read_text())["weight_map"].values()))
    raise QuantizationError(f"{checkpoint} has no {SINGLE_FILE} or {INDEX_FILE} to convert")


def _check_convertible(checkpoint: Path, config: dict, format: str) -> UltraMemConfig:
    """One line when the model has nothing the format applies to, or tables that no quantized store serves (the
    loader would refuse the result: the config allows neither with `memory_quantization`); else the model's config."""
    if not config.get("memory_layers") and not config.get("ngram_layers"):
        raise QuantizationError(
            f"{checkpoint} has no memory layers (memory_layers={config.get('memory_layers')!r}): there are no value "
            f"tables to quantize, nor n-gram tables (ngram_layers={config.get('ngram_layers')!r}); use the checkpoint "
            "as it is"
        )
    unserved = []
    if config.get("value_gate") in (PEER, PEER_GELU):
        unserved.append(f"value_gate={config['value_gate']!r} (PEER pre-value tables)")
    if config.get("value_pool_size") is not None:
        unserved.append(f"value_pool_size={config['value_pool_size']} (a value pool shared by the memory layers)")
    if unserved:
        raise QuantizationError(
            f"{checkpoint} has {' and '.join(unserved)}: --format {format} covers only each memory layer's own value "
            "table (UltraMemV2 and Memory+ are not supported); keep its float tables, offloaded with "
            "from_pretrained(path, memory_offload='cpu' | 'disk') if they do not fit in memory"
        )
    try:  # anything else the loader's config would refuse with this format
        return UltraMemConfig.from_dict({**config, "memory_quantization": format})
    except UltraMemConfigError as error:
        raise QuantizationError(f"{checkpoint} cannot hold {format} tables: {error}") from None


def _model_code() -> list[Path]:
    """The package's model code files as `save_pretrained` writes them into a checkpoint: the modules of the Auto
    classes and everything they import relatively."""
    from transformers.dynamic_module_utils import get_relative_import_files

    from . import configuration_ultramem, modeling_ultramem

    roots = [Path(configuration_ultramem.__file__), Path(modeling_ultramem.__file__)]
    return sorted({*roots, *(Path(f) for root in roots for f in get_relative_import_files(str(root)))})


def _plan(checkpoint: Path, format: str, group_size: int | None) -> tuple[dict, int, list[tuple]]:
    """Checks (one line each, before any work) and the layout of every output file: (file, header, entries)."""
    config_file = checkpoint / "config.json"
    if not config_file.is_file():
        raise QuantizationError(f"{checkpoint} is not a checkpoint folder (no config.json)")
    config = json.loads(config_file.read_text())
    if config.get("model_type") != "ultramem":
        raise QuantizationError(f"{checkpoint} is not an UltraMem checkpoint (model_type {config.get('model_type')!r})")
    if config.get("memory_quantization"):
        raise QuantizationError(
            f"{checkpoint} is already quantized ({config['memory_quantization']}): convert the float checkpoint it "
            "came from instead (quantizing twice adds both errors)"
        )
    model_config = _check_convertible(checkpoint, config, format)
    group_size = model_group_size(format, model_config, group_size)
    files = []
    for file in _files(checkpoint):
        header, data_start = read_header(checkpoint / file)
        entries, offset = [], 0
        for name, entry in sorted(
            ((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda item: item[1]["data_offsets"][0]
        ):
            shape, (begin, end) = list(entry["shape"]), entry["data_offsets"]
            is_table = bool(TABLE_KEY.search(name))
            source = (SAFETENSORS_DTYPES.get(entry["dtype"]), tuple(shape))
            if is_table and entry["dtype"] == "U8":
                raise QuantizationError(f"{checkpoint} is already quantized ({name} is uint8)")
            if is_table:
                (value_dim, num_cores), group = table_geometry(model_config, name), None
                if source[0] is None or len(shape) != 2 or shape[1] != value_dim:
                    field = "ngram_head_dim" if is_ngram_table(name) else "memory_value_dim"
                    raise QuantizationError(
                        f"{name} is {entry['dtype']} {shape}: a float table of {field} {value_dim} is expected"
                    )
                group = table_group_size(format, model_config, name, group_size)
                source = (*source, num_cores, group)  # how its row blocks are quantized
                dtype, shape = "U8", [shape[0], quantized_width(format, value_dim, group)]
                nbytes = shape[0] * shape[1]
            else:
                dtype, nbytes = entry["dtype"], end - begin
            entries.append((name, source if is_table else None, data_start + begin, dtype, shape, nbytes, offset))
            offset += nbytes
        metadata = {**(header.get("__metadata__") or {"format": "pt"}), METADATA_FORMAT: format}
        metadata[METADATA_GROUP] = str(group_size)
        layout = {"__metadata__": metadata}
        for name, _, _, dtype, shape, nbytes, start in entries:
            layout[name] = {"dtype": dtype, "shape": shape, "data_offsets": [start, start + nbytes]}
        encoded = json.dumps(layout, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        files.append((file, encoded, entries, 8 + len(encoded) + offset))
    if not any(table is not None for *_, entries, _ in files for _, table, *_ in entries):
        raise QuantizationError(
            f"{checkpoint} has memory layers but no value table (memory_layers.N.values.weight, "
            "ngram_memories.N.values.weight)"
        )
    return config, group_size, files


def convert(checkpoint: str | Path, output: str | Path, format: str, group_size: int | None = None) -> Path:
    """Write the quantized copy of `checkpoint` to `output` (see the module docstring); returns `output`."""
    checkpoint, output = Path(checkpoint), Path(output)
    if format not in FORMATS:
        raise QuantizationError(f"--format {format!r} is invalid: choose one of {', '.join(FORMATS)}")
    if not checkpoint.is_dir():
        raise QuantizationError(f"{checkpoint} is not a folder")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise QuantizationError(f"{output} exists and is not an empty folder: choose a new output folder")
    config, group_size, files = _plan(checkpoint, format, group_size)
    code = _model_code() if config.get("auto_map") else []  # a checkpoint saved with its code gets the current one
    skipped = {INDEX_FILE, *(f for f, *_ in files), *(p.name for p in code)}
    others = [p for p in checkpoint.iterdir() if p.is_file() and p.name not in skipped]
    needed = sum(size for *_, size in files) + sum(p.stat().st_size for p in (*others, *code))
    existing = next(folder for folder in (output, *output.absolute().parents) if folder.exists())
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise QuantizationError(
            f"not enough disk space in {existing}: the quantized checkpoint needs {needed / 1e9:.2f} GB, "
            f"{free / 1e9:.2f} GB free"
        )
    created = not output.exists()
    output.mkdir(parents=True, exist_ok=True)
    try:
        _write(checkpoint, output, files, others, code, config, format, group_size)
    except OSError as error:  # a disk that fills during the write (ENOSPC): no partial checkpoint is left to load
        if created:
            shutil.rmtree(output)
        else:  # the folder was empty
            for path in output.iterdir():
                path.unlink()
        raise QuantizationError(
            f"could not write {output} ({error.strerror or error}): removed what was written"
        ) from None
    return output


def _write(
    checkpoint: Path,
    output: Path,
    files: list[tuple],
    others: list[Path],
    code: list[Path],
    config: dict,
    format: str,
    group_size: int | None,
) -> None:
    """Write the quantized files into `output`, config.json last (a folder without it is not a checkpoint)."""
    for file, encoded, entries, _ in files:
        partial = output / (file + ".partial")
        with open(partial, "wb") as handle, open(checkpoint / file, "rb") as reader:
            handle.write(struct.pack("<Q", len(encoded)) + encoded)
            for _, table, begin, _, _, nbytes, _ in entries:
                reader.seek(begin)
                if table is not None:  # row block by row block, read sequentially (one block in memory)
                    dtype, (rows, cols), num_cores, group = table
                    block_rows = max(1, COPY_BYTES // (cols * dtype.itemsize))
                    for start in range(0, rows, block_rows):
                        block = torch.empty(min(block_rows, rows - start), cols, dtype=dtype)
                        reader.readinto(block.view(-1).view(torch.uint8).numpy())
                        handle.write(quantize(block, format, num_cores, group).numpy())
                    continue
                while nbytes > 0:
                    chunk = reader.read(min(COPY_BYTES, nbytes))
                    handle.write(chunk)
                    nbytes -= len(chunk)
        os.replace(partial, output / file)
    if (checkpoint / INDEX_FILE).is_file():
        index = json.loads((checkpoint / INDEX_FILE).read_text())
        index.setdefault("metadata", {})["total_size"] = sum(n for _, _, entries, _ in files for *_, n, _ in entries)
        (output / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    for path in (*others, *code):
        if path.name != "config.json":
            shutil.copy2(path, output / path.name)
    config.update(memory_quantization=format, memory_quantization_group_size=group_size)
    (output / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ultramem.quantize", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="folder of the float checkpoint")
    parser.add_argument("output", help="new folder for the quantized checkpoint")
    # no argparse `choices`: convert() refuses a bad format in one line, where argparse prints its usage first
    parser.add_argument("--format", required=True, metavar="|".join(FORMATS), help="storage format of the tables")
    parser.add_argument("--group-size", type=int, default=None, help="columns per scale/bias group (divides Dv/h)")
    args = parser.parse_args(argv)
    try:
        out = convert(args.checkpoint, args.output, args.format, args.group_size)
    except QuantizationError as error:
        sys.exit(f"error: {error}")
    print(f"wrote {out} ({args.format})")


if __name__ == "__main__":
    main()
