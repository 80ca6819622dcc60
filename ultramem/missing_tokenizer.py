"""What `AutoTokenizer` finds for an UltraMem folder saved without its tokenizer: one line that names the fix.

With no tokenizer_config.json in a folder, `AutoTokenizer` (so `pipeline` and `lm_eval --model hf` too) takes the
tokenizer registered for the config class, and for an unregistered one fails converting a slow tokenizer
(a sentencepiece/tiktoken error). `import ultramem` registers `MissingTokenizer` for `UltraMemConfig`.
`save_pretrained` copies `configuration_ultramem` and this module into every checkpoint; loaded from there with
`trust_remote_code=True` (the only UltraMem code `AutoTokenizer` imports then), that copy registers it for its own
config class. Only Transformers is imported here for that reason.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TokenizersBackend
from transformers.utils import cached_file

TOKENIZER_FILE = "tokenizer.json"
_HUB_KWARGS = ("cache_dir", "revision", "token", "subfolder", "local_files_only")


def missing_tokenizer(folder: str | os.PathLike) -> str:
    """The reason and the fix, for messages that name the folder or the option that gave it."""
    return (
        f"no tokenizer ({TOKENIZER_FILE}); add the shipped GPT-NeoX tokenizer with "
        f"`python -m ultramem.tokenization {folder}`"
    )


class MissingTokenizerError(OSError):
    """An UltraMem checkpoint has no tokenizer files."""


class MissingTokenizer:
    """`AutoTokenizer`'s fallback for `UltraMemConfig`: loads a bare `tokenizer.json`, else raises the fix."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *inputs: Any, **kwargs: Any) -> Any:
        folder = pretrained_model_name_or_path
        hub = {key: kwargs[key] for key in _HUB_KWARGS if key in kwargs}
        if cached_file(folder, TOKENIZER_FILE, _raise_exceptions_for_missing_entries=False, **hub) is None:
            raise MissingTokenizerError(f"{folder}: {missing_tokenizer(folder)}")
        return TokenizersBackend.from_pretrained(folder, *inputs, **kwargs)
