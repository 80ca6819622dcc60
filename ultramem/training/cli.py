"""`ultramem-train`: train a preset or a config on text files with the Trainer (plain, DDP, Accelerate or DeepSpeed).

The command line parses its flags into `ModelArguments`, `DataArguments` and `UltraMemTrainingArguments` and calls
`ultramem.training.train` (`ultramem.training.pipeline`), which scripts call directly.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from importlib import resources
from typing import Any, NoReturn

import torch
from transformers import HfArgumentParser, TrainerCallback

from ultramem.training.arguments import DataArguments, ModelArguments, UltraMemTrainingArguments
from ultramem.training.errors import StorageError, UsageError
from ultramem.training.pipeline import train

SHIPPED_DEEPSPEED_CONFIGS = ("zero2", "zero3")


def shipped_deepspeed_config(name: str) -> str:
    """Path of `ultramem/configs/deepspeed/<name>.json`."""
    return str(resources.files("ultramem.configs") / "deepspeed" / f"{name}.json")


def _resolve_deepspeed_shorthand(argv: list[str]) -> list[str]:
    """`--deepspeed zero3` names the shipped config file."""
    resolved = list(argv)
    for index, item in enumerate(resolved[:-1]):
        if item == "--deepspeed" and resolved[index + 1] in SHIPPED_DEEPSPEED_CONFIGS:
            resolved[index + 1] = shipped_deepspeed_config(resolved[index + 1])
    return resolved


def _skip_deepspeed_shared_memory_all_reduce() -> None:
    """Keep DeepSpeed's CPU backend from building its shared-memory all-reduce op, which training never calls.

    Only DeepSpeed-Inference's `inference_all_reduce` uses it. Yet every CPU launch JIT-compiles it in each rank
    (a C++ toolchain and ~25 s on a fresh machine) and, under the `deepspeed` launcher, each rank maps a 66 MB
    buffer in /dev/shm that DeepSpeed never unlinks: every launch left 132 MB of RAM behind, and where /dev/shm
    has less room than that (Docker's default is 64 MB) a rank dies of SIGSEGV/SIGBUS."""
    try:
        import deepspeed.ops
    except ImportError as error:
        raise UsageError("--deepspeed needs DeepSpeed: pip install 'ultramem[deepspeed]'") from error

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _cpu_distributed_defaults(argv: list[str]) -> dict[str, Any]:
    """Argument defaults that make a multi-process launch (torchrun, accelerate, deepspeed) work without CUDA.

    Plain DDP needs `use_cpu` for Accelerate to set up multi-CPU (gloo) training; without it every process
    trains alone. DeepSpeed's batch-size check reads the world size while `TrainingArguments` is built, so it
    needs a gloo state created first and reused (`use_configured_state`).
    """
    if torch.cuda.is_available():
        return {}
    if "--deepspeed" in argv:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    uses_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if uses_deepspeed:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        _skip_deepspeed_shared_memory_all_reduce()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return {}
    if not uses_deepspeed:
        return {"use_cpu": True}
    from accelerate import PartialState

    PartialState(backend="gloo")
    return {"accelerator_config": {"use_configured_state": True}}


def parse_args(argv: list[str]) -> tuple[ModelArguments, DataArguments, UltraMemTrainingArguments]:
    """Parse flags (or one JSON file of them); invalid values become a `UsageError`."""
    argv = _resolve_deepspeed_shorthand(argv)
    parser = HfArgumentParser((ModelArguments, DataArguments, UltraMemTrainingArguments))
    defaults = _cpu_distributed_defaults(argv)
    parser.set_defaults(**defaults)
    try:
        if len(argv) == 1 and argv[0].endswith(".json"):
            with open(argv[0], encoding="utf-8") as handle:
                model_args, data_args, training_args = parser.parse_dict({**defaults, **json.load(handle)})
        else:
            model_args, data_args, training_args = parser.parse_args_into_dataclasses(argv)
    except (OSError, ValueError) as error:  # includes json.JSONDecodeError
        raise UsageError(str(error).strip().splitlines()[0]) from error
    return model_args, data_args, training_args


def run(argv: list[str], callbacks: list[TrainerCallback] | None = None) -> dict[str, float]:
    """`train()` on parsed command-line flags; returns the final evaluation metrics (with perplexity)."""
    return train(*parse_args(argv), callbacks=callbacks).metrics


def exit_distributed_rank() -> NoReturn:
    """End a distributed rank: wait for every rank, destroy the process groups, then exit without interpreter teardown.

    Gloo's worker threads free a finished collective's tensors after the caller's wait returns, which takes the GIL.
    When that happens during interpreter shutdown, Python kills the thread inside C++ frames and the rank aborts
    ("terminate called without an active exception", SIGABRT) after a run that succeeded: seen in about one 2-rank
    launch in 20 on an idle 2-core machine, and in half of them under load. Process groups kept alive by DTensor's
    caches outlive `destroy_process_group`, so their threads can still be at it. What shutdown would do for the user
    (wait for non-daemon threads, run the atexit handlers, flush the streams) is done here, then the rank exits.
    """
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None, callbacks: list[TrainerCallback] | None = None) -> None:
    """Console entry point: a usage error prints one line and exits with status 2, a checkpoint that could not be
    written one line with status 1; a distributed rank ends with
    `exit_distributed_rank`. Scripts that add `callbacks` under a launcher call this too, not `run`."""
    try:
        run(sys.argv[1:] if argv is None else argv, callbacks=callbacks)
    except UsageError as error:
        print(f"ultramem-train: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except StorageError as error:
        print(f"ultramem-train: error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        exit_distributed_rank()
