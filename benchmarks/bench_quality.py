"""Quality at fixed compute: the paper's model comparison and ablation ladder, trained through `ultramem-train`.

Every row is one config file in `benchmarks/quality/<scale>/` and the training arguments it sets beyond the
benchmark's own, in `benchmarks/quality/<scale>/training_arguments.json` (the value-table learning rate: PKM's is
constant, UltraMem's decays; the ladder's "+value lr decay" row changes only that). Regenerate both with
`--write-configs`; a test checks they equal `ultramem.presets` and `ultramem.ablation`. All rows train on the same
tokens, in the same order for a given seed, with the same schedule; rows with identical configs and training
arguments (the ladder's first and last rows are the PKM and UltraMem presets at "tiny") are trained once. The
validation loss is the Trainer's own evaluation (`ultramem-train`'s validation blocks, drawn across the corpora's valid
splits), of the language-model cross entropy alone (no TDQKR aux loss, no Mixtral router loss).

CPU (what `benchmarks/results/quality_*` holds; see benchmarks/README.md for the exact command and reading):

    OMP_NUM_THREADS=2 python benchmarks/bench_quality.py --scale tiny --bf16

GPU (the paper's 151M rows, 100M tokens per model; not run yet, needs several device hours for every row):

    python benchmarks/bench_quality.py --scale 151m --rows comparison --bf16 --batch-size 96 --block-size 1024 \
        --max-steps 1018 --eval-points 10 --eval-blocks 256 --learning-rate 6e-4 --results-dir $OUT

Results are rewritten after every run (`quality_<scale>.json`, `.md`, `_comparison.png`, `_ladder.png`), so an
interrupted run still leaves a usable table; rerunning the same command skips the runs already recorded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import math
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lib import cli, env, report
from transformers import AutoConfig, MixtralConfig, PreTrainedConfig, TrainerCallback

from ultramem import UltraMemConfig, ablation, presets, sizing
from ultramem.configuration_ultramem import NO_QUERY_NORM, QUERY_NORM_BEFORE_FIELD, QUERY_NORMS
from ultramem.diagnostics import retrieval_diagnostics
from ultramem.training import DataArguments, ModelArguments, UltraMemTrainingArguments, train
from ultramem.training.data import embedded_corpus_files
from ultramem.training.schedule import DEFAULT_VALUE_LR_DECAY, DEFAULT_VALUE_LR_MULTIPLIER

ROOT = env.BENCHMARKS
CONFIG_DIR = ROOT / "quality"
TRAINING_ARGUMENTS_FILE = "training_arguments.json"  # in CONFIG_DIR / scale: row config file name -> its arguments
CHARS_PER_TOKEN = 5.0  # generous for English BPE, so the text subset never runs out before the token budget
# Books are cut into pieces so a subset samples each book along its length. Pieces of 8,000 characters made the
# default validation text (2,048-4,096 tokens of the shipped slice) two to four pieces, the first one Treasure Island's
# title page and table of contents: a validation loss 2.5-3 nats above the training loss for every model.
GUTENBERG_PIECE_CHARS = 2000
# The validation blocks are `ultramem-train --max_eval_samples`'s draw from a pool of this many times their tokens,
# spread along every book: the first blocks of a pool are one book's title page, poem and table of contents (10-11 nats
# a token), and taking them first added ~0.4 nats to every row.
VALIDATION_POOL = 8
VALIDATION_SEED = 0  # ultramem-train's default --eval_sample_seed

COMPARISON = {
    "tiny": {"Dense": "tiny-dense", "PKM": "tiny-pkm", "MoE": "tiny-moe", "UltraMem": "tiny-ultramem"},
    "small": {"Dense": "small-dense", "PKM": "small-pkm", "MoE": "small-moe", "UltraMem": "small-ultramem"},
    "151m": {"Dense": "dense-151m", "PKM": "pkm-151m-x12", "MoE": "moe-151m-2in32", "UltraMem": "ultramem-151m-x12"},
}
SEEDED_ROWS = ("Dense", "PKM", "MoE", "UltraMem")
# The memory-layer family at equal total parameters (docs/variants.md): UltraMem (V1) is the reference row; "w/o PEER"
# is UltraMemV2 with its pre-value rows folded into the values (the same floats per row). Rows of other groups with the
# same config (UltraMem, Dense, MoE) share their runs.
VARIANTS = {  # row name -> (preset, whether its PEER pre-values are folded into the values)
    scale: {
        "UltraMem (V1)": (f"{scale}-ultramem", False),
        "UltraMemV2": (f"{scale}-ultramemv2", False),
        "UltraMemV2 w/o PEER": (f"{scale}-ultramemv2", True),
        "Memory+": (f"{scale}-memoryplus", False),
        "Dense baseline": (f"{scale}-dense", False),
        "MoE baseline": (f"{scale}-moe", False),
    }
    for scale in ("tiny", "small")
}
# Retrieval collapse (docs/design.md): UltraMem with every mode of the query's across-token normalisation, UltraMemV2 and
# Memory+ without it and with the presets' default. Row name -> (preset, query_norm).
QUERY_NORM_ROWS = {
    scale: {
        f"{family} (query_norm={mode})": (f"{scale}-{preset}", mode)
        for family, preset, modes in (
            ("UltraMem", "ultramem", QUERY_NORMS),
            ("UltraMemV2", "ultramemv2", (NO_QUERY_NORM, UltraMemConfig().query_norm)),
            ("Memory+", "memoryplus", (NO_QUERY_NORM, UltraMemConfig().query_norm)),
        )
        for mode in modes
    }
    for scale in ("tiny", "small")
}
# Product keys and hashed n-grams (issue 45): tiny-ultramem's sparse budget (16.8M) split between UltraMem's tables and
# an Engram memory at block 1, from all product keys to all n-grams; row name -> (preset, overrides)
NGRAM_ROWS = {
    "tiny": {
        "n-gram share 0% (UltraMem)": ("tiny-ultramem", {}),
        "n-gram share 25%": ("tiny-ultramem-engram", {}),
        "n-gram share 50%": ("tiny-ultramem-engram", dict(memory_num_keys=362, ngram_table_size=262144)),
        "n-gram share 100% (Engram)": ("tiny-engram", {}),
        "Dense baseline": ("tiny-dense", {}),
        "MoE baseline": ("tiny-moe", {}),
    },
    "151m": {
        "n-gram share 0% (UltraMem)": ("ultramem-151m-x12", {}),
        "n-gram share 25%": ("ultramem-engram-151m", {}),
        "n-gram share 100% (Engram)": ("engram-151m", {}),
        "Dense baseline": ("dense-151m", {}),
    },
}
GROUPS = {  # the rows' groups, in table order: (title, what each row's difference is to)
    "comparison": ("Model comparison", "Diff to Dense"),
    "ladder": ("Ablation ladder (each row adds one change)", "Diff to previous"),
    "variants": ("The memory-layer family at equal parameters", "Diff to UltraMem (V1)"),
    "v2_ladder": ("From UltraMem to UltraMemV2 (each row adds one change)", "Diff to previous"),
    "query_norm": ("The query's across-token normalisation (retrieval collapse)", "Diff to 'none'"),
    "ngram": ("Product keys and hashed n-grams at one sparse budget", "Diff to 0% (UltraMem)"),
}
# Held-out blocks the final retrieval health is measured on (2,048 tokens at the tiny block size)
HEALTH_BLOCKS = 16


def _variant_config(preset: str, fold_pre_values: bool) -> PreTrainedConfig:
    config = presets.get_config(preset)
    if not fold_pre_values:
        return config
    width = config.memory_value_dim + config.pre_value_dim
    return presets.get_config(preset, value_gate="none", pre_value_dim=0, memory_value_dim=width)


@dataclass(frozen=True)
class Row:
    """One line of a table: its group (one of GROUPS), its name, the config file it trains, and the
    training arguments it sets (`ultramem-train` flags)."""

    group: str
    name: str
    config_file: Path
    config: dict[str, Any]
    training_arguments: dict[str, Any]

    @property
    def key(self) -> str:
        return config_key(self.config, self.training_arguments)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower().lstrip("+")).strip("-").replace("--", "-")


def row_configs(scale: str) -> list[tuple[str, str, PreTrainedConfig, dict[str, Any]]]:
    """(group, name, config, training arguments) for every row at `scale`: the four-model comparison, then the ladder
    in order (at the scales that have one)."""
    if scale not in COMPARISON:
        raise ValueError(f"--scale {scale!r}: allowed values are {', '.join(COMPARISON)}")
    rows = []
    for name, preset in COMPARISON[scale].items():
        config = presets.get_config(preset)
        rows.append(("comparison", name, config, _value_lr(config, presets.get_training_arguments(preset))))
    if scale in ablation.LADDER_SCALES:
        # the ladder shares the presets' position limit, so its first and last rows are the PKM and UltraMem rows
        positions = rows[-1][2].max_position_embeddings
        rows += [
            ("ladder", name, config, _value_lr(config, ablation.ladder_training_arguments(name)))
            for name, config in ablation.ablation_ladder(scale, max_position_embeddings=positions)
        ]
    for name, (preset, fold_pre_values) in VARIANTS.get(scale, {}).items():
        config = _variant_config(preset, fold_pre_values)
        rows.append(("variants", name, config, _value_lr(config, presets.get_training_arguments(preset))))
    if scale in ablation.V2_LADDER_SCALES:
        rows += [
            ("v2_ladder", f"V2 ladder: {name}", config, _value_lr(config, {}))
            for name, config in ablation.ultramemv2_ladder(scale)
        ]
    for name, (preset, mode) in QUERY_NORM_ROWS.get(scale, {}).items():
        config = presets.get_config(preset, query_norm=mode)
        rows.append(("query_norm", name, config, _value_lr(config, presets.get_training_arguments(preset))))
    for name, (preset, overrides) in NGRAM_ROWS.get(scale, {}).items():
        config = presets.get_config(preset, **overrides)
        rows.append(("ngram", name, config, _value_lr(config, presets.get_training_arguments(preset))))
    return rows


def _value_lr(config: PreTrainedConfig, recommended: dict[str, Any]) -> dict[str, Any]:
    """A row's training arguments: for a model with value tables, both value-LR settings, spelled out (the recipe's
    over the defaults), so a run never depends on a default that may change; none for the others."""
    if not getattr(config, "memory_layers", None):
        return dict(recommended)
    defaults = {"value_lr_multiplier": DEFAULT_VALUE_LR_MULTIPLIER, "value_lr_decay": DEFAULT_VALUE_LR_DECAY}
    return {**defaults, **recommended}


def _rows(scale: str) -> list[tuple[str, str, PreTrainedConfig, dict[str, Any], Path]]:
    """`row_configs` with the file each row's config is stored in (`<group>-<index in group>-<name>.json`)."""
    counters: dict[str, int] = {}
    files = []
    for group, name, config, training in row_configs(scale):
        counters[group] = counters.get(group, 0) + 1
        path = CONFIG_DIR / scale / f"{group}-{counters[group]:02d}-{_slug(name)}.json"
        files.append((group, name, config, training, path))
    return files


def row_files(scale: str) -> list[tuple[str, str, PreTrainedConfig, Path]]:
    """(group, name, config, the file the config is stored in) for every row at `scale`."""
    return [(group, name, config, path) for group, name, config, _, path in _rows(scale)]


def row_training_arguments(scale: str) -> dict[str, dict[str, Any]]:
    """What `training_arguments.json` stores: each row's training arguments, by the name of its config file."""
    return {path.name: training for _, _, _, training, path in _rows(scale)}


def config_dict(config: PreTrainedConfig) -> dict[str, Any]:
    """The config as the file stores it: every field (JSON types), without the Transformers version that wrote it."""
    values = json.loads(config.to_json_string(use_diff=False))
    values.pop("transformers_version", None)
    return values


def built_config(values: dict[str, Any]) -> PreTrainedConfig:
    """The config a row file gives `ultramem-train --config_file` (fields it lacks take their defaults)."""
    return AutoConfig.for_model(**values)


def write_configs(scale: str) -> list[Path]:
    """Write one config JSON per row (what `--config_file` of `ultramem-train` reads) and the rows' training
    arguments (`training_arguments.json`)."""
    paths = []
    for _, _, config, path in row_files(scale):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config_dict(config), indent=2, sort_keys=True) + "\n")
        paths.append(path)
    path = CONFIG_DIR / scale / TRAINING_ARGUMENTS_FILE
    path.write_text(json.dumps(row_training_arguments(scale), indent=2) + "\n")
    return [*paths, path]


def load_rows(scale: str, selection: str) -> list[Row]:
    """Rows whose config files exist, filtered by `--rows` (all, or comma-separated groups of GROUPS or row names)."""
    rows = []
    stored = CONFIG_DIR / scale / TRAINING_ARGUMENTS_FILE
    for group, name, _, path in row_files(scale):
        if not path.is_file() or not stored.is_file():
            missing = stored if path.is_file() else path
            raise FileNotFoundError(
                f"{missing} is missing: run `python {Path(__file__).name} --write-configs --scale {scale}`"
            )
        training = json.loads(stored.read_text()).get(path.name, {})
        rows.append(Row(group, name, path, json.loads(path.read_text()), training))
    if selection == "all":
        return rows
    wanted = [name.strip() for name in selection.split(",")]
    if set(wanted) <= set(GROUPS):
        return [row for row in rows if row.group in wanted]
    unknown = [name for name in wanted if name not in {row.name for row in rows}]
    if unknown:
        raise ValueError(
            f"--rows: unknown row(s) {unknown}; allowed: all, {', '.join(GROUPS)} or {[r.name for r in rows]}"
        )
    return [row for row in rows if row.name in wanted]


def config_key(config: dict[str, Any], training_arguments: dict[str, Any]) -> str:
    """Rows with the same key train the same model the same way: their runs are shared.

    The config counts by its fields that differ from the config class's defaults, so a field added later with a
    default that keeps the old behaviour leaves the recorded runs' keys valid. `query_norm` changed the behaviour of
    the default config: it counts against its value before the field existed, so runs recorded before it keep their
    keys and runs with it get new ones.
    """
    if config.get("model_type") == MixtralConfig.model_type:
        defaults = config_dict(MixtralConfig())
    else:
        defaults = config_dict(UltraMemConfig(query_norm=QUERY_NORM_BEFORE_FIELD))
        config = {"query_norm": UltraMemConfig().query_norm, **config}  # a row file without it trains the default
    config = {name: value for name, value in config.items() if name not in defaults or defaults[name] != value}
    trained = {"config": config, "training_arguments": training_arguments}
    return hashlib.sha256(json.dumps(trained, sort_keys=True).encode()).hexdigest()[:16]


# ---- data ------------------------------------------------------------------------------------------------------
def check_corpus_dirs(corpus_dirs: list[Path]) -> None:
    """Each corpus is a folder holding `train.jsonl.xz` and `valid.jsonl.xz` (the layout of ultramem/data/corpus)."""
    for folder in corpus_dirs:
        missing = [name for name in ("train.jsonl.xz", "valid.jsonl.xz") if not (folder / name).is_file()]
        if missing:
            raise ValueError(
                f"--corpus-dir {folder}: no {' or '.join(missing)} (expected the layout of ultramem/data/corpus)"
            )


def _documents(folder: Path, split: str) -> list[str]:
    """Texts of one split; books (records with a Gutenberg `pg_id`) are cut into pieces so every book is sampled."""
    with lzma.open(folder / f"{split}.jsonl.xz", "rt", encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle]
    return [
        piece
        for record in records
        for piece in (
            [
                record["text"][i : i + GUTENBERG_PIECE_CHARS]
                for i in range(0, len(record["text"]), GUTENBERG_PIECE_CHARS)
            ]
            if "pg_id" in record
            else [record["text"]]
        )
    ]


def _spread_sample(documents: list[str], chars: int) -> list[str]:
    """Evenly spaced documents (deterministic) until `chars` characters are collected."""
    total = sum(map(len, documents))
    stride = max(1, int(total / max(chars, 1)))
    picked, size = [], 0
    for start in range(stride):
        for doc in documents[start::stride]:
            picked.append(doc)
            size += len(doc)
            if size >= chars:
                return picked
    return picked


def prepare_text(cache_dir: Path, corpus_dirs: list[Path], split: str, tokens: int) -> Path:
    """A JSONL text file with about `tokens` tokens, an equal share from each corpus, written once and reused."""
    sources = [str(folder.resolve()) for folder in corpus_dirs]
    sampling = json.dumps([sources, GUTENBERG_PIECE_CHARS])
    path = cache_dir / f"{split}-{tokens}-{hashlib.sha256(sampling.encode()).hexdigest()[:8]}.jsonl"
    if not path.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        chars_per_corpus = int(tokens * CHARS_PER_TOKEN / len(sources))
        records = []
        for source in sources:
            records += [
                {"text": text, "source": source}
                for text in _spread_sample(_documents(Path(source), split), chars_per_corpus)
            ]
        staging = path.with_suffix(".tmp")
        staging.write_text("".join(json.dumps(record) + "\n" for record in records))
        staging.replace(path)
    return path


# ---- training ---------------------------------------------------------------------------------------------------
def lm_loss_only(model: torch.nn.Module, inputs: Any, output: Any) -> Any:
    """Forward hook: in evaluation, the model's loss without its auxiliary terms, so that the Trainer's `eval_loss` is the
    LM cross entropy alone, comparable across rows (UltraMem's TDQKR aux loss, and Mixtral's 0.01 x router
    load-balancing loss, about +0.02, are the size of the differences the paper reports)."""
    if model.training or getattr(output, "loss", None) is None:
        return output
    if getattr(output, "lm_loss", None) is not None:  # UltraMem: loss = lm_loss + aux_loss
        output.loss = output.lm_loss
    elif getattr(output, "aux_loss", None) is not None:  # Mixtral: loss = LM + router_aux_loss_coef x aux_loss
        output.loss = output.loss - model.router_aux_loss_coef * output.aux_loss
    return output


class EvaluateLanguageModelLoss(TrainerCallback):
    """Puts `lm_loss_only` on the model the Trainer trains, for every evaluation of the run, the final one included."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, D102
        model.register_forward_hook(lm_loss_only)


def train_arguments(row: Row, seed: int, settings: dict[str, Any], data: dict[str, Path], output_dir: Path):
    """The typed `ultramem.training.train` arguments of one run, and the same as an `ultramem-train` command line: the
    Trainer evaluates at step 0, every `max_steps / eval_points` steps and on the saved model."""
    model = {"config_file": str(row.config_file)}
    data_ = {"train_file": str(data["train"]), "validation_file": str(data["valid"]), "block_size": settings["block_size"],
             "max_eval_samples": settings["eval_blocks"], "eval_sample_seed": VALIDATION_SEED}  # fmt: skip
    training = {"per_device_train_batch_size": settings["batch_size"], "per_device_eval_batch_size": settings["batch_size"],
                "max_steps": settings["max_steps"], "learning_rate": settings["learning_rate"],
                "eval_strategy": "steps", "eval_steps": max(1, round(settings["max_steps"] / settings["eval_points"])),
                "eval_on_start": True, "logging_steps": settings["logging_steps"], "diagnostics_batch_size": 2,
                "seed": seed, "output_dir": str(output_dir), "save_strategy": "no", "report_to": "none",
                "disable_tqdm": True, **row.training_arguments}  # fmt: skip
    if settings["bf16"]:  # the Trainer refuses bf16 without an accelerator unless told to use the CPU
        training.update(bf16=True, **({} if torch.cuda.is_available() else {"use_cpu": True}))
    argv = [text for key, value in {**model, **data_, **training}.items()
            for text in (f"--{key}", str(value).lower() if isinstance(value, bool) else str(value))]  # fmt: skip
    return (ModelArguments(**model), DataArguments(**data_), UltraMemTrainingArguments(**training)), argv


def counts(config: dict[str, Any]) -> dict[str, float]:
    """Total/activated parameters, FLOPs per token (presets' meta-device count) and the sparse/dense split."""
    result = dict(sizing.count_parameters(built_config(config)))
    result["dense"] = result["total"] - result["sparse"]
    return result


def train_one(row: Row, seed: int, settings: dict[str, Any], data: dict[str, Path], work: Path) -> dict[str, Any]:
    """Train one row with one seed; returns its record (curve, final losses, wall time, diagnostics)."""
    steps = settings["max_steps"]
    output_dir = work / f"{row.key}-seed{seed}"
    arguments, argv = train_arguments(row, seed, settings, data, output_dir)
    start = time.perf_counter()
    result = train(*arguments, callbacks=[EvaluateLanguageModelLoss()])
    wall = time.perf_counter() - start
    shutil.rmtree(output_dir)  # the benchmark keeps the curve, not the weights
    tokens_per_step = settings["batch_size"] * settings["block_size"]
    # the last evaluation of a step wins: the final one is of the saved model, its query statistics recomputed
    losses = {log["step"]: log["eval_loss"] for log in result.log_history if "eval_loss" in log}
    curve = [
        {"step": step, "val_loss": loss, "tokens": step * tokens_per_step} for step, loss in sorted(losses.items())
    ]
    train_logs = [log for log in result.log_history if "loss" in log]
    tail = [log for log in train_logs if log["step"] > steps * 0.9] or train_logs[-1:]
    loss_key = "lm_loss" if "lm_loss" in tail[-1] else "loss"
    return {
        "config_key": row.key,
        "seed": seed,
        "argv": ["ultramem-train", *argv],
        "curve": curve,
        "train_loss": statistics.fmean(log[loss_key] for log in tail),
        "train_loss_includes_router_loss": loss_key == "loss" and row.config["model_type"] == "mixtral",
        "val_loss": curve[-1]["val_loss"],
        "tokens": steps * tokens_per_step,
        "wall_s": wall,
        "final_diagnostics": {k: v for k, v in train_logs[-1].items() if k.startswith("memory/")},
        "held_out_health": held_out_health(result.trainer, settings["bf16"]),
    }


def held_out_health(trainer: Any, bf16: bool) -> dict[str, float]:
    """`retrieval_diagnostics` of the saved model (its query statistics recomputed with the final weights) on the first
    validation blocks; {} for a model without memory layers. Measured inside training, before that recomputation,
    stale statistics made healthy layers look collapsed."""
    model = trainer.model
    if not (getattr(model.config, "memory_layers", None) or getattr(model.config, "ngram_layers", None)):
        return {}
    blocks = torch.tensor(trainer.eval_dataset[:HEALTH_BLOCKS]["input_ids"], device=next(model.parameters()).device)
    with torch.autocast(blocks.device.type, dtype=torch.bfloat16, enabled=bf16):
        return retrieval_diagnostics(model, blocks)


# ---- reporting --------------------------------------------------------------------------------------------------
def summarize(rows: list[Row], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row: mean and spread over its seeds, the difference to the reference row, parameter counts.

    The reference is the previous row in the ladder (one change at a time), the first row (Dense) in the comparison,
    and each family's first row ("none") in the query-normalisation group.
    """
    table = []
    reference: dict[str, dict[int, float]] = {}  # group -> seed -> validation loss of the reference row
    for row in rows:
        key = row.key
        mine = [run for run in runs if run["config_key"] == key]
        if not mine:
            continue
        vals = [run["val_loss"] for run in mine]
        by_seed = {run["seed"]: run["val_loss"] for run in mine}
        group = row.name.split(" (")[0] if row.group == "query_norm" else row.group  # its family there
        diff, diff_se = _paired_difference(by_seed, reference.get(group))
        entry = {
            "group": row.group,
            "name": row.name,
            "config_file": str(row.config_file.relative_to(ROOT.parent)),
            "training_arguments": row.training_arguments,
            "config_key": key,
            "seeds": [run["seed"] for run in mine],
            "train_loss": statistics.fmean(run["train_loss"] for run in mine),
            "train_loss_includes_router_loss": any(run["train_loss_includes_router_loss"] for run in mine),
            "val_loss": statistics.fmean(vals),
            "val_loss_std": statistics.stdev(vals) if len(vals) > 1 else None,
            "perplexity": math.exp(statistics.fmean(vals)),
            "diff_to_reference": diff,
            "diff_to_reference_se": diff_se,
            "counts": counts(row.config),
            "wall_s": statistics.fmean(run["wall_s"] for run in mine),
            "final_diagnostics": {
                name: statistics.fmean(run["final_diagnostics"][name] for run in mine)
                for name in mine[0]["final_diagnostics"]
            },
            "held_out_health": {  # runs recorded before it have none
                name: statistics.fmean(run["held_out_health"][name] for run in mine)
                for name in mine[0].get("held_out_health", {})
            },
        }
        if row.group in ("ladder", "v2_ladder") or group not in reference:
            reference[group] = by_seed
        table.append(entry)
    return table


def _paired_difference(row: dict[int, float], reference: dict[int, float] | None) -> tuple[float | None, float | None]:
    """Mean difference to the reference over the seeds both have (same seed = same data order), and its standard
    error when there are several; the difference of the means when they share no seed."""
    if reference is None:
        return None, None
    shared = sorted(set(row) & set(reference))
    if not shared:
        return statistics.fmean(row.values()) - statistics.fmean(reference.values()), None
    diffs = [row[seed] - reference[seed] for seed in shared]
    return statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None


def pooled_seed_std(table: list[dict[str, Any]]) -> float | None:
    """Pooled standard deviation of the validation loss over the rows trained with several seeds."""
    pairs = [(len(e["seeds"]) - 1, e["val_loss_std"]) for e in table if e["val_loss_std"] is not None]
    dof = sum(d for d, _ in pairs)
    return math.sqrt(sum(d * s * s for d, s in pairs) / dof) if dof else None


def corpus_label(meta: dict[str, Any]) -> str:
    """The corpora a results file was measured on, as its command gave them (`--corpus-dir`, or the default)."""
    shipped = Path(embedded_corpus_files()["train"]).parent.resolve()
    folders = [Path(folder) for folder in meta.get("corpus_dirs", [str(shipped)])]
    names = ["the shipped Gutenberg slice" if folder.resolve() == shipped else folder.name for folder in folders]
    return " and ".join(names) + (" in equal shares" if len(names) > 1 else "")


def markdown(table: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    spread = pooled_seed_std(table)
    machine = meta["machine"]
    gpu = machine.get("gpu") or (machine["device"] if machine.get("device_type") == "cuda" else None)
    lines = [
        f"# Quality at fixed compute ({meta['scale']})",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {machine['cpu']}, {machine['cpu_count']} cores, torch {machine['torch']}"
        + (f", {gpu}" if gpu else "")
        + "  ",
        f"Per run: {meta['settings']['max_steps']} steps x {meta['settings']['batch_size']} x {meta['settings']['block_size']} tokens "
        f"= {meta['tokens_per_run']:,} training tokens; validation: {meta['settings']['eval_blocks']} blocks "
        f"({meta['eval_tokens']:,} tokens of the valid splits of {corpus_label(meta)}); peak LR {meta['settings']['learning_rate']}; "
        f"bf16 autocast: {meta['settings']['bf16']}.  ",
        "Seed spread (pooled std of the validation loss over rows with several seeds): "
        + (f"**{spread:.4f}**" if spread is not None else "not measured (one seed per row)"),
        "",
        "Diff: mean over seeds of the paired difference (same seed = same initialization stream and data order) "
        "± its standard error.",
        "",
        "Validation loss = LM cross entropy only. Params exclude embeddings and head; Dense = all but the value tables "
        "(memory) or experts (MoE), Sparse = value tables / experts; FLOPs = 2 x activated params per token. "
        "Retrieval health, `retrieval_diagnostics` of the trained model on "
        f"{HEALTH_BLOCKS} held-out blocks: Usage = share of each memory layer's value rows read, over what as many "
        "uniform picks would read (1.0 = as spread as chance), as mean over layers / worst layer; Input cos = mean "
        "cosine of a memory layer's inputs across tokens (near 1: every token asks the same), worst layer; Output std "
        "of the memory layers.",
        "",
    ]
    for group, (title, diff_title) in GROUPS.items():
        entries = [e for e in table if e["group"] == group]
        if not entries:
            continue
        lines += [
            f"## {title}",
            "",
            f"| Row | Seeds | Train loss | Valid loss | Valid std | {diff_title} | PPL | Dense params (M) | Sparse params (M) | Activated (M) | FLOPs/token (M) | Usage mean / min | Input cos max | Output std | Min/run |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for e in entries:
            c = e["counts"]
            std = f"{e['val_loss_std']:.4f}" if e["val_loss_std"] is not None else "-"
            diff = f"{e['diff_to_reference']:+.4f}" if e["diff_to_reference"] is not None else "-"
            if e["diff_to_reference_se"] is not None:
                diff += f" ± {e['diff_to_reference_se']:.4f}"
            train = f"{e['train_loss']:.4f}" + ("*" if e["train_loss_includes_router_loss"] else "")
            health = e.get("held_out_health") or {}
            usage = (
                f"{health['usage_vs_uniform']:.2f} / {health['min_usage_vs_uniform']:.2f}"
                if "usage_vs_uniform" in health
                else "-"
            )
            if "min_ngram_usage_vs_uniform" in health:  # the n-gram memories' worst layer, and its hash collisions
                ngram = f"n-gram {health['min_ngram_usage_vs_uniform']:.2f} ({health['max_ngram_collision_rate']:.0%} coll.)"
                usage = ngram if usage == "-" else f"{usage}; {ngram}"
            cosine = f"{health['max_input_cosine']:.2f}" if "max_input_cosine" in health else "-"
            output_std = health.get("memory_output_std", e["final_diagnostics"].get("memory/memory_output_std"))
            lines.append(
                f"| {e['name']} | {len(e['seeds'])} | {train} | {e['val_loss']:.4f} | {std} | {diff} | {e['perplexity']:.1f} | "
                f"{c['dense'] / 1e6:.2f} | {c['sparse'] / 1e6:.2f} | {c['activated'] / 1e6:.2f} | {c['flops_per_token'] / 1e6:.2f} | "
                f"{usage} | {cosine} | {'-' if output_std is None else f'{output_std:.2f}'} | {e['wall_s'] / 60:.1f} |"
            )
        lines.append("")
    if any(e["train_loss_includes_router_loss"] for e in table):
        lines.append(
            "\\* Mixtral's logged training loss includes its router load-balancing term (0.01 x ~2); its validation loss does not."
        )
    return "\n".join(lines) + "\n"


def plot(table: list[dict[str, Any]], runs: list[dict[str, Any]], group: str, path: Path, title: str) -> None:
    """Left: validation loss against training tokens (seed mean; shaded: range over seeds). Right: the final
    validation loss of each row, every seed as a dot joined to the same seed of the neighbouring rows."""
    entries = [e for e in table if e["group"] == group]
    if not entries:
        return
    curves, bands = {}, []
    for entry in entries:
        mine = [run["curve"] for run in runs if run["config_key"] == entry["config_key"]]
        length = min(map(len, mine))
        tokens = [mine[0][i]["tokens"] for i in range(1, length)]
        values = [[curve[i]["val_loss"] for curve in mine] for i in range(1, length)]
        label = f"{entry['name']} ({entry['val_loss']:.3f}, {len(mine)} seed{'s' if len(mine) > 1 else ''})"
        curves[label] = (tokens, [statistics.fmean(v) for v in values])
        if len(mine) > 1:
            bands.append((label, tokens, [min(v) for v in values], [max(v) for v in values]))

    def shade(axis) -> None:  # the range over seeds, in its curve's colour
        colors = {line.get_label(): line.get_color() for line in axis.get_lines()}
        for label, tokens, low, high in bands:
            axis.fill_between(tokens, low, high, color=colors[label], alpha=0.1)

    key = lambda e, seed: next(
        (r["val_loss"] for r in runs if r["config_key"] == e["config_key"] and r["seed"] == seed), math.nan
    )  # noqa: E731
    finals = {
        f"seed {seed}": (range(len(entries)), [key(e, seed) for e in entries])
        for seed in sorted({r["seed"] for r in runs})
    }
    finals["mean"] = (range(len(entries)), [e["val_loss"] for e in entries])
    ticks = lambda axis: axis.set_xticks(
        range(len(entries)), [e["name"] for e in entries], rotation=60, ha="right", fontsize=8
    )  # noqa: E731
    report.plot(path, [
        report.Panel(title, "validation loss (LM cross entropy)", curves, "training tokens", xlog=False, draw=shade),
        report.Panel("final loss per row and seed", "final validation loss", finals, xlog=False, colors={"mean": "black"}, draw=ticks),
    ])  # fmt: skip


def write_results(args: argparse.Namespace, rows: list[Row], runs: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
    """Rewrite the JSON, the Markdown tables and the plots of every group from all runs so far."""
    table = summarize(rows, runs)
    payload = {"meta": meta, "table": table, "pooled_seed_std": pooled_seed_std(table), "runs": runs}
    path = report.write_json(args.results_dir / f"{args.name}.json", payload)
    path.with_suffix(".md").write_text(markdown(table, meta))
    if not args.no_plot:
        for group, (title, _) in GROUPS.items():
            plot(table, runs, group, path.with_name(f"{args.name}_{group}.png"), f"{title} ({meta['scale']})")
    return path


def planned_runs(rows: list[Row], seeds: int, seeded: set[str]) -> list[tuple[Row, int]]:
    """Seed 0 of every distinct config first (in table order), then the extra seeds of the seeded rows."""
    plan: list[tuple[Row, int]] = []
    seen: set[tuple[str, int]] = set()
    for seed in range(seeds):
        for row in rows:
            key = (row.key, seed)
            if key not in seen and (seed == 0 or row.name in seeded):
                seen.add(key)
                plan.append((row, seed))
    return plan


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.make_parser(__doc__, "quality_<scale>", device=False, timed=False)
    add = parser.add_argument
    add("--output-dir", dest="results_dir", type=Path, help=argparse.SUPPRESS)  # as the recorded commands spell it
    add("--scale", default="tiny", choices=sorted(COMPARISON))
    add("--rows", default="all", help=f"all, or comma-separated groups ({', '.join(GROUPS)}) or row names")
    add("--seeds", type=int, default=2, help="seeds of the --seeded-rows (others get seed 0 only)")
    add("--seeded-rows", default=",".join(SEEDED_ROWS), help="comma-separated row names given --seeds seeds, or all")
    add("--max-steps", type=int, default=160)
    add("--batch-size", type=int, default=8)
    add("--block-size", type=int, default=128)
    add("--learning-rate", type=float, default=1e-3)
    add("--eval-points", type=int, default=8, help="validation evaluations along each run (plus step 0)")
    add("--eval-blocks", type=int, default=48, help="validation blocks of --block-size tokens")
    add("--bf16", action="store_true", help="bf16 autocast for training and validation")
    add("--corpus-dir", type=Path, nargs="+", default=[Path(embedded_corpus_files()["train"]).parent],
        help="corpus folder(s) of train.jsonl.xz and valid.jsonl.xz, sampled in equal shares; default: the shipped "
        "Gutenberg slice")  # fmt: skip
    add("--cache-dir", type=Path, default=Path.home() / ".cache" / "ultramem" / "bench_quality")
    add("--write-configs", action="store_true", help="write the per-row config JSONs and training arguments, and exit")
    add("--report-only", action="store_true", help="rewrite table and plots from the results JSON, train nothing")
    args = parser.parse_args(argv)
    cli.resolve(args, f"quality_{args.scale}")
    for flag in ("seeds", "max_steps", "batch_size", "block_size", "eval_points", "eval_blocks"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if args.eval_points > args.max_steps:
        parser.error(f"--eval-points {args.eval_points}: allowed range is 1..--max-steps ({args.max_steps})")
    if not args.learning_rate > 0:
        parser.error(f"--learning-rate {args.learning_rate}: must be positive")
    try:
        check_corpus_dirs(args.corpus_dir)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> Path:
    """Train every planned run not yet in the results JSON and rewrite the results after each; returns the JSON path."""
    args = parse_args(argv)
    if args.write_configs:
        for path in write_configs(args.scale):
            print(path)
        return CONFIG_DIR / args.scale
    rows = load_rows(args.scale, args.rows)
    json_path = args.results_dir / f"{args.name}.json"
    if args.report_only:
        recorded = json.loads(json_path.read_text())
        return write_results(args, rows, recorded["runs"], recorded["meta"])
    seeded = (
        {row.name for row in rows}
        if args.seeded_rows == "all"
        else {name.strip() for name in args.seeded_rows.split(",")}
    )
    known = [name for _, name, _, _ in row_configs(args.scale)]
    if seeded - set(known):
        raise ValueError(f"--seeded-rows: unknown row(s) {sorted(seeded - set(known))}; allowed: all or {known}")
    settings = {
        "max_steps": args.max_steps,
        "batch_size": args.batch_size,
        "block_size": args.block_size,
        "learning_rate": args.learning_rate,
        "eval_points": args.eval_points,
        "eval_blocks": args.eval_blocks,
        "logging_steps": max(1, args.max_steps // 10),
        "bf16": args.bf16,
        "gutenberg_piece_chars": GUTENBERG_PIECE_CHARS,  # the data sample: runs made with another are not comparable
        "validation_draw": {"pool": VALIDATION_POOL, "seed": VALIDATION_SEED},
    }
    tokens_per_run = args.max_steps * args.batch_size * args.block_size
    data = {
        "train": prepare_text(args.cache_dir, args.corpus_dir, "train", int(tokens_per_run * 1.2)),
        "valid": prepare_text(
            args.cache_dir, args.corpus_dir, "valid", int(args.eval_blocks * args.block_size * VALIDATION_POOL)
        ),
    }
    meta = {
        "scale": args.scale,
        "command": "python benchmarks/bench_quality.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": env.environment("cuda" if torch.cuda.is_available() else "cpu"),
        "settings": settings,
        "tokens_per_run": tokens_per_run,
        "corpus_dirs": [str(folder) for folder in args.corpus_dir],
        "eval_tokens": args.eval_blocks * args.block_size,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    runs: list[dict[str, Any]] = []
    if json_path.is_file():
        previous = json.loads(json_path.read_text())
        if previous["meta"]["settings"] != settings:
            raise ValueError(
                f"{json_path} holds runs made with other settings ({previous['meta']['settings']}); "
                "give another --results-dir, or delete it to start over"
            )
        runs = previous["runs"]
        meta["started"] = previous["meta"]["started"]
    done = {(run["config_key"], run["seed"]) for run in runs}
    for row, seed in planned_runs(rows, args.seeds, seeded):
        if (row.key, seed) in done:
            continue
        print(f"[bench_quality] {row.group} / {row.name} / seed {seed}", flush=True)
        runs.append(train_one(row, seed, settings, data, args.cache_dir / "runs"))
        meta["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_results(args, rows, runs, meta)
        print(f"[bench_quality] val_loss {runs[-1]['val_loss']:.4f} in {runs[-1]['wall_s']:.0f} s", flush=True)
    path = write_results(args, rows, runs, meta)
    print(path.with_suffix(".md").read_text())
    return path


if __name__ == "__main__":
    main()
