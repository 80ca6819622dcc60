"""Resume is exact, and a run killed while writing a checkpoint resumes from the last complete one; each checkpoint holds
the query statistics recomputed at its step."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from launch_support import (
    REPO,
    base_args,
    child_env,
    losses,
    python_module,
    run_command,
    weights,
    write_config,
    write_corpus,
)
from safetensors.torch import load_file

STEPS, SAVE_EVERY, KILL_AT = 8, 3, 6

# Runs the real CLI, but SIGKILLs the process in the middle of writing checkpoint KILL_AT: after the weights,
# optimizer and scheduler are on disk, before the RNG and trainer state.
KILL_DURING_SAVE = f"""
import os, signal, sys
from transformers import Trainer
from ultramem.training.cli import main

original = Trainer._save_rng_state

def save_then_die(self, output_dir):
    original(self, output_dir)
    if self.state.global_step == {KILL_AT}:
        os.kill(os.getpid(), signal.SIGKILL)

Trainer._save_rng_state = save_then_die
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume")
    config, corpus = write_config(folder), write_corpus(folder)

    def argv(name: str, **flags) -> list[str]:
        return base_args(config, corpus, folder / name, max_steps=STEPS, save_strategy="steps", save_steps=SAVE_EVERY,
                         diagnostics_batch_size=0, **flags)  # fmt: skip

    run_command(python_module("ultramem.training", *argv("straight")))
    killed = subprocess.run(
        [sys.executable, "-c", KILL_DURING_SAVE, *argv("interrupted")], cwd=REPO, env=child_env(),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-3000:]
    interrupted = folder / "interrupted"
    left_after_kill = sorted(path.name for path in interrupted.iterdir())
    resumed = run_command(python_module("ultramem.training", *argv("interrupted", resume_from_checkpoint="true")))
    return folder / "straight", interrupted, left_after_kill, resumed.stderr


def test_killed_save_leaves_only_complete_checkpoints(runs):
    _, _, left_after_kill, _ = runs
    assert f"checkpoint-{SAVE_EVERY}" in left_after_kill
    assert f"checkpoint-{KILL_AT}" not in left_after_kill  # only its staging folder exists
    assert f".incomplete-checkpoint-{KILL_AT}" in left_after_kill


def test_resumed_run_matches_the_uninterrupted_one(runs):
    straight, resumed, _, _ = runs
    expected, got = losses(straight), losses(resumed)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(SAVE_EVERY + 1, STEPS + 1):  # the steps trained after resuming from checkpoint-3
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-6), step
    final_straight, final_resumed = weights(straight), weights(resumed)
    for name, tensor in final_straight.items():
        torch.testing.assert_close(final_resumed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert not [path for path in resumed.iterdir() if path.name.startswith(".incomplete")]


def test_resumed_run_names_the_checkpoint_it_continues_from(runs):
    _, resumed, _, stderr = runs
    assert f"ultramem-train: resuming from {resumed / f'checkpoint-{SAVE_EVERY}'} (step {SAVE_EVERY})" in stderr


def test_checkpoints_hold_the_query_statistics_of_a_model_saved_at_their_step(runs):
    """Each checkpoint's statistics are recomputed with its step's weights (on the same training batches as the final
    save's), not the lagging running ones: the last checkpoint holds exactly the final model's."""
    straight, _, _, _ = runs
    statistics = [name for name in weights(straight) if ".across_tokens." in name]
    assert statistics  # the default normalises by batch statistics
    final, last = weights(straight), load_file(str(straight / f"checkpoint-{STEPS}" / "model.safetensors"))
    for name in statistics:  # to float32 rounding: each pass sums about the running mean it starts from
        # the whitening, the covariance's inverse square root, amplifies that rounding by the covariance's condition
        # number: compared to its largest entry (7e-7 apart at a largest entry of 9.5, the covariances 2e-9 apart)
        atol = 1e-6 * float(final[name].abs().max()) if name.endswith(".whitening") else 1e-7
        torch.testing.assert_close(last[name], final[name], rtol=1e-6, atol=atol, msg=name)
    early = load_file(str(straight / f"checkpoint-{SAVE_EVERY}" / "model.safetensors"))
    tracked = [name for name in statistics if name.endswith("batches_tracked")]
    assert all(int(early[name]) == int(final[name]) > SAVE_EVERY for name in tracked)  # recomputed over its batches
