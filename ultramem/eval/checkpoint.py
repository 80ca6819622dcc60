"""What ultramem-eval and the model card need from a checkpoint folder: its config and its size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoConfig, MixtralConfig, PreTrainedConfig

from ultramem.configuration_ultramem import UltraMemConfig
from ultramem.missing_tokenizer import missing_tokenizer
from ultramem.sizing import count_parameters


class CheckpointError(ValueError):
    """The folder is not a checkpoint written by `save_pretrained`."""


def require_checkpoint(path: str | Path, option: str = "--model") -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(
            f"{option} {folder}: not a folder; expected a checkpoint folder written by save_pretrained"
        )
    if not (folder / "config.json").is_file():
        raise CheckpointError(
            f"{option} {folder}: no config.json; expected a checkpoint folder written by save_pretrained"
        )
    return folder


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def require_tokenizer(folder: Path, option: str = "--model") -> Path:
    """A checkpoint without a tokenizer fails later in AutoTokenizer with a sentencepiece/tiktoken error: say it now."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{option} {folder}: {missing_tokenizer(folder)}")
    return folder


def load_config(folder: Path) -> PreTrainedConfig:
    """The checkpoint's config, as this package's class for UltraMem and Mixtral (the MoE baseline)."""
    model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    if model_type == UltraMemConfig.model_type:
        return UltraMemConfig.from_pretrained(folder)
    if model_type == MixtralConfig.model_type:
        return MixtralConfig.from_pretrained(folder)
    return AutoConfig.from_pretrained(folder)


def parameter_counts(config: PreTrainedConfig) -> dict[str, Any] | None:
    """`ultramem.sizing.count_parameters` for the architectures it knows (UltraMem/PKM/dense, Mixtral), else None."""
    return count_parameters(config) if isinstance(config, (UltraMemConfig, MixtralConfig)) else None


def trainer_state(folder: Path) -> dict[str, Any] | None:
    """The Trainer's `trainer_state.json` of the checkpoint, if it has one."""
    path = folder / "trainer_state.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def validation_loss(folder: Path) -> float | None:
    """The checkpoint's own validation loss: the final `eval_results.json`, else the last one the Trainer logged."""
    final = folder / "eval_results.json"
    if final.is_file():
        loss = json.loads(final.read_text(encoding="utf-8")).get("eval_loss")
        if loss is not None:
            return float(loss)
    logged = [
        entry["eval_loss"] for entry in (trainer_state(folder) or {}).get("log_history", []) if "eval_loss" in entry
    ]
    return float(logged[-1]) if logged else None
