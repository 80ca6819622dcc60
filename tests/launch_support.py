"""Shared helpers of the training tests (no tests here): a tiny UltraMem config, a small corpus, launchers."""

from __future__ import annotations

import contextlib
import json
import lzma
import os
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

from ultramem.training.data import embedded_corpus_files

REPO = Path(__file__).resolve().parents[1]

# Small enough that a step takes well under a second on one core; every memory feature is on.
TINY_ULTRAMEM = {
    "model_type": "ultramem",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "max_position_embeddings": 64,
    "memory_layers": [[0, 1]],
    "memory_heads": 2,
    "memory_topk": 4,
    "memory_key_dim": 8,
    "memory_num_keys": 16,
    "memory_value_dim": 16,
    "tucker_rank": 2,
    "mcs_cores": 2,
    "ive_expansion": 4,
    "memory_implementation": "torch",  # the reference kernel (a private, unsaved setting)
}


def write_config(folder: Path, **overrides) -> Path:
    path = folder / "tiny_ultramem.json"
    path.write_text(json.dumps({**TINY_ULTRAMEM, **overrides}))
    return path


def write_corpus(folder: Path, characters: int = 60_000) -> Path:
    """The start of the embedded validation book, as a plain text file (fast to tokenize)."""
    with lzma.open(embedded_corpus_files()["validation"], "rt", encoding="utf-8") as handle:
        text = json.loads(handle.readline())["text"][:characters]
    path = folder / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return path


def base_args(config: Path, corpus: Path, output_dir: Path, **flags) -> list[str]:
    """CLI flags of a tiny deterministic run; `flags` add or replace `--name value` pairs."""
    values = {
        "config_file": config,
        "train_file": corpus,
        "output_dir": output_dir,
        "block_size": 32,
        "per_device_train_batch_size": 4,
        "max_eval_samples": 8,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": "true",
        "seed": 7,
        "diagnostics_batch_size": 2,
        **flags,
    }
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


def one_process_run(
    folder: Path, config: Path, steps: int, global_batch: int, check_model=None
) -> Callable[..., list[str]]:
    """The start checkpoint (seed 7) of `config` and its one-process run in `folder/single`; returns `argv(name,
    batch, **flags)`, the flags of a run from the same start (without `--config_file`) writing to `folder/name`.
    `check_model(model)` checks the start model before anything runs."""
    from transformers import AutoConfig

    from ultramem import UltraMemForCausalLM

    corpus = write_corpus(folder)
    torch.manual_seed(7)
    model = UltraMemForCausalLM(AutoConfig.for_model(**json.loads(config.read_text())))
    if check_model is not None:
        check_model(model)
    model.save_pretrained(folder / "start")

    def argv(name: str, batch: int, **flags) -> list[str]:
        args = base_args(config, corpus, folder / name, max_steps=steps, per_device_train_batch_size=batch,
                         diagnostics_batch_size=0, model_name_or_path=folder / "start", **flags)  # fmt: skip
        at = args.index("--config_file")
        return args[:at] + args[at + 2 :]

    run_command(python_module("ultramem.training", *argv("single", global_batch)))
    return argv


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


# Where each launcher takes its rendezvous port: a fresh free port per launch, so that no run waits on a port
# still held by another (a test run beside this one, or the workers of a launch that timed out).
PORT_FLAGS = {"torch.distributed.run": "--master_port", "deepspeed": "--master_port", "launch": "--main_process_port"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def with_free_port(command: list[str]) -> list[str]:
    """`command` with a free rendezvous port after its launcher word (torchrun, deepspeed, accelerate launch)."""
    for position, word in enumerate(command):
        if word in PORT_FLAGS and (word != "launch" or command[position - 1] == "accelerate"):
            return [*command[: position + 1], PORT_FLAGS[word], str(free_port()), *command[position + 1 :]]
    return command


def kill_process_tree(root: int) -> None:
    """SIGKILL `root` and every process below it, whatever their session.

    torchrun starts each worker in a session of its own: killing the launcher's process group alone leaves the
    workers running (and holding the test's output pipes open, so reading them to the end never returns)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        launcher = psutil.Process(root)
        processes = [launcher, *launcher.children(recursive=True)]
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(processes, timeout=30)


def run_command(command: list[str], timeout: int = 240, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    """Run a launcher or script from the repository root; with `check`, fail with its output tail when it fails.

    On a timeout (its own or the test's) it is killed with all its workers. The result's `args` are the command as
    run, with the rendezvous port it was given."""
    command = with_free_port(command)
    process = subprocess.Popen(command, cwd=REPO, env=child_env(**env), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_tree(process.pid)
        stdout, stderr = process.communicate(timeout=60)
        raise AssertionError(
            f"{' '.join(command[:4])} timed out after {timeout} s:\n{stdout[-3000:]}\n{stderr[-6000:]}"
        )
    except BaseException:  # pytest-timeout's alarm or Ctrl-C: no worker outlives its test
        kill_process_tree(process.pid)
        raise
    if check:
        assert process.returncode == 0, f"{' '.join(command[:4])} failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def python_module(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


_TORCHRUN = [*python_module("torch.distributed.run", "--nproc_per_node", "2"), "-m"]
_ACCELERATE = python_module("accelerate.commands.launch", "--config_file")
# 2-process launcher -> (command before the module name, flags after the CLI's)
LAUNCHERS = {
    "torchrun": (_TORCHRUN, []),
    "accelerate": ([*_ACCELERATE, "ultramem/configs/accelerate/ddp.yaml", "-m"], []),
    "torchrun --fsdp": (_TORCHRUN, ["--fsdp", "full_shard auto_wrap"]),
    "accelerate fsdp2": ([*_ACCELERATE, "ultramem/configs/accelerate/fsdp2.yaml", "-m"], []),
    "deepspeed zero2": (["deepspeed", "--num_gpus", "2", "--module"], ["--deepspeed", "zero2"]),
    "accelerate zero3": ([*_ACCELERATE, "ultramem/configs/accelerate/zero3.yaml", "-m"], []),
}


def training_logs(output_dir: Path) -> list[dict]:
    """Per-step training log entries (those with a training loss) of a finished run."""
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return [entry for entry in state["log_history"] if "loss" in entry]


def losses(output_dir: Path) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in training_logs(output_dir)}


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


# Sharded and one-process training agree to float32 reduction-order noise until a memory layer's top-m meets a
# near-tie that the noise decides; from that step on they are two trajectories (docs/memory_parallel.md). A sharding
# error shows from step 2 on, the first step taken with sharded gradients; no near-tie flip was measured before step 5.
EXACT_STEPS = 3


def steps_before_divergence(logs: list[dict], reference: list[dict], loss_tolerance: float) -> int:
    """How many leading steps of `logs` have `reference`'s loss within `loss_tolerance` (every step when all do);
    fails when that is fewer than `EXACT_STEPS`, which a flip cannot explain."""
    assert [entry["step"] for entry in logs] == [entry["step"] for entry in reference]
    agree = [abs(entry["loss"] - other["loss"]) <= loss_tolerance for entry, other in zip(logs, reference)]
    count = agree.index(False) if False in agree else len(agree)
    losses = f"{[entry['loss'] for entry in logs]} against {[entry['loss'] for entry in reference]}"
    assert count >= min(EXACT_STEPS, len(agree)), (
        f"the losses part at step {count + 1}, before a near-tie could: {losses}"
    )
    if count < len(agree):  # said in the test report: what is compared after it is the checkpoint loading
        warnings.warn(f"the runs parted at step {count + 1} of {len(agree)} (a near-tie): {losses}", stacklevel=2)
    return count
