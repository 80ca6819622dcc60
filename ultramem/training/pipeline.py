"""`train()`: the whole `ultramem-train` run as a function of typed arguments, for scripts and notebooks.

    from ultramem.training import DataArguments, ModelArguments, UltraMemTrainingArguments, train

    result = train(
        ModelArguments(preset="tiny-ultramem"),
        DataArguments(block_size=128, max_eval_samples=32),  # the embedded corpus when no file is named
        UltraMemTrainingArguments(output_dir="runs/tiny", max_steps=100, report_to="none"),
        callbacks=[],  # TrainerCallback instances, added to the Trainer's
    )
    result.metrics["eval_loss"], result.metrics["perplexity"], result.log_history[-1]

The three dataclasses are the ones `ultramem-train` parses its flags into (`ultramem-train --help` lists every field),
with the paper's recipe as defaults; a preset's recipe may differ (`ultramem.presets.get_training_arguments`, the PKM
presets' constant value LR), applied to the training arguments the caller leaves unset. Every check of the command line runs here too, before any data is read:
a bad value raises `UsageError` (a `ValueError`) whose message is one line naming the argument. Under a launcher
on CPU (torchrun, accelerate launch) give `use_cpu=True`, which the command line sets itself.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig, TrainerCallback, default_data_collator, set_seed
from transformers.trainer_utils import get_last_checkpoint

from ultramem.ngram_memory import use_canonical_ids
from ultramem.tokenization import load_tokenizer
from ultramem.training.arguments import DataArguments, ModelArguments, UltraMemTrainingArguments
from ultramem.training.data import load_raw_datasets, tokenize_and_pack
from ultramem.training.errors import UsageError
from ultramem.training.fsdp import ShardingReport
from ultramem.training.model_setup import (
    apply_preset_training_arguments,
    build_config,
    build_model,
    check_engine_leaves_tables,
    max_positions,
    shard_value_tables,
)
from ultramem.training.trainer import UltraMemTrainer


@dataclass
class TrainResult:
    """What a finished `train()` leaves: the final evaluation, the training summary and the log of every step."""

    output_dir: str
    metrics: dict[str, float]  # final evaluation: eval_loss, perplexity, eval_runtime, ...
    train_metrics: dict[str, float]  # train_loss, train_runtime, ...
    log_history: list[dict[str, Any]]  # the Trainer's: one entry per training log and evaluation
    resumed_from: str | None  # the checkpoint training continued from, if any
    trainer: UltraMemTrainer = field(repr=False)  # holds the trained model (`trainer.model`)


def query_statistics_batches(blocks: Any, training_args: UltraMemTrainingArguments) -> list[torch.Tensor]:
    """This rank's share of the first `query_statistics_batches` global batches of training blocks, on its device:
    summed over ranks, the statistics are those one process would take from the same global batches. Read by index,
    without touching the data order's random state."""
    size, ranks, rank = (training_args.per_device_train_batch_size, training_args.world_size,
                         training_args.process_index)  # fmt: skip
    count = min(training_args.query_statistics_batches, len(blocks) // (size * ranks))
    starts = [step * size * ranks + rank * size for step in range(count)]
    return [torch.tensor(blocks[start : start + size]["input_ids"], device=training_args.device) for start in starts]


def check_block_size(block_size: int, config: PretrainedConfig) -> None:
    limit = max_positions(config)
    if block_size < 1 or (limit is not None and block_size > limit):
        raise UsageError(
            f"--block_size {block_size}: allowed range is 1..{limit} (the model's max_position_embeddings)"
        )


def check_ranges(data: DataArguments, args: UltraMemTrainingArguments) -> None:
    """Values rejected only deep inside tokenizing or `train()` (after the model is built), checked first."""
    if data.max_train_samples is not None and data.max_train_samples < 1:
        raise UsageError(f"--max_train_samples {data.max_train_samples}: must be at least 1")
    if data.max_eval_samples < 0:
        raise UsageError(f"--max_eval_samples {data.max_eval_samples}: must be >= 0 (0: all validation blocks)")
    if not args.learning_rate >= 0:
        raise UsageError(f"--learning_rate {args.learning_rate}: must be >= 0")
    for flag in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} {getattr(args, flag)}: must be at least 1")


def check_deepspeed(args: UltraMemTrainingArguments) -> None:
    """Report DeepSpeed/Trainer contradictions and a missing launcher now, in one line, not after the model is built."""
    ds_config = getattr(args, "hf_deepspeed_config", None)
    if ds_config is None:
        return
    if ds_config.mismatches:
        found = "; ".join(line.lstrip("- ") for line in ds_config.mismatches)
        raise UsageError(f"--deepspeed {args.deepspeed} contradicts the Trainer arguments: {found}")
    if "LOCAL_RANK" not in os.environ:  # without a launcher DeepSpeed falls back to MPI discovery (mpi4py)
        raise UsageError(
            f"--deepspeed {args.deepspeed}: needs a launcher, even for one process: "
            "`deepspeed --num_gpus N --module ultramem.training ...` or "
            "`accelerate launch --config_file ultramem/configs/accelerate/zero2.yaml -m ultramem.training ...`"
        )


def resolve_resume(args: UltraMemTrainingArguments) -> str | None:
    """The checkpoint folder `--resume_from_checkpoint` names: `true`/`last` is the newest complete `checkpoint-N`
    in `--output_dir`. A value that names none is one error line, before any data is read."""
    value = args.resume_from_checkpoint
    if value is None or value is False or str(value).lower() in ("", "false", "none"):
        return None
    if value is True or str(value).lower() in ("true", "last"):
        last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
        if last is None:
            raise UsageError(
                f"--resume_from_checkpoint {value}: --output_dir {args.output_dir} holds no checkpoint-N folder to "
                "resume from; give a checkpoint folder, or leave the flag out to start from scratch"
            )
        return last
    if not os.path.isdir(value):
        raise UsageError(f"--resume_from_checkpoint {value}: no such checkpoint folder")
    return str(value)


def _checkpoint_step(checkpoint: str) -> str:
    try:
        with open(os.path.join(checkpoint, "trainer_state.json"), encoding="utf-8") as handle:
            return f"step {json.load(handle)['global_step']}"
    except (OSError, ValueError, KeyError):
        return "step unknown: no trainer_state.json"


def train(
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: UltraMemTrainingArguments,
    callbacks: list[TrainerCallback] | None = None,
) -> TrainResult:
    """Train, save the model (with tokenizer) to `training_args.output_dir`, evaluate; see the module docstring."""
    check_ranges(data_args, training_args)
    config = build_config(model_args)
    recommended = apply_preset_training_arguments(model_args, training_args, config)
    check_block_size(data_args.block_size, config)
    check_engine_leaves_tables(training_args)
    check_deepspeed(training_args)
    resume = resolve_resume(training_args)
    tokenizer = load_tokenizer(model_max_length=max_positions(config) or data_args.block_size)
    blocks = tokenize_and_pack(load_raw_datasets(data_args), tokenizer, data_args, training_args.main_process_first)

    if training_args.should_log:
        print(
            f"ultramem-train: {len(blocks['train'])} training blocks; evaluating on {len(blocks['validation'])} "
            f"validation blocks (--max_eval_samples {data_args.max_eval_samples}, 0: all; drawn across the whole "
            f"validation set with --eval_sample_seed {data_args.eval_sample_seed})",
            file=sys.stderr,
        )
        if recommended:
            flags = " ".join(f"--{name} {str(value).lower()}" for name, value in recommended.items())
            print(f"ultramem-train: --preset {model_args.preset} trains with {flags} (its recipe)", file=sys.stderr)
        if resume is not None:
            print(f"ultramem-train: resuming from {resume} ({_checkpoint_step(resume)})", file=sys.stderr)
    set_seed(training_args.seed)
    model = build_model(model_args, config, defer_tables=training_args.memory_parallel != "none")
    if model_args.model_name_or_path is None:  # n-gram memories hash the tokenizer's canonical ids from the start
        use_canonical_ids(model, tokenizer)
    if training_args.ddp_find_unused_parameters is None and model.config.model_type == "ultramem":
        # Every parameter of an UltraMem (or its dense preset) takes part in each step: DDP need not search the graph
        # for unused ones (the Trainer's default without gradient checkpointing), which it warned about on every rank
        training_args.ddp_find_unused_parameters = False
    shard_value_tables(model, training_args, data_args.block_size, model_args.model_name_or_path)
    diagnostics_count = min(training_args.diagnostics_batch_size, len(blocks["validation"]))
    trainer = UltraMemTrainer(
        model=model,
        args=training_args,
        train_dataset=blocks["train"],
        eval_dataset=blocks["validation"],
        processing_class=tokenizer,
        data_collator=default_data_collator,
        callbacks=[ShardingReport(), *(callbacks or [])],
        diagnostics_input_ids=torch.tensor(blocks["validation"][:diagnostics_count]["input_ids"]),
        query_statistics_inputs=query_statistics_batches(blocks["train"], training_args),
    )
    train_output = trainer.train(resume_from_checkpoint=resume)
    trainer.recalibrate_query_statistics()  # with the final weights (the best ones, with load_best_model_at_end)
    trainer.save_model()
    trainer.log_metrics("train", train_output.metrics)
    trainer.save_metrics("train", train_output.metrics)
    trainer.save_state()

    metrics = trainer.evaluate()
    metrics["perplexity"] = math.exp(metrics["eval_loss"]) if metrics["eval_loss"] < 700 else float("inf")
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    return TrainResult(
        output_dir=training_args.output_dir,
        metrics=metrics,
        train_metrics=dict(train_output.metrics),
        log_history=list(trainer.state.log_history),
        resumed_from=resume,
        trainer=trainer,
    )
