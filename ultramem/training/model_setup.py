"""Building the model to train from a preset, a config file or a checkpoint, with `key=value` overrides."""

from __future__ import annotations

import ast
import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from ultramem.training.arguments import ModelArguments, UltraMemTrainingArguments
from ultramem.training.errors import UsageError
from ultramem.training.fsdp import FSDP2_CONFIG, requested_fsdp_version
from ultramem.value_stores import deferred_value_tables


def _split_top_level(text: str) -> list[str]:
    """Split on the commas that are outside brackets, braces, parentheses and quotes."""
    parts, depth, quote, start = [], 0, None, 0
    for index, char in enumerate(text):
        if quote:
            quote = None if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return parts


def _parse_value(text: str) -> Any:
    """JSON (`true`, `[[0, 1]]`, `{"a": 1}`), else a Python literal (`True`, `{'a': 1}`), else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


def parse_overrides(text: str | None) -> dict[str, Any]:
    """`'a=1,b=true,c=gelu,d=[[0,1]]'` -> `{"a": 1, "b": True, "c": "gelu", "d": [[0, 1]]}`: pairs split on the commas
    outside brackets and quotes, values parsed as JSON or Python literals (a plain word stays a string)."""
    overrides: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in _split_top_level(text or ""))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--config_overrides '{item}': expected key=value")
        overrides[key.strip()] = _parse_value(value.strip())
    return overrides


def _read_config_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as error:
        raise UsageError(f"--config_file {path}: cannot be read ({error.strerror})") from error
    except json.JSONDecodeError as error:
        raise UsageError(f"--config_file {path}: not valid JSON ({error.msg} at line {error.lineno})") from error
    if not isinstance(data, dict) or "model_type" not in data:
        raise UsageError(f"--config_file {path}: must be a JSON object with a 'model_type' field")
    return data


# What `save_pretrained` adds about the saved files, not about the model: never a contradiction with a preset.
SAVE_METADATA = frozenset({"architectures", "auto_map", "dtype", "torch_dtype", "transformers_version"})


def _check_agrees_with_preset(file_values: dict[str, Any], preset: PretrainedConfig, args: ModelArguments) -> None:
    reference = preset.to_dict()
    for key, value in file_values.items():
        if key in reference and reference[key] != value and not key.startswith("_") and key not in SAVE_METADATA:
            raise UsageError(
                f"--config_file {args.config_file} sets {key}={value!r}, which contradicts --preset {args.preset} "
                f"({key}={reference[key]!r}); give only one of them, or change fields with --config_overrides"
            )


def _check_override_keys(config: PretrainedConfig, overrides: dict[str, Any]) -> None:
    unknown = [key for key in overrides if not hasattr(config, key)]
    if unknown:
        raise UsageError(f"--config_overrides: {', '.join(unknown)} is not a field of {type(config).__name__}")


def build_config(args: ModelArguments) -> PretrainedConfig:
    """The config to train; errors name the contradicting flag or field."""
    overrides = parse_overrides(args.config_overrides)
    sources = [flag for flag, value in (("--preset", args.preset), ("--config_file", args.config_file)) if value]
    if args.model_name_or_path is not None and sources:
        raise UsageError(f"--model_name_or_path cannot be combined with {' or '.join(sources)}")
    if args.model_name_or_path is None and not sources:
        raise UsageError("give --preset NAME, --config_file FILE or --model_name_or_path PATH")
    try:
        if args.model_name_or_path is not None:
            config = AutoConfig.from_pretrained(args.model_name_or_path, trust_remote_code=True)
            _check_override_keys(config, overrides)
            if not overrides:
                return config
            # rebuilt, not updated in place: construction checks the fields as --preset's overrides are checked
            return type(config).from_dict({**config.to_dict(), **overrides})
        if args.preset is not None:
            from ultramem import presets

            if args.preset not in presets.PRESETS:
                raise UsageError(f"--preset {args.preset}: unknown; allowed: {', '.join(presets.PRESETS)}")
            base = presets.get_config(args.preset)
            if args.config_file is not None:
                _check_agrees_with_preset(_read_config_file(args.config_file), base, args)
            _check_override_keys(base, overrides)
            return presets.get_config(args.preset, **overrides)
        values = _read_config_file(args.config_file)
        _check_override_keys(AutoConfig.for_model(**values), overrides)
        return AutoConfig.for_model(**{**values, **overrides})
    except UsageError:
        raise
    except StrictDataclassError as error:  # a field of the wrong type: the last line names field, type and value
        problem = str(error).strip().splitlines()[-1].strip()
        field = re.search(r"Field '(\w+)'", problem)
        source = "--config_overrides" if field and field.group(1) in overrides else "invalid model configuration"
        raise UsageError(f"{source}: {problem}") from error
    except (ValueError, TypeError, KeyError, OSError) as error:
        raise UsageError(f"invalid model configuration: {str(error).strip().splitlines()[0]}") from error


def apply_preset_training_arguments(
    args: ModelArguments, training_args: UltraMemTrainingArguments, config: PretrainedConfig
) -> dict[str, Any]:
    """Set what `--preset` recommends for training (`ultramem.presets.get_training_arguments`: the PKM presets' constant
    value LR) on the training arguments left unset (None) and not carried by the config (the deprecated value-LR
    fields); returns what was set. An argument the caller gives always wins."""
    if args.preset is None:
        return {}
    from ultramem import presets

    applied = {}
    for name, value in presets.get_training_arguments(args.preset).items():
        if getattr(training_args, name) is None and getattr(config, name, None) is None:
            setattr(training_args, name, value)
            applied[name] = value
    return applied


def build_model(args: ModelArguments, config: PretrainedConfig, defer_tables: bool = False) -> PreTrainedModel:
    """A fresh model from `config`, or the weights of `--model_name_or_path` under that (overridden) config.

    With `defer_tables` (a sharded run) the value tables are neither allocated nor read: the sharded stores
    of `shard_value_tables` read or draw only this rank's part.
    """
    with deferred_value_tables() if defer_tables else nullcontext():
        if args.model_name_or_path is not None:
            return AutoModelForCausalLM.from_pretrained(args.model_name_or_path, config=config, trust_remote_code=True)
        # Buffers are filled at construction on every rank (UltraMem's IVE bijection), so ZeRO-3's rank-0-only
        # `_init_weights` needs nothing broadcast beyond the parameters.
        return AutoModelForCausalLM.from_config(config)


def max_positions(config: PretrainedConfig) -> int | None:
    """Longest sequence the model accepts, when its config says."""
    return getattr(config, "max_position_embeddings", None)


def check_engine_leaves_tables(args: UltraMemTrainingArguments) -> None:
    """`--memory_parallel` composes with DDP, FSDP2 (told to ignore the sharded tables) and DeepSpeed (the tables are
    kept out of its engine, `ultramem.training.deepspeed_tables`); refuse in one line, before the model is built, what
    would partition the tables again or leave them untrained."""
    if args.memory_parallel == "none":
        return
    flag = f"--memory_parallel {args.memory_parallel}"
    version = requested_fsdp_version(args)
    if version not in (None, 2):
        raise UsageError(
            f"{flag} with FSDP{version}: FSDP1 would flatten the sharded value tables into its own shards; allowed: "
            f"DDP, FSDP2 (--fsdp, accelerate launch --config_file {FSDP2_CONFIG}), DeepSpeed, or --memory_parallel none"
        )
    plugin = args.deepspeed_plugin
    if plugin is None:
        return
    config = plugin.deepspeed_config
    source = args.deepspeed or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "of the accelerate config")
    stage = config.get("zero_optimization", {}).get("stage", 0)
    sections = [f"'{key}'" for key in ("optimizer", "scheduler") if key in config]
    if sections or stage not in (1, 2, 3):
        found = f"its {' and '.join(sections)} section" if sections else f"ZeRO stage {stage}"
        raise UsageError(
            f"{flag} with the DeepSpeed config {source}: {found} would leave the value tables (kept out of the engine) "
            "without their optimizer or value-LR schedule; allowed: ZeRO stage 1, 2 or 3 with no 'optimizer' or "
            "'scheduler' section (the Trainer builds both, as in ultramem/configs/deepspeed/zero2.json and "
            "zero3.json), or --memory_parallel none"
        )


def shard_value_tables(
    model: PreTrainedModel, args: UltraMemTrainingArguments, block_size: int, checkpoint: str | None = None
) -> None:
    """Apply `--memory_parallel` (see `ultramem.parallel`), the deferred tables read from `checkpoint` when given;
    its errors become one-line usage errors."""
    if args.memory_parallel == "none":
        return
    from ultramem.parallel import apply_memory_parallel

    _ = args.device  # sets up the launcher's process group
    tokens = args.per_device_train_batch_size * block_size
    try:
        with _quiet_unless(
            args.should_log, "ultramem.parallel"
        ):  # its plan (predicted volumes): one line, not per rank
            apply_memory_parallel(model, args.memory_parallel, args.memory_parallel_size, tokens, checkpoint)
    except ValueError as error:
        raise UsageError(f"--memory_parallel {args.memory_parallel}: {error}") from error


@contextmanager
def _quiet_unless(loud: bool, logger_name: str) -> Iterator[None]:
    """Raise the level of `logger_name` to ERROR unless `loud` (e.g. on every rank but the main one)."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    if not loud:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
