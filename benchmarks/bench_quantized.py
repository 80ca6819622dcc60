"""The quality cost of quantized value tables: validation loss, per-token KL to fp32 and lm-eval task scores, fp32 vs
int8 vs int4.

    OMP_NUM_THREADS=1 python benchmarks/bench_quantized.py --checkpoint runs/tiny-ultramem \
        [--int4-group-sizes 64,32] [--blocks 32 --block-size 128] [--name quantized_quality_tiny] \
        [--tasks boolq,winogrande --eval-data /path/to/eval --limit 100]

Every variant is the same checkpoint with its value tables quantized at load (`ultramem.quantized`, the "local"
store, CPU op), run on the same fixed validation blocks (the package's embedded Gutenberg valid split by default,
blocks taken evenly across it). Reported per variant: the language-model loss (mean next-token cross entropy), its
change against fp32 (absolute and relative), the mean per-token KL(fp32 || variant) in nats, the table bytes and
the tables' relative rms error. The KL is computed from the two models' log-probabilities at every position.

With `--tasks` (benchmark keys of `ultramem.eval.benchmarks`, comma-separated), each variant is also scored by the
`lm_eval` command line (`--model hf`, the format in `--model_args` as `memory_quantization=...` /
`memory_quantization_group_size=...`, which reach `from_pretrained`), on the local copies in `--eval-data` (the
`ultramem_<key>_offline` tasks) or the Hub's datasets. Reported per variant and benchmark: lm-eval's score (the
metric the paper's table uses), the share of documents that metric scores as it scores fp32's, and the mean absolute
change of the log-likelihoods lm-eval scored against fp32's (zero for a quantized variant means the format never reached the
model: the benchmark stops there). Writes `<results-dir>/<name>.json`, the tables as `.md` and a plot as `.png`.
"""

from __future__ import annotations

import json
import lzma
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lib import cli, env, report

DEFAULT_DATA = env.REPO / "ultramem" / "data" / "corpus" / "valid.jsonl.xz"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
Variant = tuple[str, str | None, int | None]  # name, format (None: float), int4 group size (None: the default)
# lm-eval's command line (its own entry point, argv unchanged) with the installed package imported first: the Auto
# classes then build the installed `ultramem` model classes, the ones the loss measurement above runs, not a
# checkpoint's remote-code copy.
LM_EVAL = "import sys, ultramem; from lm_eval.__main__ import cli_evaluate; sys.argv[0] = 'lm_eval'; cli_evaluate()"


def validation_blocks(tokenizer, data: Path, blocks: int, block_size: int) -> torch.Tensor:
    """(blocks, block_size) token ids taken evenly across the concatenated validation texts."""
    opener = lzma.open if data.suffix == ".xz" else open
    with opener(data, "rt") as handle:
        text = "\n\n".join(json.loads(line)["text"] for line in handle)
    ids = torch.tensor(tokenizer(text)["input_ids"])
    usable = ids.numel() // block_size
    if usable < blocks:
        sys.exit(f"error: {data} has {usable} blocks of {block_size} tokens, fewer than --blocks {blocks}")
    starts = torch.linspace(0, usable - 1, blocks).long() * block_size
    return torch.stack([ids[s : s + block_size] for s in starts.tolist()])


def table_error(model, reference) -> tuple[int, float]:
    """Bytes of the value tables and their rms error relative to the reference's float tables."""
    from ultramem.quantized import dequantize

    nbytes, error, norm = 0, 0.0, 0.0
    for name in reference.get_value_table_names():  # product-key and n-gram tables alike
        store = model.get_submodule(name.removesuffix(".weight"))
        table, exact = store.weight, reference.get_parameter(name).detach().float()
        nbytes += table.numel() * table.element_size()
        dense = dequantize(table, store.format, store.group_size) if table.dtype == torch.uint8 else table
        error += (dense.float() - exact).pow(2).sum().item()
        norm += exact.pow(2).sum().item()
    return nbytes, (error / norm) ** 0.5


@torch.no_grad()
def measure(
    checkpoint: str | Path,
    blocks: torch.Tensor,
    variants: list[Variant],
    batch_size: int = 8,
) -> list[dict]:
    """One row per (name, format, group size) variant; the first must be the float model (format None).

    Every model is loaded first, then each batch of blocks runs through all of them: the fp32 log-probabilities of a
    batch are compared with each variant's at once (the vocabulary-wide log-probs of every block never coexist).
    """
    from ultramem import UltraMemForCausalLM
    from ultramem.quantized import from_pretrained_quantized

    models = []
    for _, format, group_size in variants:
        if format is None:
            model = UltraMemForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        else:
            model = from_pretrained_quantized(
                UltraMemForCausalLM,
                checkpoint,
                memory_quantization=format,
                memory_quantization_group_size=group_size,
                dtype=torch.float32,
            )
        models.append(model.eval())
    losses, kls = [0.0] * len(models), [0.0] * len(models)
    for batch in blocks.split(batch_size):
        targets = batch[:, 1:].unsqueeze(-1)
        reference = None
        for i, model in enumerate(models):
            lp = F.log_softmax(model(input_ids=batch).logits[:, :-1].float(), dim=-1)
            reference = lp if reference is None else reference
            losses[i] -= lp.gather(-1, targets).sum().item()
            kls[i] += (reference.exp() * (reference - lp)).sum().item()
    tokens = blocks[:, 1:].numel()
    reference_loss = losses[0] / tokens
    rows = []
    for (name, format, _), model, loss_sum, kl_sum in zip(variants, models, losses, kls, strict=True):
        loss = loss_sum / tokens
        nbytes, rms = table_error(model, models[0])
        rows.append(
            dict(
                variant=name,
                format=format,
                group_size=getattr(model.model.memory_layers[0].values, "group_size", None),
                loss=loss,
                loss_change=loss - reference_loss,
                loss_change_relative=(loss - reference_loss) / reference_loss,
                kl_per_token=kl_sum / tokens,
                table_bytes=nbytes,
                table_rms_error=rms,
            )
        )
    return rows


@dataclass
class TaskRun:
    """How lm-eval scores every variant: the benchmarks (keys of `ultramem.eval.benchmarks`), where their local
    copies are (None: the Hub), documents per task, batch size and the generation budget (None: the task's)."""

    keys: str
    data_dir: Path | None = None
    limit: int = 100
    batch_size: int = 8
    max_gen_toks: int | None = None


def lm_eval_command(checkpoint: str | Path, variant: Variant, tasks: list[str], run: TaskRun, out: Path) -> list[str]:
    """The `lm_eval` command line scoring one variant: the table format travels in `--model_args`."""
    from ultramem.eval import tasks_path

    _, format, group_size = variant
    model_args = f"pretrained={checkpoint},dtype=float32"
    model_args += f",memory_quantization={format}" if format else ""
    model_args += f",memory_quantization_group_size={group_size}" if group_size else ""
    command = [
        sys.executable, "-c", LM_EVAL, "--model", "hf", "--model_args", model_args,
        "--include_path", tasks_path(), "--tasks", ",".join(tasks), "--limit", str(run.limit),
        "--batch_size", str(run.batch_size), "--device", "cpu", "--output_path", str(out), "--log_samples",
    ]  # fmt: skip
    if run.data_dir is not None:
        command += ["--metadata", json.dumps({"data_dir": str(run.data_dir.resolve())})]
    if run.max_gen_toks:
        command += ["--gen_kwargs", f"max_gen_toks={run.max_gen_toks}"]
    return command


def leaf_tasks(group_subtasks: dict[str, list[str]], name: str) -> list[str]:
    """The lm-eval tasks (those that log samples) under a task or group name."""
    if name not in group_subtasks:
        return [name]
    return [leaf for sub in group_subtasks[name] for leaf in leaf_tasks(group_subtasks, sub)]


def document_scores(out: Path, leaves: list[str], metric: str) -> dict[tuple[str, int], tuple[float, list[float]]]:
    """{(task, doc_id): (the document's score by `metric`, its log-likelihoods)} from lm-eval's samples; a
    generation task has no log-likelihoods."""
    files = {path.stem.removeprefix("samples_").rsplit("_", 1)[0]: path for path in out.rglob("samples_*.jsonl")}
    found = {}
    for task in leaves:
        for line in files[task].read_text(encoding="utf-8").splitlines():
            sample = json.loads(line)
            scored = sample["filtered_resps"]
            lls = [float(choice[0]) for choice in scored] if scored and isinstance(scored[0], list) else []
            found[task, sample["doc_id"]] = (float(sample[metric]), lls)
    return found


def score_tasks(checkpoint: str | Path, variants: list[Variant], run: TaskRun) -> list[dict]:
    """One row per variant: lm-eval's score of each benchmark, the share of documents it scores as fp32 does (by the
    benchmark's metric) and the mean absolute change of the log-likelihoods against fp32's.
    The first variant must be the float model; each runs in its own `lm_eval` process."""
    import tempfile

    from ultramem.eval.benchmarks import select, task_name
    from ultramem.eval.report import scores_from_lm_eval

    benchmarks = select(run.keys)
    tasks = [task_name(b, offline=run.data_dir is not None) for b in benchmarks]
    rows, reference = [], {}
    with tempfile.TemporaryDirectory(prefix="bench_quantized_") as tmp:
        for variant in variants:
            out = Path(tmp) / variant[0]
            start = time.perf_counter()
            command = lm_eval_command(checkpoint, variant, tasks, run, out)
            done = subprocess.run(command, env={**os.environ, **OFFLINE_ENV}, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"error: lm_eval failed on {variant[0]} ({' '.join(command)}):\n{done.stderr[-3000:]}")
            seconds = time.perf_counter() - start
            (results_file,) = out.rglob("results_*.json")
            output = json.loads(results_file.read_text(encoding="utf-8"))
            row: dict[str, Any] = dict(
                variant=variant[0], seconds=seconds, scores=scores_from_lm_eval(output, benchmarks)
            )
            row.update(documents={}, agreement={}, loglikelihood_change={})
            for bench, task in zip(benchmarks, tasks, strict=True):
                leaves = leaf_tasks(output.get("group_subtasks", {}), task)
                found = document_scores(out, leaves, bench.metric.split(",")[0])
                reference.setdefault(bench.key, found)
                base = reference[bench.key]
                changes = [
                    abs(a - b) for key, (_, lls) in found.items() for a, b in zip(lls, base[key][1], strict=True)
                ]
                row["documents"][bench.key] = len(found)
                row["agreement"][bench.key] = sum(found[k][0] == base[k][0] for k in found) / len(found)
                row["loglikelihood_change"][bench.key] = sum(changes) / len(changes) if changes else None
                if variant[1] is not None and changes and max(changes) == 0:
                    sys.exit(f"error: {variant[0]} scored exactly as fp32 on {bench.key}: the format never reached "
                             "the model")  # fmt: skip
            rows.append(row)
    return rows


def markdown(rows: list[dict], tokens: int, checkpoint: str) -> str:
    lines = [
        f"Checkpoint `{checkpoint}`, {tokens} predicted tokens.",
        "",
        "| variant | group | loss | change | relative | KL/token (nats) | table MB | table rms error |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['group_size'] or '-'} | {r['loss']:.5f} | {r['loss_change']:+.5f} | "
            f"{r['loss_change_relative']:+.3%} | {r['kl_per_token']:.2e} | {r['table_bytes'] / 1e6:.2f} | "
            f"{r['table_rms_error']:.4f} |"
        )
    return "\n".join(lines)


def task_markdown(rows: list[dict], limit: int) -> str:
    """lm-eval's score (percent) of each benchmark per variant, the documents scored as fp32 scores them and the
    log-likelihood change."""
    keys = list(rows[0]["scores"])
    lines = [
        f"lm-eval, at most {limit} documents per task; score in percent (documents scored as fp32 scores them, "
        "mean |change| of the log-likelihoods against fp32's).",
        "",
        "| variant | " + " | ".join(f"{k} (n={rows[0]['documents'][k]})" for k in keys) + " | lm_eval s |",
        "| --- |" + " ---: |" * (len(keys) + 1),
    ]
    for r in rows:
        cells = []
        for k in keys:
            change = r["loglikelihood_change"][k]
            cells.append(
                f"{r['scores'][k]:.1f} ({r['agreement'][k]:.1%}" + (f", {change:.1e})" if change is not None else ")")
            )
        lines.append(f"| {r['variant']} | " + " | ".join(cells) + f" | {r['seconds']:.0f} |")
    return "\n".join(lines)


def plot(path: Path, rows: list[dict], task_rows: list[dict]) -> None:
    """Loss change and KL per variant; lm-eval scores per benchmark and variant."""
    names = [r["variant"] for r in rows]
    xs = list(range(len(names)))

    def labels(axis) -> None:
        axis.set_xticks(xs, names)

    panels = [
        report.Panel("loss change against fp32", "relative change, %",
                     {"loss": (xs, [100 * r["loss_change_relative"] for r in rows])}, xlog=False, draw=labels),
        report.Panel("per-token KL(fp32 || variant)", "nats", {"KL": (xs, [r["kl_per_token"] for r in rows])},
                     xlog=False, draw=labels),
    ]  # fmt: skip
    if task_rows:
        series = {k: (xs, [r["scores"][k] for r in task_rows]) for k in task_rows[0]["scores"]}
        panels.append(report.Panel("lm-eval score", "percent", series, xlog=False, draw=labels))
    report.plot(path, panels, "quantized value tables: quality cost")


def main(argv: list[str] | None = None) -> None:
    parser = cli.make_parser(__doc__, "quantized_quality", device=False, timed=False)
    add = parser.add_argument
    add("--checkpoint", required=True, help="a trained (float) UltraMem checkpoint folder")
    add("--data", type=Path, default=DEFAULT_DATA, help="validation jsonl(.xz) with a 'text' field")
    add("--blocks", type=int, default=32)
    add("--block-size", type=int, default=128)
    add("--batch-size", type=int, default=8)
    add("--int4-group-sizes", type=cli.int_list, default=[64, 32], help="comma-separated")
    add("--tasks", help="also score lm-eval benchmarks: keys of ultramem.eval.benchmarks, e.g. boolq,arc")
    add("--eval-data", type=Path, help="folder of the benchmarks' local copies (docs/evaluation.md)")
    add("--limit", type=int, default=100, help="lm-eval documents per task")
    add("--eval-batch-size", type=int, default=8, help="lm-eval's --batch_size")
    add("--max-gen-toks", type=int, help="cap the generation tasks' budget (lm-eval's max_gen_toks)")
    args = cli.resolve(parser.parse_args(argv), "quantized_quality")
    cli.at_least(args, blocks=1, block_size=2, batch_size=1, limit=1, eval_batch_size=1)
    if args.tasks:
        from ultramem.eval.benchmarks import select

        try:
            select(args.tasks)
        except ValueError as error:
            parser.error(str(error))
        if args.eval_data is not None and not args.eval_data.is_dir():
            parser.error(f"--eval-data {args.eval_data} is not a folder")
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    blocks = validation_blocks(tokenizer, args.data, args.blocks, args.block_size)
    variants = [("fp32", None, None), ("int8", "int8", None)]
    variants += [(f"int4-g{g}", "int4", g) for g in args.int4_group_sizes]
    rows = measure(args.checkpoint, blocks, variants, args.batch_size)
    table = markdown(rows, blocks[:, 1:].numel(), args.checkpoint)
    task_rows = []
    if args.tasks:
        run = TaskRun(args.tasks, args.eval_data, args.limit, args.eval_batch_size, args.max_gen_toks)
        task_rows = score_tasks(args.checkpoint, variants, run)
        table += "\n\n" + task_markdown(task_rows, args.limit)
    settings = {k: v for k, v in vars(args).items() if k not in ("results_dir", "name", "no_plot")}
    path = report.finish(args, {"checkpoint": str(args.checkpoint), "settings": settings, "rows": rows,
                                "task_rows": task_rows}, table)  # fmt: skip
    path.with_suffix(".md").write_text(table + "\n")
    if not args.no_plot:
        plot(path.with_suffix(".png"), rows, task_rows)


if __name__ == "__main__":
    main()
