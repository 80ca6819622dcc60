"""Atomic checkpoints: a killed save never leaves a `checkpoint-N` folder that `--resume_from_checkpoint` would trust.

The Trainer writes a checkpoint in place, file by file. Here it writes into a hidden staging folder that is renamed
to `checkpoint-N` once complete. The Trainer has no public hook for where a checkpoint goes, so this overrides its
`_save_checkpoint`/`_get_output_dir`; keeping that here leaves `UltraMemTrainer` to the paper's recipe.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from torch import nn
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

STAGING_PREFIX = ".incomplete-"


class AtomicCheckpointTrainer(Trainer):
    """A `Trainer` whose checkpoints appear whole or not at all (rename of a complete staging folder)."""

    _staging_dir: str | None = None

    def _get_output_dir(self, trial: Any) -> str:
        return self._staging_dir if self._staging_dir is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """Write the checkpoint into a hidden staging folder, then rename it: a killed save leaves no `checkpoint-N`."""
        run_dir = self._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = os.path.join(run_dir, f"{STAGING_PREFIX}{name}")
        if self.args.should_save and os.path.isdir(staging):
            shutil.rmtree(staging)  # left over by a save that was killed
        self.accelerator.wait_for_everyone()
        self._staging_dir = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_dir = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            self._publish(staging, run_dir, name)
        self.accelerator.wait_for_everyone()

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
