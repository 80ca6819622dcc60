"""Shared helpers of the training tests (no tests here): a tiny UltraMem config, a small corpus, launchers."""

from __future__ import annotations

import json
import lzma
import os
import subprocess
import sys
from pathlib import Path

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
    "memory_kernel": "torch",
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


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_command(command: list[str], timeout: int = 240, **env: str) -> subprocess.CompletedProcess:
    """Run a launcher or script from the repository root; fail with its output tail when it fails."""
    result = subprocess.run(command, cwd=REPO, env=child_env(**env), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(command[:4])} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def python_module(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


def training_logs(output_dir: Path) -> list[dict]:
    """Per-step training log entries (those with a training loss) of a finished run."""
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return [entry for entry in state["log_history"] if "loss" in entry]


def losses(output_dir: Path) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in training_logs(output_dir)}


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))
