"""`ultramem-eval`: score checkpoints on the paper's benchmarks with lm-eval, from the Hub or from local copies.

    ultramem-eval --model CKPT [CKPT ...] --tasks ultramem_paper [--data-dir DIR] [--limit N] [--output DIR]

Writes `results.json`, `results.md` (the paper's table layout) and `results.png` (a bar chart), rewritten after each
checkpoint is scored, so a run that stops keeps the scores it finished. Every input is checked before the first
benchmark runs: the options, the output folder, and each checkpoint (config fields in range, tokenizer, whole
safetensors files, a context that fits the benchmarks' generation budgets). Benchmarks whose data cannot be read are
reported by name and left out of the run, never dropped silently.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ultramem.eval import tasks_path
from ultramem.eval.benchmarks import Benchmark, select, task_name
from ultramem.eval.checkpoint import (
    CheckpointError,
    check_weights,
    fingerprint,
    load_config,
    parameter_counts,
    require_checkpoint,
    require_tokenizer,
    validation_loss,
)
from ultramem.eval.local_data import LocalDataMissing
from ultramem.eval.report import (
    ModelResult,
    bar_chart,
    markdown_table,
    run_notes,
    scores_from_lm_eval,
    write_results,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ultramem-eval", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", nargs="+", required=True, type=Path, help="checkpoint folder(s) from save_pretrained"
    )
    parser.add_argument(
        "--tasks", default="ultramem_paper", help="ultramem_paper, or a comma-separated subset of its benchmarks"
    )
    parser.add_argument(
        "--data-dir", type=Path, help="local benchmark copies (layout: ultramem/eval/local_data.py); default: the Hub"
    )
    parser.add_argument(
        "--output", type=Path, default=Path("eval_results"), help="folder for results.json/.md/.png (created)"
    )
    parser.add_argument("--limit", type=float, help="documents per task: a whole count (>= 1) or a fraction in (0, 1)")
    parser.add_argument("--max-gen-toks", type=int, help="cap on generated tokens per answer (BBH CoT allows 1024)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--memory-offload",
        choices=["cpu", "disk"],
        help="keep the value tables in host memory or memory-mapped from the checkpoint (models larger than memory)",
    )
    return parser


def _check_args(args: argparse.Namespace) -> None:
    if args.limit is not None and not (0 < args.limit < 1 or (args.limit >= 1 and args.limit.is_integer())):
        raise ValueError(f"--limit {args.limit:g}: give a whole count of documents (>= 1) or a fraction in (0, 1)")
    if args.limit is not None and args.limit >= 1:
        args.limit = int(args.limit)  # lm-eval reads a float >= 1 as a count too; the settings show the count
    if args.max_gen_toks is not None and args.max_gen_toks < 1:
        raise ValueError(f"--max-gen-toks must be >= 1, got {args.max_gen_toks}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.data_dir is not None and not args.data_dir.is_dir():
        raise ValueError(f"--data-dir {args.data_dir}: not a folder")
    _check_device(args.device)


def _check_device(name: str) -> None:
    """The device exists on this machine (lm-eval would find out after loading every benchmark's data)."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"--device {name}: not a torch device ({err}); e.g. cpu, cuda, cuda:0") from err
    if device.type == "cpu":
        return
    module = getattr(torch, device.type, None)
    available = module is not None and hasattr(module, "is_available") and module.is_available()
    if not available:
        raise ValueError(
            f"--device {name}: no {device.type} device on this machine (torch {torch.__version__}); use --device cpu"
        )
    count = module.device_count() if hasattr(module, "device_count") else 1
    if device.index is not None and device.index >= count:
        raise ValueError(f"--device {name}: this machine has {count} {device.type} device(s) (0..{count - 1})")


def _check_output(folder: Path) -> None:
    """The output folder can be created (or is one) before anything is scored."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--output {folder}: is a file, not a folder; name a folder for results.json/.md/.png")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--output {folder}: cannot create the folder ({err.strerror or err})") from err


def check_checkpoint(path: Path) -> Path:
    """Everything about a checkpoint folder that would otherwise fail after other checkpoints were scored."""
    folder = require_tokenizer(require_checkpoint(path))
    load_config(folder)
    check_weights(folder)
    return folder


def _available(
    task_manager: Any, groups: dict[str, str], offline: bool
) -> tuple[dict[str, dict], dict[str, str], dict[str, Any]]:
    """Split benchmarks into those whose data loads (key -> its tasks by name) and those missing (key -> reason);
    also the built group of each benchmark that loads (key -> lm-eval Group), which every checkpoint reuses."""
    ready, missing, built = {}, {}, {}
    for key, group in tqdm(groups.items(), desc="loading benchmark data", unit="benchmark"):
        try:
            loaded = task_manager.load([group])
        except LocalDataMissing as err:
            missing[key] = str(err)
        except Exception as err:  # noqa: BLE001 - online, any failure to fetch a Hub dataset is reported per benchmark
            if offline:
                raise
            missing[key] = f"could not load the Hub dataset: {type(err).__name__}: {err}"
        else:
            ready[key] = loaded["tasks"]
            built[key] = loaded["groups"][groups[key]]
    return ready, missing, built


def _check_generation_fits(checkpoints: list[Path], ready: dict[str, dict], max_gen_toks: int | None) -> None:
    """lm-eval keeps a generation task's token budget free in the model's context and stops at an assertion, after
    the other tasks ran, when it does not fit (BBH CoT allows 1024 tokens): say so before anything runs."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils import normalize_gen_kwargs, resolve_max_length

    budgets = [
        (max_gen_toks or normalize_gen_kwargs(task.config.generation_kwargs or {})["max_gen_toks"], name)
        for tasks in ready.values()
        for name, task in tasks.items()
        if task.OUTPUT_TYPE == "generate_until"
    ]
    if not budgets:
        return
    budget, task = max(budgets)
    for checkpoint in checkpoints:
        context = resolve_max_length(load_config(checkpoint), default=HFLM._DEFAULT_MAX_LENGTH)  # as HFLM reads it
        if budget >= context:
            raise CheckpointError(
                f"--model {checkpoint}: its context is {context} tokens (max_position_embeddings) and {task} may "
                f"generate {budget}; pass --max-gen-toks N with 1 <= N < {context}"
            )


def _size(checkpoint: Path) -> tuple[float | None, float | None]:
    counts = parameter_counts(load_config(checkpoint))
    return (counts["total"] / 1e9, counts["flops_per_token"] / 1e9) if counts else (None, None)


def evaluate(
    checkpoints: list[Path],
    benchmarks: list[Benchmark],
    args: argparse.Namespace,
    on_result: Callable[[list[ModelResult]], None] | None = None,
) -> list[ModelResult]:
    """Run lm-eval once per checkpoint on the benchmarks whose data is available; `on_result` gets the results so far
    after each checkpoint."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    offline = args.data_dir is not None
    results: list[ModelResult] = []
    groups = {bench.key: task_name(bench, offline) for bench in benchmarks}  # each can fail alone
    metadata = {"data_dir": str(args.data_dir.resolve())} if offline else None
    task_manager = TaskManager(include_path=tasks_path(), metadata=metadata)
    ready, missing, built = _available(task_manager, groups, offline)
    for key, reason in missing.items():
        print(f"ultramem-eval: benchmark {key} not scored: {reason}", file=sys.stderr)
    if not ready:
        raise LocalDataMissing("no benchmark data could be read: " + "; ".join(missing.values()))
    _check_generation_fits(checkpoints, ready, args.max_gen_toks)
    for checkpoint in tqdm(checkpoints, desc="checkpoints", unit="model"):
        identity = fingerprint(checkpoint)  # of the files scored, for ultramem-push to match the entry
        output = simple_evaluate(
            model="hf",
            model_args={
                "pretrained": str(checkpoint),
                "trust_remote_code": True,
                "dtype": args.dtype,
                **({"memory_offload": args.memory_offload} if args.memory_offload else {}),
            },
            tasks=[built[key] for key in ready],  # built once: lm-eval rebuilds each task's requests per run
            task_manager=task_manager,
            limit=args.limit,
            gen_kwargs={"max_gen_toks": args.max_gen_toks} if args.max_gen_toks else None,
            batch_size=args.batch_size,
            device=args.device,
        )
        params_b, flops_g = _size(checkpoint)
        lm_eval_part = {k: output.get(k, {}) for k in ("results", "groups", "n-shot", "n-samples")}
        results.append(
            ModelResult(
                name=checkpoint.absolute().name,
                checkpoint=str(checkpoint.absolute()),
                params_b=params_b,
                flops_g=flops_g,
                scores=scores_from_lm_eval(output, [b for b in benchmarks if b.key in ready]),
                missing=dict(missing),
                lm_eval=lm_eval_part,
                val_loss=validation_loss(checkpoint),
                fingerprint=identity,
            )
        )
        if on_result is not None:
            on_result(results)
    return results


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What a reader needs to compare the scores: data, caps, and how the model ran (dtype, offload, batch, device)."""
    from importlib.metadata import version

    return {
        "tasks": args.tasks,
        "data_dir": str(args.data_dir) if args.data_dir else "hub",
        "limit": args.limit,
        "max_gen_toks": args.max_gen_toks,
        "dtype": args.dtype,
        "memory_offload": args.memory_offload,
        "batch_size": args.batch_size,
        "device": args.device,
        "lm_eval": version("lm_eval"),
    }


def write_outputs(folder: Path, results: list[ModelResult], settings: dict[str, Any]) -> str:
    """results.md, results.png and results.json (last: its presence means all three are current) of the checkpoints
    scored so far; returns the table."""
    table = markdown_table(results, run_notes(settings))
    (folder / "results.md").write_text(table, encoding="utf-8")
    bar_chart(results, folder / "results.png")
    write_results(folder / "results.json", results, settings)
    return table


def _require_lm_eval() -> None:
    from importlib.util import find_spec

    if find_spec("lm_eval") is None:
        raise ValueError("ultramem-eval needs lm-eval-harness: pip install 'ultramem[eval]'")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_args(args)
        _require_lm_eval()
        benchmarks = select(args.tasks)
        checkpoints = [check_checkpoint(path) for path in args.model]
        _check_output(args.output)
    except ValueError as err:  # includes CheckpointError
        parser.exit(2, f"ultramem-eval: error: {err}\n")
    settings = run_settings(args)
    try:
        results = evaluate(checkpoints, benchmarks, args, lambda done: write_outputs(args.output, done, settings))
    except (LocalDataMissing, CheckpointError) as err:
        parser.exit(2, f"ultramem-eval: error: {err}\n")
    print(markdown_table(results, run_notes(settings)))
    print(f"results: {args.output / 'results.json'}, {args.output / 'results.md'}, {args.output / 'results.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
