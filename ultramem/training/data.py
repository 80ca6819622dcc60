"""Loading text with `datasets`, tokenizing with the GPT-NeoX tokenizer and packing it into fixed-length blocks."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
from importlib import resources
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, DatasetDict, load_dataset
from transformers import PreTrainedTokenizerBase

from ultramem.training.arguments import DataArguments
from ultramem.training.errors import UsageError

_COMPRESSION_SUFFIXES = {".xz", ".gz", ".bz2", ".zst", ".lz4"}
_OPENERS = {".xz": lzma.open, ".gz": gzip.open, ".bz2": bz2.open}
_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def embedded_corpus_files() -> dict[str, str]:
    """Train/validation files of the Gutenberg slice shipped in `ultramem/data/corpus/`."""
    root = resources.files("ultramem.data") / "corpus"
    return {"train": str(root / "train.jsonl.xz"), "validation": str(root / "valid.jsonl.xz")}


def _builder_for(path: str, flag: str) -> str:
    suffixes = [s for s in Path(path).suffixes if s not in _COMPRESSION_SUFFIXES]
    if not suffixes or suffixes[-1] not in _BUILDERS:
        raise UsageError(
            f"{flag} {path}: unsupported file type; allowed: {', '.join(sorted(_BUILDERS))} (optionally .xz/.gz)"
        )
    return _BUILDERS[suffixes[-1]]


def _check_readable(path: str, flag: str) -> None:
    if not os.path.isfile(path):
        raise UsageError(f"{flag} {path}: no such file")
    if not os.access(path, os.R_OK):
        raise UsageError(f"{flag} {path}: file is not readable (permission denied)")
    if os.path.getsize(path) == 0:
        raise UsageError(f"{flag} {path}: file is empty")


def _load_file(path: str, flag: str) -> Dataset:
    _check_readable(path, flag)
    builder = _builder_for(path, flag)
    try:
        return load_dataset(builder, data_files={"train": path}, split="train")
    except Exception as error:  # datasets raises many types for malformed files; report the first line
        where = _first_bad_json_line(path) if builder == "json" else None
        raise UsageError(f"{flag} {path}: could not be read as {builder}: {where or _first_line(error)}") from error


def _first_bad_json_line(path: str) -> str | None:
    """Where a JSON Lines file breaks (datasets only says that it does); None when the file is one JSON document."""
    opener = _OPENERS.get(Path(path).suffix, open)
    with opener(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as error:
                return f"line {number} is not valid JSON ({error.msg} at column {error.colno})"
    return None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _check_text(dataset: Dataset, column: str, source: str) -> None:
    if column not in dataset.column_names:
        raise UsageError(
            f"--text_column '{column}' is not a column of {source} (columns: {', '.join(dataset.column_names)})"
        )
    if dataset.num_rows == 0 or not any(text for text in dataset[column] if isinstance(text, str) and text.strip()):
        raise UsageError(f"{source}: contains no text in column '{column}'")


def load_raw_datasets(args: DataArguments) -> DatasetDict:
    """Raw text splits `train` and, when one is given or shipped, `validation`; errors name the bad flag or file."""
    if args.dataset_name is not None:
        try:
            loaded = load_dataset(args.dataset_name, args.dataset_config_name)
        except Exception as error:  # unreachable Hub, unknown name, bad config: report the first line
            raise UsageError(
                f"--dataset_name {args.dataset_name}: could not be loaded: {_first_line(error)}"
            ) from error
        raw = DatasetDict({name: loaded[name] for name in ("train", "validation") if name in loaded})
        if "train" not in raw:
            raise UsageError(f"--dataset_name {args.dataset_name}: has no 'train' split (splits: {', '.join(loaded)})")
        sources = {name: f"--dataset_name {args.dataset_name} ({name})" for name in raw}
    else:
        if args.train_file is None and args.validation_file is None:
            files = embedded_corpus_files()
        else:
            if args.train_file is None:
                raise UsageError("--validation_file needs --train_file as well")
            files = {"train": args.train_file}
            if args.validation_file is not None:
                files["validation"] = args.validation_file
        flags = {"train": "--train_file", "validation": "--validation_file"}
        raw = DatasetDict({name: _load_file(path, flags[name]) for name, path in files.items()})
        sources = {name: f"{flags[name]} {files[name]}" for name in raw}
    for name, dataset in raw.items():
        _check_text(dataset, args.text_column, sources[name])
    return raw


def pack_blocks(examples: dict[str, list[list[int]]], block_size: int) -> dict[str, list[list[int]]]:
    """Concatenate token lists and cut them into full blocks of `block_size` (the remainder is dropped)."""
    concatenated = list(chain.from_iterable(examples["input_ids"]))
    total = (len(concatenated) // block_size) * block_size
    blocks = [concatenated[i : i + block_size] for i in range(0, total, block_size)]
    return {"input_ids": blocks, "labels": [list(block) for block in blocks]}


def _require_a_block(packed: DatasetDict, tokenized: DatasetDict, split: str, block_size: int) -> None:
    """A split shorter than one block gives no sample: say how many tokens it has, hence the block sizes that work."""
    if len(packed[split]) == 0:
        tokens = sum(len(ids) for ids in tokenized[split]["input_ids"])
        raise UsageError(
            f"--block_size {block_size}: the {split} text has only {tokens} tokens, less than one block; "
            f"allowed range for this text is 1..{tokens}, or give more text"
        )


def tokenize_and_pack(
    raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, args: DataArguments, main_process_first: Any
) -> DatasetDict:
    """Tokenize each document with an end-of-text token appended, pack into blocks, hold out validation blocks."""
    eos = tokenizer.eos_token_id

    def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        ids = tokenizer(batch[args.text_column], add_special_tokens=False, verbose=False)["input_ids"]
        return {"input_ids": [doc + [eos] for doc in ids]}

    with main_process_first(desc="tokenizing and packing"):
        tokenized = raw.map(
            tokenize,
            batched=True,
            num_proc=args.preprocessing_num_workers,
            remove_columns=raw["train"].column_names,
            desc="Tokenizing",
        )
        packed = tokenized.map(
            pack_blocks,
            batched=True,
            fn_kwargs={"block_size": args.block_size},
            num_proc=args.preprocessing_num_workers,
            desc=f"Packing into blocks of {args.block_size}",
        )
    _require_a_block(packed, tokenized, "train", args.block_size)
    if "validation" not in packed:
        train = packed["train"]
        held_out = max(1, int(len(train) * args.validation_split_percentage / 100))
        if held_out >= len(train):
            raise UsageError(
                f"--validation_split_percentage {args.validation_split_percentage}: leaves no training blocks "
                f"out of {len(train)}; allowed range is (0, 100) with at least one block on each side"
            )
        packed = DatasetDict(
            train=train.select(range(len(train) - held_out)),
            validation=train.select(range(len(train) - held_out, len(train))),
        )
    _require_a_block(packed, tokenized, "validation", args.block_size)
    if args.max_train_samples is not None:
        packed["train"] = packed["train"].select(range(min(args.max_train_samples, len(packed["train"]))))
    if args.max_eval_samples:
        packed["validation"] = sample_blocks(packed["validation"], args.max_eval_samples, args.eval_sample_seed)
    return packed


def sample_blocks(blocks: Dataset, count: int, seed: int) -> Dataset:
    """`count` blocks drawn without replacement from all of `blocks` by a generator seeded with `seed`, in their
    original order (all of them when there are no more). The first blocks of a validation file are one book's title
    page and contents: evaluating on them alone read a loss of 11 for a model that scores 5.9 on the rest."""
    if count >= len(blocks):
        return blocks
    chosen = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))[:count]
    return blocks.select(sorted(chosen.tolist()))
