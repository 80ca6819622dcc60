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


def add_to_checkpoint(folder: str | Path) -> Path:
    """Save the tokenizer into a checkpoint folder that has none (`model.save_pretrained` alone writes none), sized
    to the model's context, so `AutoTokenizer`, `pipeline`, `lm_eval` and `ultramem-eval` can load the folder."""
    from transformers import AutoConfig

    context = getattr(AutoConfig.from_pretrained(folder, trust_remote_code=True), "max_position_embeddings", None)
    load_tokenizer(model_max_length=context or 2048).save_pretrained(folder)
    return Path(folder)


if __name__ == "__main__":  # python -m ultramem.tokenization CKPT [CKPT ...]
    for checkpoint in sys.argv[1:]:
        print(f"tokenizer saved into {add_to_checkpoint(checkpoint)}")
