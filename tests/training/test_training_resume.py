"""Resume is exact, and a run killed while writing a checkpoint resumes from the last complete one; each checkpoint holds
the query statistics recomputed at its step. A run killed at a seeded random point and then meeting a full disk in a
save still ends equal to the uninterrupted one, and a full disk under the int8 converter and the disk value store is
one error line with nothing partial left (benchmarks/reliability_training.py, which draws many more kills)."""

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

from ultramem.training.checkpointing import STAGING_PREFIX

sys.path.insert(0, str(REPO / "benchmarks"))  # the script imports its library, benchmarks/lib, as `lib`
import reliability_training  # noqa: E402
from lib.faults import small_disks_available  # noqa: E402

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


def test_a_random_kill_then_a_full_disk_resume_to_the_uninterrupted_run(runs):
    """One SIGKILL at a point drawn with a fixed seed (within a step or a checkpoint write), then a launch whose next
    save meets a full disk, then a launch to the end: weights and losses equal the uninterrupted run's."""
    straight, *_ = runs
    reason = small_disks_available()
    chain = reliability_training.kill_chain(
        straight, straight.parent / "tiny_ultramem.json", straight.parent / "corpus.txt", kills=1,
        full_disk=reason is None, seed=1, steps=STEPS, save_every=SAVE_EVERY, processes=1, timeout=240,
    )  # fmt: skip
    assert chain["logged_steps_match"] and chain["same_weight_names"]
    assert chain["max_loss_difference"] <= 1e-6 and chain["max_weight_difference"] <= 1e-6
    if reason is not None:
        pytest.skip(f"the kill resumed exactly; the full-disk launch did not run: {reason}")
    full_disk = chain["events"][1]
    assert full_disk["exit_status"] == 1 and full_disk["last_checkpoint_intact"]
    assert len(full_disk["error_lines"]) == 1, full_disk["error_lines"]
    assert full_disk["error_lines"][0].startswith("ultramem-train: error: could not write ")
    assert (
        "0.0 MiB free there" in full_disk["error_lines"][0]
        and "last complete checkpoint is" in full_disk["error_lines"][0]
    )
    assert not [name for name in full_disk["left"] if name.startswith(STAGING_PREFIX)]


@pytest.mark.skipif(small_disks_available() is not None, reason="no size-limited tmpfs (unshare -rm mount) here")
def test_a_full_disk_under_the_converter_and_the_disk_store_is_one_line_and_leaves_nothing_to_load(runs, tmp_path):
    straight, *_ = runs
    quantize = reliability_training.disk_quantize(straight, tmp_path)
    assert quantize["exit_status"] == 1 and quantize["left"] == [] and not quantize["loads"]
    assert quantize["error_lines"] == [
        f"error: could not write {tmp_path / 'full-disk-quantize' / 'int8'} (No space left on device): removed what "
        "was written"
    ]
    offload = reliability_training.disk_offload(tmp_path, straight.parent / "tiny_ultramem.json")
    table = tmp_path / "full-disk-offload" / "model.memory_layers.1.values.weight.safetensors"
    assert offload["exit_status"] == 1 and offload["error_lines"] == [
        f"error: could not write {table} (No space left on device)"
    ]
    assert offload["left"] == ["model.memory_layers.0.values.weight.safetensors"]  # the complete one; no partial
