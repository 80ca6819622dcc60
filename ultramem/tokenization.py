"""The GPT-NeoX BPE tokenizer the paper uses, shipped with the package so nothing is downloaded."""

from __future__ import annotations

from importlib import resources

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
