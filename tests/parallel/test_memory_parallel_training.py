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
    base_args,
    child_env,
    losses,
    python_module,
    run_command,
    training_logs,
    write_config,
    write_corpus,
)
from transformers import AutoConfig, AutoModelForCausalLM

from ultramem import UltraMemForCausalLM

STEPS, GLOBAL_BATCH = 10, 4
LOSS_TOLERANCE = 1e-5  # absolute, per step: fp32 reduction order differs between 1 and 2 processes
PROBE = torch.arange(64).reshape(2, 32) * 97 % 50000


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("memory_parallel_training")
    config, corpus = write_config(folder, aux_loss_alpha=10.0), write_corpus(folder)
    torch.manual_seed(7)
    UltraMemForCausalLM(AutoConfig.for_model(**json.loads(config.read_text()))).save_pretrained(folder / "start")

    def argv(name: str, batch: int, **flags) -> list[str]:
        args = base_args(config, corpus, folder / name, max_steps=STEPS, per_device_train_batch_size=batch,
                         diagnostics_batch_size=0, model_name_or_path=folder / "start", **flags)  # fmt: skip
        at = args.index("--config_file")
        return args[:at] + args[at + 2 :]

    run_command(python_module("ultramem.training", *argv("single", GLOBAL_BATCH)))
    return folder, argv


def _logits(folder) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits


# launcher -> who shards the rest of the model
RESTS = {"torchrun": "DDP", "accelerate": "DDP", "torchrun --fsdp": "FSDP2", "accelerate fsdp2": "FSDP2",
         "deepspeed zero2": "DeepSpeed", "accelerate zero3": "DeepSpeed"}  # fmt: skip
# Who shards the rest -> (grad norm rel, logits abs) against one process: about twice the largest difference measured
# on AVX2 and AVX-512 (docs/training.md). The query statistics are float64 sums, so their order no longer counts; what
# is left is each one's gradient reduction: DDP's all-reduce hardly reorders a sum (measured 4e-6 / 4e-5), FSDP2's and
# ZeRO's reduce-scatter over flat buckets do (1.4e-4 / 2.8e-4, 2.9e-4 / 6.0e-4), and AdamW amplifies it in small
# gradients' coordinates (embedding rows) before the memory's top-m and whitening amplify it in one token's logits
TOLERANCES = {"DDP": (2e-5, 1e-4), "FSDP2": (4e-4, 6e-4), "DeepSpeed": (6e-4, 1.2e-3)}


@pytest.mark.parametrize(
    ("partitioning", "launcher"),
    [("number", "torchrun"), ("dimension", "torchrun"), ("auto", "accelerate"), ("number", "accelerate fsdp2"),
     ("dimension", "torchrun --fsdp"), ("number", "deepspeed zero2"), ("dimension", "accelerate zero3")],
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
    assert losses(folder / name) == pytest.approx(losses(folder / "single"), abs=LOSS_TOLERANCE)
    # clipping (max_grad_norm 1) binds, and by the same global norm: the table shards' gradients count on every rank
    assert max(entry["grad_norm"] for entry in single) > 1
    grad_norm_rel, logits_abs = TOLERANCES[rest]
    assert [entry["grad_norm"] for entry in logs] == pytest.approx([entry["grad_norm"] for entry in single],
                                                                   rel=grad_norm_rel)  # fmt: skip
    assert [entry["value_lr_multiplier"] for entry in logs] == pytest.approx(
        [10.0 - 9.0 * step / (STEPS - 1) for step in range(STEPS)]
    )
    for entry in logs[1:]:
        assert entry["value_learning_rate"] / entry["learning_rate"] == pytest.approx(entry["value_lr_multiplier"])
    # the checkpoint written from the shards loads in one process and gives the single-process model's logits
    torch.testing.assert_close(_logits(folder / name), _logits(folder / "single"), rtol=0, atol=logits_abs)


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
