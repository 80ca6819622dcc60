"""Results of `ultramem-eval`: the JSON it writes, the paper-style Markdown table, and the bar chart."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ultramem.eval.benchmarks import BENCHMARKS, Benchmark

MISSING = "–"


@dataclass
class ModelResult:
    name: str
    checkpoint: str
    params_b: float | None  # total parameters, embeddings and head excluded (the paper's "Param (B)")
    flops_g: float | None  # forward FLOPs per token (the paper's "FLOPs (G)")
    scores: dict[str, float] = field(default_factory=dict)  # benchmark key -> percent
    missing: dict[str, str] = field(default_factory=dict)  # benchmark key -> why it was not scored
    lm_eval: dict[str, Any] = field(default_factory=dict)  # lm-eval's results, groups, n-shot, n-samples
    val_loss: float | None = None  # the checkpoint's own validation loss (the paper's "Val. loss" column)
    fingerprint: str | None = None  # `ultramem.eval.checkpoint.fingerprint` of the files scored (config + weights)


def scores_from_lm_eval(output: dict[str, Any], benchmarks: list[Benchmark]) -> dict[str, float]:
    """Percent score of each benchmark in lm-eval's `simple_evaluate` output (groups report aggregated metrics)."""
    merged = {**output.get("results", {}), **output.get("groups", {})}
    return {b.key: 100.0 * float(merged[b.task][b.metric]) for b in benchmarks if b.metric in merged.get(b.task, {})}


def average(result: ModelResult) -> float | None:
    """Plain mean over the benchmarks scored, as the paper's Avg column (None when nothing was scored)."""
    return sum(result.scores.values()) / len(result.scores) if result.scores else None


def _fmt(value: float | None, digits: int = 2) -> str:
    return MISSING if value is None else f"{value:.{digits}f}"


def _fmt_size(value: float | None) -> str:
    return MISSING if value is None else f"{value:.3g}"


def markdown_table(
    results: list[ModelResult], notes: Sequence[str] = (), benchmarks: tuple[Benchmark, ...] = BENCHMARKS
) -> str:
    """The layout of the paper's Table "Performance metrics of various models": one row per model, then Avg.

    Scores are percentages; a benchmark that was not scored shows "–" and Avg is then over fewer benchmarks,
    which a note under the table says. Val. loss is each checkpoint's own validation loss, not the paper's set.
    """
    header = ["Model", "Param (B)", "FLOPs (G)", "Val. loss", *(b.title for b in benchmarks), "Avg"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    notes = list(notes)
    for r in results:
        sizes = [_fmt_size(r.params_b), _fmt_size(r.flops_g), _fmt(r.val_loss)]
        row = [r.name, *sizes, *(_fmt(r.scores.get(b.key)) for b in benchmarks)]
        lines.append("| " + " | ".join([*row, _fmt(average(r))]) + " |")
        if len(r.scores) < len(benchmarks):
            note = f"{r.name}: Avg over the {len(r.scores)} of {len(benchmarks)} benchmarks scored"
            if r.missing:
                note += "; data not available: " + ", ".join(b.title for b in benchmarks if b.key in r.missing)
            notes.append(note + ".")
    return "\n".join(lines + ([""] + [f"- {n}" for n in notes] if notes else [])) + "\n"


def bar_chart(results: list[ModelResult], path: Path, benchmarks: tuple[Benchmark, ...] = BENCHMARKS) -> None:
    """Grouped bars, one group per benchmark scored plus Avg, one bar per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benchmarks = tuple(b for b in benchmarks if any(b.key in r.scores for r in results))
    labels = [b.title for b in benchmarks] + ["Avg"]
    width = 0.8 / len(results)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.1 * len(labels)), 4.5))
    for i, r in enumerate(results):
        values = [r.scores.get(b.key) for b in benchmarks] + [average(r)]
        xs = [j + (i - (len(results) - 1) / 2) * width for j, v in enumerate(values) if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width, label=r.name)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylabel("score (%)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_notes(settings: Mapping[str, Any]) -> list[str]:
    """What a reader of the scores must know to compare them with the paper: data source and any caps.

    Derived from the run's settings alone, so a table and a model card say the same and never show a local path.
    """
    version = f"lm-eval {settings['lm_eval']}" if settings.get("lm_eval") else "lm-eval"
    source = "the Hub datasets" if settings.get("data_dir", "hub") == "hub" else "local copies of the published files"
    notes = [f"{version} on {source}; shots and metrics of the ultramem_paper group."]
    if settings.get("limit") is not None:
        notes.append(
            f"At most {settings['limit']:g} documents per task (--limit): not comparable with full-set scores."
        )
    if settings.get("max_gen_toks") is not None:
        notes.append(f"Generation capped at {settings['max_gen_toks']} tokens (--max-gen-toks).")
    if settings.get("dtype", "float32") != "float32":
        notes.append(f"Weights and activations in {settings['dtype']} (--dtype).")
    return notes


def write_results(path: Path, results: list[ModelResult], settings: dict[str, Any]) -> None:
    """The results JSON, replaced whole (written beside it, then renamed): an interrupted run leaves the last one."""
    payload = {
        "benchmarks": [asdict(b) for b in BENCHMARKS],
        "settings": settings,
        "notes": run_notes(settings),
        "models": [asdict(r) for r in results],
    }
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(payload, indent=1, default=str), encoding="utf-8")
    partial.replace(path)


def read_results(path: str | Path) -> tuple[list[ModelResult], dict[str, Any]]:
    """Model results and run settings (data source, --limit, --max-gen-toks) of an `ultramem-eval` results JSON."""
    payload = json.loads(Path(path).read_text(encoding="utf-8"))
    return [ModelResult(**model) for model in payload["models"]], payload["settings"]
