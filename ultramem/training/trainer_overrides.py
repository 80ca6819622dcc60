"""Every private `Trainer` method that `ultramem.training` overrides, and the test that pins each one.

The rest of the package uses the Trainer's public surface only: `create_optimizer`, `create_scheduler`,
`compute_loss`, `log`, `save_model` and `TrainerCallback` events. What is here has no public hook in Transformers
(checked against 5.17 and 5.24, whose signatures of these methods are the same): where a checkpoint is written, how
the model and optimizer are saved and loaded, and how the Accelerator is set up. A Transformers release that changes
one of them fails the test named beside it; `PINNED_BY` lists them for `test_private_trainer_overrides_are_listed`.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints

from ultramem.training.errors import StorageError, UsageError

STAGING_PREFIX = ".incomplete-"

_RESUME = "tests/training/test_training_resume.py"
_UNIT = "tests/training/test_training_unit.py"
_DISTRIBUTED = "tests/training/test_training_distributed.py"
_MP_TRAINING = "tests/parallel/test_memory_parallel_training.py"
_MP_RESUME = "tests/parallel/test_memory_parallel_resume.py"

# (class, private method) -> the tests that fail when the override stops working
PINNED_BY: dict[tuple[str, str], tuple[str, ...]] = {
    ("AtomicCheckpointTrainer", "_get_output_dir"): (
        f"{_RESUME}::test_killed_save_leaves_only_complete_checkpoints",
        f"{_UNIT}::test_atomic_checkpoints_are_their_own_piece",
    ),
    ("AtomicCheckpointTrainer", "_save_checkpoint"): (
        f"{_RESUME}::test_killed_save_leaves_only_complete_checkpoints",
        f"{_RESUME}::test_resumed_run_matches_the_uninterrupted_one",
        f"{_RESUME}::test_a_random_kill_then_a_full_disk_resume_to_the_uninterrupted_run",
    ),
    ("CPUFSDPOverrides", "create_accelerator_and_postprocess"): (
        f"{_DISTRIBUTED}::test_torchrun_fsdp_flag_shards_for_real_or_refuses_fsdp1",
        f"{_DISTRIBUTED}::test_fsdp2_config_shards_every_parameter",
    ),
    ("CPUFSDPOverrides", "_save"): (f"{_DISTRIBUTED}::test_fsdp2_config_shards_every_parameter",),
    ("ShardedTableOverrides", "_save"): (f"{_MP_TRAINING}::test_sharded_tables_match_single_process",),
    ("ShardedTableOverrides", "_save_optimizer_and_scheduler"): (
        f"{_MP_RESUME}::test_resume_after_a_kill_continues_the_loss_sequence",
        f"{_MP_RESUME}::test_deepspeed_resume_continues_the_loss_sequence_and_the_value_schedule",
    ),
    ("ShardedTableOverrides", "_load_from_checkpoint"): (
        f"{_MP_RESUME}::test_resume_after_a_kill_continues_the_loss_sequence",
        f"{_MP_RESUME}::test_resharded_resume_continues_the_loss_sequence",
    ),
    ("ShardedTableOverrides", "_load_optimizer_and_scheduler"): (
        f"{_MP_RESUME}::test_resharded_resume_continues_the_loss_sequence",
        f"{_MP_RESUME}::test_four_processes_resume_in_one",
    ),
}


# torch's zip writer reports a failed write as a RuntimeError with one of these (its C++ stream's error, then the
# position check of its cleanup)
TORCH_WRITE_ERRORS = ("iostream error", "inline_container", "file write failed")


def _failed_to_write(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised while handling, is a failed write (not any RuntimeError)."""
    chain: BaseException | None = error
    while chain is not None:
        if isinstance(chain, (OSError, SafetensorError)) or any(text in str(chain) for text in TORCH_WRITE_ERRORS):
            return True
        chain = chain.__context__
    return False


class AtomicCheckpointTrainer(Trainer):
    """A `Trainer` whose checkpoints appear whole or not at all: a killed save never leaves a `checkpoint-N` that
    `--resume_from_checkpoint` would trust.

    The Trainer writes a checkpoint in place, file by file, into `_get_output_dir(trial)/checkpoint-N`; here that
    directory is a hidden staging folder, renamed to `checkpoint-N` once the Trainer's `_save_checkpoint` returns.
    """

    _staging_dir: str | None = None

    def _get_output_dir(self, trial: Any) -> str:
        return self._staging_dir if self._staging_dir is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        run_dir = self._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = os.path.join(run_dir, f"{STAGING_PREFIX}{name}")
        if self.args.should_save and os.path.isdir(staging):
            shutil.rmtree(staging)  # left over by a save that was killed
        self.accelerator.wait_for_everyone()
        self._staging_dir = staging
        try:
            super()._save_checkpoint(model, trial)
        except (OSError, RuntimeError, SafetensorError) as error:  # what torch, safetensors and json raise on ENOSPC
            if not _failed_to_write(error):
                raise  # a RuntimeError of anything else stays what it is
            raise self._failed_write(staging, run_dir, name, error) from error
        finally:
            self._staging_dir = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            self._publish(staging, run_dir, name)
        self.accelerator.wait_for_everyone()

    @staticmethod
    def _failed_write(staging: str, run_dir: str, name: str, error: Exception) -> StorageError:
        """Remove the partial checkpoint (its space is what a full disk needs back) and say, in one line, where the
        write failed, how much room is left there and which checkpoint a resume would use."""
        free = shutil.disk_usage(run_dir).free / 2**20
        shutil.rmtree(staging, ignore_errors=True)
        while error.__context__ is not None:  # torch's first error ("iostream error"), not its cleanup's
            error = error.__context__
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return StorageError(
            f"could not write {os.path.join(run_dir, name)} ({cause}; {free:.1f} MiB free there): removed its partial "
            f"copy; the last complete checkpoint is {get_last_checkpoint(run_dir) or 'none (a resume starts afresh)'}"
        )

    def _publish(self, staging: str, run_dir: str, name: str) -> None:
        """Rename the complete checkpoint into place, then apply `save_total_limit` as the Trainer would have."""
        final = os.path.join(run_dir, name)
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(os.path.join(staging, name), final)
        shutil.rmtree(staging)
        best = self.state.best_model_checkpoint
        if best is not None and best.startswith(staging):
            self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=self.state.best_model_checkpoint,
            use_mtime=True,
        )


class CPUFSDPOverrides(Trainer):
    """FSDP2 on CPU process groups (`ultramem.training.fsdp`): the Accelerator set up for it, and the save of a
    model whose parameters are sharded DTensors."""

    _fsdp_on_cpu = False
    _presharded: frozenset[str] = frozenset()

    def create_accelerator_and_postprocess(self) -> None:
        """Accelerate enables FSDP only for accelerator-backed process groups: on CPU (gloo) it is turned on here."""
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        from ultramem.training.fsdp import FSDP2_CONFIG, leave_presharded_to_their_owners, requested_fsdp_version

        version = None if torch.cuda.is_available() else requested_fsdp_version(self.args)
        if version is not None and version != 2:
            raise UsageError(
                f"--fsdp: FSDP{version} does not shard on CPU process groups (it would run as DDP); allowed: "
                f"fsdp_version 2 (the default of --fsdp, or accelerate launch --config_file {FSDP2_CONFIG})"
            )
        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        if version is not None and state.distributed_type == DistributedType.MULTI_CPU:
            state.distributed_type = DistributedType.FSDP
            state.fsdp_plugin = (
                FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                if self.args.fsdp_plugin_args is not None
                else FullyShardedDataParallelPlugin()  # reads the FSDP_* variables `accelerate launch` sets
            )
            self.is_fsdp_enabled = self._fsdp_on_cpu = True
        if self.is_fsdp_enabled:
            self._presharded = leave_presharded_to_their_owners(self.model, state.fsdp_plugin)

    def _saves_itself(self) -> bool:
        """On CPU Accelerate's FSDP save hands sharded DTensors to safetensors and copies FSDP's own source files as
        "model code"; on any device its full state dict would gather each presharded value table whole."""
        return self._fsdp_on_cpu or bool(self._presharded)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """`state_dict` (gathered by `FSDPTrainer.save_model`) saved as the plain model class would save it."""
        if not self._saves_itself():
            return super()._save(output_dir, state_dict)
        if not self.args.should_save:
            return None
        from torch.distributed.fsdp import FSDPModule

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        model = self.accelerator.unwrap_model(self.model)
        model_cls = next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))
        with torch.device("meta"):
            plain = model_cls(model.config)  # the same model unsharded, its tensors those of `state_dict`
        plain.save_pretrained(output_dir, state_dict=state_dict)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        return None


class ShardedTableOverrides(Trainer):
    """Sharded value tables (`--memory_parallel`): their shards and optimizer state live in DCP checkpoints of their
    own (`ultramem.parallel.checkpoint`, `ultramem.parallel.resume`), beside what the Trainer saves and loads."""

    def _tables_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer that steps the value tables: the Trainer's, or their own beside a DeepSpeed engine."""
        beside = getattr(self, "_tables_beside", None)
        return self.optimizer if beside is None else beside.optimizer

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """`save_pretrained` writes the rest (`state_dict` when the engine gathered it) and every rank streams its
        table shards in."""
        from ultramem.parallel.checkpoint import save_value_tables, sharded_tables

        tables = sharded_tables(self.model)
        if not tables:
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = self.model.state_dict() if state_dict is None else state_dict
        dense = {name: tensor for name, tensor in state.items() if name not in tables}
        super()._save(output_dir, state_dict=dense)
        save_value_tables(self.model, output_dir, self.args.should_save)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        from ultramem.parallel.checkpoint import sharded_tables
        from ultramem.parallel.resume import save_table_states, tables_left_out_of

        if not sharded_tables(self.model):
            return super()._save_optimizer_and_scheduler(output_dir)
        with tables_left_out_of(self.optimizer, self.model):
            super()._save_optimizer_and_scheduler(output_dir)
        save_table_states(self.model, self._tables_optimizer(), output_dir)
        beside = getattr(self, "_tables_beside", None)
        if beside is not None and self.args.should_save:
            beside.save_schedule(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        from ultramem.parallel.checkpoint import sharded_tables
        from ultramem.parallel.resume import has_table_states, load_dense_weights

        if not sharded_tables(self.model):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        if not has_table_states(resume_from_checkpoint):
            raise UsageError(
                f"--resume_from_checkpoint {resume_from_checkpoint} was written without --memory_parallel (no "
                "value_tables/); resume it with --memory_parallel none"
            )
        load_dense_weights(self.model, resume_from_checkpoint)  # the tables come with their optimizer state

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        from ultramem.parallel.resume import has_table_states, load_table_states

        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and has_table_states(checkpoint):
            load_table_states(self.model, self._tables_optimizer(), checkpoint)
            beside = getattr(self, "_tables_beside", None)
            if beside is not None:  # under DeepSpeed, which loaded the rest of the model above
                beside.load_schedule(checkpoint)
