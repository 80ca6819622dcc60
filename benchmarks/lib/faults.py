"""Faults injected into real runs: a SIGKILL at a seeded random point of `ultramem-train`, and a command run with a
folder on a small filesystem (a size-limited tmpfs) so that its writes end in ENOSPC.

`python benchmarks/lib/faults.py SEED WHERE [CLI FLAGS]` runs `ultramem-train` with those flags and SIGKILLs itself
(every rank at the same point, under a launcher) at a point drawn with `SEED` from those the run still has ahead, of
the kind WHERE names: `step` (before the forward, during it, after the backward, after the optimizer step) or `save`
(within a checkpoint write: after the weights, the optimizer state, the RNG state, or the whole Trainer save, before
the rename that publishes it); a run with no save ahead draws from its steps.
The point is printed to stderr first, as `kill point: step N, PHASE`.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

STEP_PHASES = ("before the forward", "during the forward", "after the backward", "after the optimizer step")
SAVE_PHASES = tuple(
    f"checkpoint write: {moment}"
    for moment in (
        "after the weights",
        "after the optimizer state",
        "after the RNG state",
        "before the publishing rename",
    )
)
# a phase named whole: the ranks of a launch write their lines into one stream, not always a line each
KILL_POINT = re.compile(rf"kill point: step (\d+), ({'|'.join(map(re.escape, STEP_PHASES + SAVE_PHASES))})")

# bash in a private mount namespace: a tmpfs of size $1 mounted over folder $2 (its contents copied in first), the
# command after them run there, then what it left copied back to the real folder. Root in the namespace through a
# user namespace (`unshare -r`), so no privilege is needed where unprivileged user namespaces are allowed.
_SMALL_DISK = r"""
set -e
size=$1 folder=$2 disk=$3; shift 3
mount -t tmpfs -o "size=$size" tmpfs "$disk"
cp -a "$folder/." "$disk/"
mount --bind "$disk" "$folder"
set +e; "$@"; status=$?; set -e
umount "$folder"
find "$folder" -mindepth 1 -delete
cp -a "$disk/." "$folder/"
exit $status
"""


def on_small_disk(command: list[str], folder: Path, size: int, **popen) -> subprocess.CompletedProcess:
    """Run `command` with `folder` on a fresh tmpfs of `size` bytes holding a copy of its contents; afterwards
    `folder` holds what the command left there. Output is captured as text; `popen` goes to `subprocess.run`."""
    folder.mkdir(parents=True, exist_ok=True)
    disk = folder.with_name(f".{folder.name}-disk")
    disk.mkdir(exist_ok=True)
    try:
        return subprocess.run(["unshare", "-rm", "bash", "-c", _SMALL_DISK, "small-disk", f"{size}", str(folder),
                               str(disk), *command], capture_output=True, text=True, **popen)  # fmt: skip
    finally:
        disk.rmdir()


def small_disks_available() -> str | None:
    """None where `on_small_disk` works here, else why not (no `unshare`, user namespaces or tmpfs mounts)."""
    probe = subprocess.run(["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", "/tmp"],
                           capture_output=True, text=True)  # fmt: skip
    return None if probe.returncode == 0 else f"no size-limited tmpfs here: {probe.stderr.strip()}"


def _kill(step: int, phase: str) -> None:
    print(f"kill point: step {step}, {phase}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _run_and_kill(seed: int, where: str, argv: list[str], launcher: list[str]) -> None:
    """`ultramem-train argv` (after the `launcher`'s flags), SIGKILLed at the seeded point among those after the step
    it starts (or resumes) from."""
    import torch
    from transformers import TrainerCallback

    from ultramem.training.cli import main
    from ultramem.training.trainer_overrides import AtomicCheckpointTrainer

    flags = dict(zip(argv[::2], argv[1::2]))
    every = int(flags["--save_steps"]) if flags.get("--save_strategy") == "steps" else 0
    planned: dict[str, tuple[int, str]] = {}

    def at(step: int, phase: str) -> None:
        if planned["point"] == (step, phase):
            _kill(step, phase)

    class Plan(TrainerCallback):
        """Draws the point once the start step is known; fires the step phases the callbacks can see."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            def during_the_forward(module, inputs):  # a training forward, not a save's statistics pass
                if module.training and torch.is_grad_enabled():
                    at(state.global_step + 1, STEP_PHASES[1])

            ahead = range(state.global_step + 1, state.max_steps + 1)
            saves = [(step, phase) for step in ahead if every and step % every == 0 for phase in SAVE_PHASES]
            steps = [(step, phase) for step in ahead for phase in STEP_PHASES]
            planned["point"] = random.Random(seed).choice(saves if where == "save" and saves else steps)
            model.lm_head.register_forward_pre_hook(during_the_forward)

        def on_step_begin(self, args, state, control, **kwargs):
            at(state.global_step + 1, STEP_PHASES[0])

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            at(state.global_step + 1, STEP_PHASES[2])

        def on_optimizer_step(self, args, state, control, **kwargs):
            at(state.global_step + 1, STEP_PHASES[3])

    def after(method: str, phase: str) -> None:
        original = getattr(AtomicCheckpointTrainer, method)

        def wrapped(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            at(self.state.global_step, phase)
            return result

        setattr(AtomicCheckpointTrainer, method, wrapped)

    def before_publish() -> None:
        original = AtomicCheckpointTrainer._publish

        def wrapped(self, *args, **kwargs):
            at(self.state.global_step, SAVE_PHASES[3])
            return original(self, *args, **kwargs)

        AtomicCheckpointTrainer._publish = wrapped

    for method, phase in zip(("_save", "_save_optimizer_and_scheduler", "_save_rng_state"), SAVE_PHASES):
        after(method, phase)
    before_publish()
    main([*launcher, *argv], callbacks=[Plan()])


if __name__ == "__main__":
    # the `deepspeed` launcher puts --local_rank=N before the script's own arguments; the CLI reads it
    launcher = [arg for arg in sys.argv[1:] if arg.startswith("--local_rank=")]
    seed, where, *flags = [arg for arg in sys.argv[1:] if arg not in launcher]
    _run_and_kill(int(seed), where, flags, launcher)
