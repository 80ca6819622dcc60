"""The GPT-NeoX BPE tokenizer the paper uses, shipped with the package so nothing is downloaded."""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"


def tokenizer_file() -> str:
    """Path of the shipped `tokenizer.json` (GPT-NeoX-20B, Apache-2.0)."""
    return str(resources.files("ultramem.data") / "tokenizer" / "tokenizer.json")


def load_tokenizer(model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """GPT-NeoX tokenizer with `<|endoftext|>` as BOS, EOS and padding token, padding on the left.

    Left padding is what batched generation needs; training packs text into full blocks and never pads.
    """
    return PreTrainedTokenizerFast(
        tokenizer_file=tokenizer_file(),
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        unk_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        padding_side="left",
        model_max_length=model_max_length,
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class TokenizerMismatch(ValueError):
    """The folder is not one the shipped tokenizer belongs to; the message says why."""


def check_folder(folder: str | Path) -> tuple[Path, int | None]:
    """The folder is an UltraMem checkpoint whose vocabulary the shipped tokenizer fits: returns (folder, context).

    Refused, each in one line: a path that is not a folder with config.json, another model type, a config field out
    of range, and a vocabulary other than the shipped tokenizer's (every id of the tokenizer must have an embedding
    row, and the embedding may be padded only up to GPT-NeoX's 50,432 rows: a smaller or larger vocabulary was
    trained with another tokenizer, whose ids this one would misread).
    """
    import json

    from .configuration_ultramem import UltraMemConfig

    path = Path(folder)
    if not path.is_dir():
        raise TokenizerMismatch(f"{path}: not a folder; expected a checkpoint folder written by save_pretrained")
    if not (path / "config.json").is_file():
        raise TokenizerMismatch(f"{path}: no config.json; expected a checkpoint folder written by save_pretrained")
    try:
        model_type = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (ValueError, AttributeError) as err:
        raise TokenizerMismatch(f"{path}: config.json is not a JSON object ({err})") from err
    if model_type != UltraMemConfig.model_type:
        raise TokenizerMismatch(
            f"{path}: model_type {model_type!r} is not an UltraMem checkpoint ('ultramem'); the shipped GPT-NeoX "
            "tokenizer belongs only to UltraMem models trained with it: save the tokenizer the model was trained with"
        )
    try:
        config = UltraMemConfig.from_pretrained(path)
    except Exception as err:  # noqa: BLE001 - a config out of range is one line naming the folder
        raise TokenizerMismatch(f"{path}: config.json: {str(err).strip().splitlines()[0]}") from err
    tokens = load_tokenizer().backend_tokenizer.get_vocab_size(with_added_tokens=True)
    if not tokens <= config.vocab_size <= SHIPPED_EMBEDDING_ROWS:
        raise TokenizerMismatch(
            f"{path}: vocab_size {config.vocab_size:,} does not match the shipped GPT-NeoX tokenizer ({tokens:,} "
            f"tokens, embeddings padded to at most {SHIPPED_EMBEDDING_ROWS:,}); save the tokenizer the model was "
            "trained with instead"
        )
    return path, getattr(config, "max_position_embeddings", None)


SHIPPED_EMBEDDING_ROWS = 50432  # GPT-NeoX-20B's padded embedding, the presets' vocab_size


def add_to_checkpoint(folder: str | Path) -> Path:
    """Save the tokenizer into an UltraMem checkpoint folder that has none (`model.save_pretrained` alone writes
    none), sized to the model's context, so `AutoTokenizer`, `pipeline`, `lm_eval` and `ultramem-eval` can load the
    folder. A folder the shipped tokenizer does not belong to is refused (`check_folder`)."""
    path, context = check_folder(folder)
    load_tokenizer(model_max_length=context or 2048).save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m ultramem.tokenization",
        description="Add the shipped GPT-NeoX tokenizer (tokenizer.json, tokenizer_config.json) to UltraMem checkpoint "
        "folders saved without one. A folder that already has a tokenizer is left as it is; a folder of another "
        "model type or with another vocabulary is refused.",
    )
    parser.add_argument("folders", nargs="+", metavar="FOLDER", help="checkpoint folder written by save_pretrained")
    args = parser.parse_args(argv)
    try:
        checked = [check_folder(folder)[0] for folder in args.folders]  # all of them before writing any
    except TokenizerMismatch as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    for path in checked:
        present = [name for name in TOKENIZER_FILES if (path / name).is_file()]
        if present:
            print(f"{path}: already has a tokenizer ({', '.join(present)}); left as it is")
        else:
            print(f"tokenizer saved into {add_to_checkpoint(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
