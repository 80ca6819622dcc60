"""What ultramem-eval and the model card need from a checkpoint folder: its config, its weights, its size and its
identity."""

from __future__ import annotations

import hashlib
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


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def model_type(folder: Path, option: str = "--model") -> str | None:
    """`model_type` of the folder's config.json (read as JSON, nothing imported or validated)."""
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{option} {folder}: config.json is not a JSON object: {_first_line(err)}") from err


def load_config(folder: Path, option: str = "--model") -> PreTrainedConfig:
    """The checkpoint's config, as this package's class for UltraMem and Mixtral (the MoE baseline), validated as
    `from_pretrained` validates it: a field out of range is one `CheckpointError` naming the folder and the field."""
    kind = model_type(folder, option)
    try:
        if kind == UltraMemConfig.model_type:
            return UltraMemConfig.from_pretrained(folder)
        if kind == MixtralConfig.model_type:
            return MixtralConfig.from_pretrained(folder)
        return AutoConfig.from_pretrained(folder)
    except Exception as err:  # noqa: BLE001 - any config that cannot be built is one line naming the folder
        raise CheckpointError(f"{option} {folder}: config.json: {_first_line(err)}") from err


SAFETENSORS_INDEX = "model.safetensors.index.json"


def weight_files(folder: Path, option: str = "--model") -> list[Path]:
    """The checkpoint's safetensors files: `model.safetensors`, or every shard its index names (each must exist)."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{option} {folder}: {index.name} has no readable weight_map ({err})") from err
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise CheckpointError(f"{option} {folder}: shard {missing[0]} named in {index.name} is missing")
        return [folder / name for name in shards]
    return sorted(folder.glob("*.safetensors"))


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a complete safetensors file (safetensors' own header check: a truncated or extended file
    is "incomplete metadata, file not fully covered"), or None when it is one. Reads the header only."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            return None
    except (SafetensorError, OSError) as err:
        reason = _first_line(err).removeprefix("Error while deserializing header: ")
        return f"{path.name} is not a complete safetensors file ({reason}; {path.stat().st_size:,} bytes)"


def check_weights(folder: Path, option: str = "--model") -> list[Path]:
    """Every weight file of the checkpoint is whole; one `CheckpointError` naming the file otherwise."""
    files = weight_files(folder, option)
    if not files and not any(folder.glob("pytorch_model*.bin")):
        raise CheckpointError(f"{option} {folder}: no weights (*.safetensors); expected a folder of save_pretrained")
    for path in files:
        problem = safetensors_problem(path)
        if problem:
            raise CheckpointError(f"{option} {folder}: {problem}: it was truncated or damaged, copy or save it again")
    return files


# config.json keys that change when the same weights are saved again, left out of the identity
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "dtype", "torch_dtype")


def fingerprint(folder: Path) -> str:
    """Identity of a checkpoint's content: SHA-256 over its config (as JSON, keys sorted, without the fields a re-save
    changes) and the bytes of its safetensors files in order. Equal for a copied or moved folder; different for
    another model or a retrained one. Reads every weight byte once (about 1 s per GB)."""
    digest = hashlib.sha256()
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    digest.update(json.dumps(config, sort_keys=True).encode())
    for path in weight_files(folder):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()


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
