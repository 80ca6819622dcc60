"""Trainer checkpoints of sharded tables (DCP): resume after a kill, resume under DeepSpeed ZeRO-2/3, and resharded
resume (2 -> 1 process, number -> dimension, 2 -> 4 and 4 -> 1 processes) continue the loss sequence of the
uninterrupted run."""

from __future__ import annotations

import shutil

import pytest
from launch_support import (
    LAUNCHERS,
    base_args,
    losses,
    python_module,
    run_command,
    training_logs,
    write_config,
    write_corpus,
)

STEPS, SAVE_AT, KILL_AT, GLOBAL_BATCH = 10, 5, 7, 4
LOSS_TOLERANCE = 1e-5

# The real CLI, SIGKILLed on every rank at the end of step KILL_AT (after checkpoint SAVE_AT was written).
KILL_AFTER_STEP = f"""
import os, signal, sys
from transformers import TrainerCallback
from ultramem.training.cli import main

class Kill(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == {KILL_AT}:
            os.kill(os.getpid(), signal.SIGKILL)

main(sys.argv[1:], callbacks=[Kill()])
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("memory_parallel_resume")
    config, corpus = write_config(folder), write_corpus(folder)

    def argv(name: str, processes: int, **flags) -> list[str]:
        return base_args(config, corpus, folder / name, max_steps=STEPS, save_strategy="steps", save_steps=SAVE_AT,
                         per_device_train_batch_size=GLOBAL_BATCH // processes, diagnostics_batch_size=0, **flags)  # fmt: skip

    def torchrun(processes: int, *args: str) -> list[str]:
        return python_module("torch.distributed.run", "--nproc_per_node", str(processes), *args)

    run_command(torchrun(2, "-m", "ultramem.training", *argv("straight", 2, memory_parallel="number")))
    return folder, argv, torchrun


def test_resume_after_a_kill_continues_the_loss_sequence(runs):
    folder, argv, torchrun = runs
    script = folder / "kill.py"
    script.write_text(KILL_AFTER_STEP)
    killed = torchrun(2, str(script), *argv("killed", 2, memory_parallel="number"))
    with pytest.raises(AssertionError):
        run_command(killed)
    assert not (folder / "killed" / f"checkpoint-{STEPS}").exists()
    run_command(torchrun(2, "-m", "ultramem.training", *argv("killed", 2, memory_parallel="number",
                                                             resume_from_checkpoint="true")))  # fmt: skip
    # steps 1..SAVE_AT come from the checkpoint's log history, the rest from the resumed run
    assert losses(folder / "killed") == pytest.approx(losses(folder / "straight"), abs=LOSS_TOLERANCE)


@pytest.mark.parametrize(
    ("launcher", "partitioning"), [("deepspeed zero2", "number"), ("accelerate zero3", "dimension")]
)
def test_deepspeed_resume_continues_the_loss_sequence_and_the_value_schedule(runs, launcher, partitioning):
    """Under DeepSpeed ZeRO-2/3 the tables live beside the engine: their shards, AdamW state (DCP) and value-LR
    schedule (`value_tables_scheduler.pt`) resume in a fresh launch with the engine's own checkpoint.

    The reference is an uninterrupted DeepSpeed run: DeepSpeed's gradient norm is closer to the float64 value than
    torch's float32 CPU norm of the 1.6M-element LM-head gradient (1.4e-4 apart at step 1 here), and with clipping
    binding at this learning rate Adam grows that into 6e-4 of loss by step 6 against the DDP run."""
    folder, argv, _ = runs
    command, flags = LAUNCHERS[launcher]
    name = launcher.replace(" ", "-")

    def launch(run: str, **extra) -> None:
        args = argv(run, 2, memory_parallel=partitioning, **extra)
        run_command([*command, "ultramem.training", *args, *flags], DS_ACCELERATOR="cpu")

    launch(f"{name}-straight")
    checkpoint = folder / f"{name}-resumed" / f"checkpoint-{SAVE_AT}"
    shutil.copytree(folder / f"{name}-straight" / f"checkpoint-{SAVE_AT}", checkpoint)
    assert (checkpoint / "value_tables_scheduler.pt").is_file()
    launch(f"{name}-resumed", resume_from_checkpoint=checkpoint)
    resumed, straight = (training_logs(folder / f"{name}-{run}") for run in ("resumed", "straight"))
    assert [entry["loss"] for entry in resumed] == pytest.approx(
        [entry["loss"] for entry in straight], abs=LOSS_TOLERANCE
    )
    assert [entry["value_learning_rate"] for entry in resumed] == pytest.approx(
        [entry["value_learning_rate"] for entry in straight], rel=1e-6
    )
    assert straight[SAVE_AT]["value_learning_rate"] > 0  # the step after the resume point moves the tables


@pytest.mark.parametrize(
    ("name", "processes", "partitioning"), [("one", 1, "none"), ("dimension", 2, "dimension"), ("four", 4, "number")]
)
def test_resharded_resume_continues_the_loss_sequence(runs, name, processes, partitioning):
    folder, argv, torchrun = runs
    checkpoint = folder / name / f"checkpoint-{SAVE_AT}"
    shutil.copytree(folder / "straight" / f"checkpoint-{SAVE_AT}", checkpoint)
    args = [
        "ultramem.training",
        *argv(name, processes, memory_parallel=partitioning, resume_from_checkpoint=checkpoint),
    ]
    run_command(torchrun(processes, "-m", *args) if processes > 1 else python_module(*args))
    assert losses(folder / name) == pytest.approx(losses(folder / "straight"), abs=LOSS_TOLERANCE)


def test_four_processes_resume_in_one(runs):
    """A checkpoint written by 4 ranks (each a quarter of every table) resumes in one process, tables whole (a fresh
    4-rank init draws other shards than a 2-rank one: the resumed run continues the 4-rank run's sequence)."""
    folder, argv, torchrun = runs
    run_command(torchrun(4, "-m", "ultramem.training", *argv("four-writer", 4, memory_parallel="number")), timeout=400)
    checkpoint = folder / "four-to-one" / f"checkpoint-{SAVE_AT}"
    shutil.copytree(folder / "four-writer" / f"checkpoint-{SAVE_AT}", checkpoint)
    run_command(python_module("ultramem.training", *argv("four-to-one", 1, resume_from_checkpoint=checkpoint)))
    assert losses(folder / "four-to-one") == pytest.approx(losses(folder / "four-writer"), abs=LOSS_TOLERANCE)
