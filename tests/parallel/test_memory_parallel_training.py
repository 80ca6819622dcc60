"""`ultramem-train --memory_parallel` on 2 gloo processes, the rest of the model under DDP, FSDP2 or DeepSpeed ZeRO-2/3
(torchrun, accelerate launch, deepspeed), matches one process on the same global batch, both starting from one checkpoint (a sharded fresh
init differs from a one-process init; a sharded load is exact), clips by the same global gradient norm, keeps the
10x -> 1x value LR, and saves an ordinary checkpoint."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from launch_support import (
    LAUNCHERS,
    REPO,
    child_env,
    one_process_run,
    python_module,
    run_command,
    steps_before_divergence,
    training_logs,
    write_config,
)
from selection_support import compare_selections
from transformers import AutoModelForCausalLM

STEPS, GLOBAL_BATCH = 10, 4
LOSS_TOLERANCE = 1e-5  # absolute, per step: fp32 reduction order differs between 1 and 2 processes
PROBE = torch.arange(64).reshape(2, 32) * 97 % 50000


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("memory_parallel_training")
    # query_norm="none": this checks the sharding. The query's whitening amplifies the float32 difference of the
    # weights into the scores (docs/memory_parallel.md: 2.9e-3 against 1.7e-5 on this probe), and with it the chance
    # that a near-tie parts the runs. Its own distributed computation (statistics summed over ranks in float64) is
    # checked exactly in tests/model/test_query_normalization.py
    config = write_config(folder, aux_loss_alpha=10.0, query_norm="none")
    return folder, one_process_run(folder, config, STEPS, GLOBAL_BATCH)


def _model(folder) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)


# launcher -> who shards the rest of the model
RESTS = {"torchrun": "DDP", "accelerate": "DDP", "torchrun --fsdp": "FSDP2", "accelerate fsdp2": "FSDP2",
         "deepspeed zero2": "DeepSpeed", "accelerate zero3": "DeepSpeed"}  # fmt: skip
# Who shards the rest -> (grad norm rel, logits abs) against one process: two to three times the largest difference
# measured (AVX-512 and AVX2, docs/training.md). Each one's gradient reduction orders the sums its own way: DDP's
# all-reduce (measured 1.1e-5 / 1.9e-5), FSDP2's reduce-scatter (2.0e-4 / 3.7e-5), ZeRO's flat buckets (4.0e-4 /
# 6.6e-5); AdamW amplifies them in small gradients' coordinates
TOLERANCES = {"DDP": (3e-5, 1e-4), "FSDP2": (6e-4, 1e-4), "DeepSpeed": (1e-3, 2e-4)}


# One launcher per way the rest is sharded (DDP, FSDP2, ZeRO) also runs under a second CPU dispatch level (.ci/run):
# the tolerances above hold on both
NUMERICS = pytest.mark.numerics


@pytest.mark.parametrize(
    ("partitioning", "launcher"),
    [pytest.param("number", "torchrun", marks=NUMERICS), ("dimension", "torchrun"), ("auto", "accelerate"),
     ("number", "accelerate fsdp2"), pytest.param("dimension", "torchrun --fsdp", marks=NUMERICS),
     pytest.param("number", "deepspeed zero2", marks=NUMERICS), ("dimension", "accelerate zero3")],
)  # fmt: skip
def test_sharded_tables_match_single_process(setup, partitioning, launcher):
    folder, argv = setup
    (command, flags), rest = LAUNCHERS[launcher], RESTS[launcher]
    name = f"{partitioning}-{launcher.replace(' ', '')}"
    result = run_command([*command, "ultramem.training", *argv(name, GLOBAL_BATCH // 2, memory_parallel=partitioning),
                          *flags], DS_ACCELERATOR="cpu")  # fmt: skip
    # the one value table (of one memory layer) is sharded by memory_parallel, the rest by FSDP2 when it runs
    reports = {"FSDP2": f"FSDP2 and memory_parallel={partitioning} shard ",
               "DDP": f"memory_parallel={partitioning} shards 1 of "}  # fmt: skip
    if rest in reports:  # (DeepSpeed's parameters are no DTensors, and the tables are no parameters of its engine)
        assert f"ultramem-train: {reports[rest]}" in result.stdout, result.stdout[-3000:]
    logs, single = training_logs(folder / name), training_logs(folder / "single")
    agreed = steps_before_divergence(logs, single, LOSS_TOLERANCE)
    # clipping (max_grad_norm 1) binds, and by the same global norm: the table shards' gradients count on every rank
    assert max(entry["grad_norm"] for entry in single) > 1
    grad_norm_rel, logits_abs = TOLERANCES[rest]
    assert [entry["grad_norm"] for entry in logs[:agreed]] == pytest.approx(
        [entry["grad_norm"] for entry in single[:agreed]], rel=grad_norm_rel
    )
    assert [entry["value_lr_multiplier"] for entry in logs] == pytest.approx(
        [10.0 - 9.0 * step / (STEPS - 1) for step in range(STEPS)]
    )
    for entry in logs[1:]:
        assert entry["value_learning_rate"] / entry["learning_rate"] == pytest.approx(entry["value_lr_multiplier"])
    # the checkpoint written from the shards loads in one process; on one trajectory it gives the one-process
    # model's logits wherever both pick the same slots
    comparison = compare_selections(_model(folder / "single"), _model(folder / name), PROBE)
    if agreed == STEPS:
        assert comparison.logits_error <= logits_abs and comparison.compared_tokens >= PROBE.numel() // 2, comparison


def test_memory_parallel_without_a_process_group_is_a_usage_error(setup):
    folder, argv = setup
    command = python_module("ultramem.training", *argv("alone", GLOBAL_BATCH, memory_parallel="number"))
    with pytest.raises(AssertionError) as failure:
        run_command(command)
    message = str(failure.value)
    assert "ultramem-train: error: --memory_parallel number: memory_parallel needs an initialized" in message
    assert "allowed choice is memory_parallel='none'" in message


@pytest.fixture(scope="module")
def deepspeed_config_with_optimizer(setup) -> str:
    folder, _ = setup
    config = json.loads(Path(REPO, "ultramem/configs/deepspeed/zero2.json").read_text())
    path = folder / "zero2_with_optimizer.json"
    path.write_text(json.dumps({**config, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
    return str(path)


# case -> (flags, what the error line says after "--memory_parallel number ", what it says later)
REFUSED = {
    "fsdp1": (["--fsdp", "full_shard auto_wrap", "--fsdp_config", '{"version": 1}'], "with FSDP1: ", "would flatten"),
    "deepspeed optimizer": (["--deepspeed", "CONFIG"], "with the DeepSpeed config /", "its 'optimizer' section would"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_memory_parallel_refusals_are_one_usage_error_before_the_model_is_built(setup, deepspeed_config_with_optimizer,
                                                                                case):  # fmt: skip
    folder, argv = setup
    flags, message, detail = REFUSED[case]
    flags = [deepspeed_config_with_optimizer if flag == "CONFIG" else flag for flag in flags]
    command = python_module("ultramem.training", *argv("refused", GLOBAL_BATCH, memory_parallel="number"), *flags)
    result = subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=240)
    errors = [line for line in result.stderr.splitlines() if line.startswith("ultramem-train: error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert f"ultramem-train: error: --memory_parallel number {message}" in errors[0]
    assert detail in errors[0] and "allowed: " in errors[0]
    assert not (folder / "refused").exists()  # refused before the model was built or trained
