"""Command-line arguments: model and data choices plus `TrainingArguments` with the paper's recipe as defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments
from transformers.integrations import is_tensorboard_available

PAPER_MIN_LR_RATE = 0.1  # cosine decay to 10% of the peak learning rate
# Validation blocks evaluated by default: enough for a stable loss (64k tokens at block size 512), and seconds,
# not minutes, on a CPU; the embedded corpus's validation books alone give ~1,700 blocks of 128.
DEFAULT_MAX_EVAL_SAMPLES = 128


@dataclass
class ModelArguments:
    """Which model to train: a preset, a config file, or an existing checkpoint."""

    preset: str | None = field(default=None, metadata={"help": "Name in ultramem.presets.PRESETS, e.g. tiny-ultramem."})
    config_file: str | None = field(default=None, metadata={"help": "JSON config file (config.json of a model)."})
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": "key=value pairs separated by commas, applied on top of the preset, config file or checkpoint and "
            "checked like them; values are JSON or Python literals, so lists and dicts work: "
            '\'num_hidden_layers=2,memory_layers=[[0,1]]\' or \'rope_parameters={"rope_type": "default", '
            '"rope_theta": 10000.0}\'.'
        },
    )
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Checkpoint to continue training from (weights are loaded)."}
    )


@dataclass
class DataArguments:
    """Text data: local files or a `datasets` name; the embedded Gutenberg slice when nothing is given."""

    train_file: str | None = field(
        default=None, metadata={"help": "Text, JSON/JSONL (optionally .xz/.gz) or parquet file."}
    )
    validation_file: str | None = field(default=None, metadata={"help": "Same formats as --train_file."})
    dataset_name: str | None = field(default=None, metadata={"help": "A `datasets` name (needs the Hub)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration of --dataset_name."})
    text_column: str = field(default="text", metadata={"help": "Column holding the raw text."})
    block_size: int = field(default=512, metadata={"help": "Tokens per packed training sequence."})
    validation_split_percentage: float = field(
        default=5.0,
        metadata={"help": "Percent of the packed training blocks held out when no validation set is given."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep at most this many training blocks."})
    max_eval_samples: int = field(
        default=DEFAULT_MAX_EVAL_SAMPLES,
        metadata={
            "help": f"Evaluate on at most this many validation blocks (default {DEFAULT_MAX_EVAL_SAMPLES}; 0: all). "
            "They are drawn at random, without replacement, from the whole validation set (--eval_sample_seed), "
            "then kept in file order: the same blocks in every run, not just the first ones."
        },
    )
    eval_sample_seed: int = field(
        default=0,
        metadata={
            "help": "Seed of the --max_eval_samples draw (independent of --seed, so runs that differ in --seed "
            "are evaluated on the same blocks)."
        },
    )
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})


def _has_accelerator() -> bool:
    """Whether PyTorch sees a device other than the CPU (CUDA, ROCm, MPS, XPU, ...)."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None:
        return accelerator.is_available()
    return torch.cuda.is_available() or torch.backends.mps.is_available()


@dataclass
class UltraMemTrainingArguments(TrainingArguments):
    """`TrainingArguments` whose defaults are the paper's recipe: AdamW(0.9, 0.95), wd 0.1, 1% warmup, cosine to 10%,
    and the memory value tables at 10x the learning rate, falling linearly to 1x (`value_lr_*`; None: that default,
    or the preset's recommendation under `train`)."""

    learning_rate: float = field(default=6e-4, metadata={"help": "Peak learning rate of the dense parameters."})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay."})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2."})
    lr_scheduler_type: str = field(default="cosine_with_min_lr", metadata={"help": "Base LR schedule."})
    warmup_steps: float = field(default=0.01, metadata={"help": "Warmup steps, or a fraction of training if < 1."})
    logging_steps: float = field(default=10, metadata={"help": "Log every X steps (or fraction of training if < 1)."})
    report_to: None | str | list[str] = field(
        default=None, metadata={"help": "Integrations to report to; default: tensorboard when installed."}
    )
    value_lr_multiplier: float | None = field(
        default=None,
        metadata={
            "help": "Learning rate of the memory value tables at the first step, as a multiple of --learning_rate "
            "(default 10, the paper's, or what --preset recommends; ultramem < 0.2 read it from the model config, "
            "which is still honoured when this is not given)."
        },
    )
    value_lr_decay: bool | None = field(
        default=None,
        metadata={
            "help": "true: the value tables' multiplier falls linearly to 1 by the last step (default, the paper's); "
            "false: it stays constant (what the PKM presets recommend)."
        },
    )
    diagnostics_batch_size: int = field(
        default=4, metadata={"help": "Validation blocks used for the memory diagnostics at each log (0: off)."}
    )
    query_statistics_batches: int = field(
        default=8,
        metadata={
            "help": "With a query_norm that uses batch statistics in training (batch_norm, batch_whiten): training "
            "batches on which the memory queries' running statistics are recomputed with the final weights before the "
            "model is saved (0: keep the statistics gathered while training). running_whiten needs none."
        },
    )
    memory_parallel: str = field(
        default="none",
        metadata={
            "help": "Shard the value tables over the data-parallel ranks: none, number (rows), dimension (columns) "
            "or auto (the smaller predicted communication volume).",
            "choices": ["none", "number", "dimension", "auto"],
        },
    )
    memory_parallel_size: int | None = field(
        default=None,
        metadata={"help": "Ranks per shard group (tables replicated across groups); default: the world size."},
    )

    def __post_init__(self) -> None:
        if self.query_statistics_batches < 0:
            raise ValueError(f"--query_statistics_batches {self.query_statistics_batches}: must be >= 0")
        if self.value_lr_multiplier is not None and not self.value_lr_multiplier > 0:
            raise ValueError(f"--value_lr_multiplier {self.value_lr_multiplier}: must be > 0")
        if self.lr_scheduler_type == "cosine_with_min_lr" and not self.lr_scheduler_kwargs:
            self.lr_scheduler_kwargs = {"min_lr_rate": PAPER_MIN_LR_RATE}
        if not torch.cuda.is_available():
            self.dataloader_pin_memory = False  # pinning needs an accelerator; on CPU it only warns
        if (self.bf16 or self.bf16_full_eval) and not self.use_cpu and not _has_accelerator():
            self.use_cpu = True  # the Trainer refuses bf16 without an accelerator unless told to train on the CPU
        if self.report_to is None:
            self.report_to = ["tensorboard"] if is_tensorboard_available() else "none"
        super().__post_init__()
