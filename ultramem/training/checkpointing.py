"""Atomic checkpoints: a killed save never leaves a `checkpoint-N` folder that `--resume_from_checkpoint` would trust.

`AtomicCheckpointTrainer` writes each checkpoint into a hidden staging folder renamed to `checkpoint-N` once complete.
The Trainer has no public hook for where a checkpoint goes, so it overrides two private methods; they live with the
package's other private overrides in `ultramem.training.trainer_overrides`.
"""

from ultramem.training.trainer_overrides import STAGING_PREFIX, AtomicCheckpointTrainer

__all__ = ["STAGING_PREFIX", "AtomicCheckpointTrainer"]
