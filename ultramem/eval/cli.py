"""`ultramem-eval`: score checkpoints on the paper's benchmarks with lm-eval, from the Hub or from local copies.

    ultramem-eval --model CKPT [CKPT ...] --tasks ultramem_paper [--data-dir DIR] [--limit N] [--output DIR]

Writes `results.json`, `results.md` (the paper's table layout) and, for several checkpoints, `results.png`.
Benchmarks whose data cannot be read are reported by name and left out of the run, never dropped silently.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ultramem.eval import tasks_path
from ultramem.eval.benchmarks import Benchmark, select, task_name
from ultramem.eval.checkpoint import (
    CheckpointError,
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
    parser.add_argument("--output", type=Path, default=Path("eval_results"), help="folder for results.json/.md/.png")
    parser.add_argument("--limit", type=float, help="documents per task: a count (>= 1) or a fraction in (0, 1)")
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
    if args.limit is not None and args.limit <= 0:
        raise ValueError(f"--limit must be > 0 (a count >= 1 or a fraction in (0, 1)), got {args.limit}")
    if args.max_gen_toks is not None and args.max_gen_toks < 1:
        raise ValueError(f"--max-gen-toks must be >= 1, got {args.max_gen_toks}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.data_dir is not None and not args.data_dir.is_dir():
        raise ValueError(f"--data-dir {args.data_dir}: not a folder")


def _available(task_manager: Any, groups: dict[str, str], offline: bool) -> tuple[dict[str, dict], dict[str, str]]:
    """Split benchmarks into those whose data loads (key -> its tasks by name) and those missing (key -> reason)."""
    ready, missing = {}, {}
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
    return ready, missing


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


def evaluate(checkpoints: list[Path], benchmarks: list[Benchmark], args: argparse.Namespace) -> list[ModelResult]:
    """Run lm-eval once per checkpoint on the benchmarks whose data is available."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    offline = args.data_dir is not None
    results = []
    groups = {bench.key: task_name(bench, offline) for bench in benchmarks}  # each can fail alone
    metadata = {"data_dir": str(args.data_dir.resolve())} if offline else None
    task_manager = TaskManager(include_path=tasks_path(), metadata=metadata)
    ready, missing = _available(task_manager, groups, offline)
    for key, reason in missing.items():
        print(f"ultramem-eval: benchmark {key} not scored: {reason}", file=sys.stderr)
    if not ready:
        raise LocalDataMissing("no benchmark data could be read: " + "; ".join(missing.values()))
    _check_generation_fits(checkpoints, ready, args.max_gen_toks)
    for checkpoint in tqdm(checkpoints, desc="checkpoints", unit="model"):
        output = simple_evaluate(
            model="hf",
            model_args={
                "pretrained": str(checkpoint),
                "trust_remote_code": True,
                "dtype": args.dtype,
                **({"memory_offload": args.memory_offload} if args.memory_offload else {}),
            },
            tasks=[groups[key] for key in ready],
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
            )
        )
    return results


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
        checkpoints = [require_tokenizer(require_checkpoint(path)) for path in args.model]
    except ValueError as err:  # includes CheckpointError
        parser.exit(2, f"ultramem-eval: error: {err}\n")
    try:
        results = evaluate(checkpoints, benchmarks, args)
    except (LocalDataMissing, CheckpointError) as err:
        parser.exit(2, f"ultramem-eval: error: {err}\n")
    from importlib.metadata import version

    args.output.mkdir(parents=True, exist_ok=True)
    settings = {
        "tasks": args.tasks,
        "data_dir": str(args.data_dir) if args.data_dir else "hub",
        "limit": args.limit,
        "max_gen_toks": args.max_gen_toks,
        "lm_eval": version("lm_eval"),
    }
    write_results(args.output / "results.json", results, settings)
    table = markdown_table(results, run_notes(settings))
    (args.output / "results.md").write_text(table, encoding="utf-8")
    if len(results) > 1:
        bar_chart(results, args.output / "results.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
