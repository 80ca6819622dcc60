"""The paper's ten benchmarks: their lm-eval task names, the metric each reports, and their table columns."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ultramem.eval import tasks_path

GROUP = "ultramem_paper"


@dataclass(frozen=True)
class Benchmark:
    key: str  # name on the ultramem-eval command line
    task: str  # lm-eval task or group in the `ultramem_paper` group (and the key of its results)
    title: str  # column of the paper's table
    metric: str  # lm-eval result key, "metric,filter"
    dataset: str  # Hub dataset of lm-eval's task (the model card's model-index names it)


# Column order of the paper's appendix Table "All performance metrics of various models".
BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("arc_challenge", "arc_challenge", "ARC-C", "acc_norm,none", "allenai/ai2_arc"),
    Benchmark("gpqa", "gpqa_diamond_zeroshot", "GPQA", "acc,none", "Idavidrein/gpqa"),
    Benchmark("triviaqa", "triviaqa", "TriviaQA", "exact_match,remove_whitespace", "mandarjoshi/trivia_qa"),
    Benchmark("mmlu", "mmlu", "MMLU", "acc,none", "cais/mmlu"),
    Benchmark("bbh", "bbh_cot_fewshot", "BBH cot", "exact_match,get-answer", "SaylorTwift/bbh"),
    Benchmark("boolq", "boolq", "BoolQ", "acc,none", "aps/super_glue"),
    Benchmark("hellaswag", "hellaswag", "HellaSwag", "acc_norm,none", "Rowan/hellaswag"),
    Benchmark("winogrande", "winogrande", "WinoGrande", "acc,none", "allenai/winogrande"),
    Benchmark("agieval", "agieval_en", "AGIEval", "acc,none", "hails/agieval-*"),
    Benchmark("drop", "drop", "DROP", "f1,none", "EleutherAI/drop"),
)


def select(names: str) -> list[Benchmark]:
    """Benchmarks for a comma-separated `--tasks` value: `ultramem_paper`, or keys / lm-eval names of the ten."""
    by_name = {b.key: b for b in BENCHMARKS} | {b.task: b for b in BENCHMARKS}
    chosen: list[Benchmark] = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name in (GROUP, f"{GROUP}_offline"):
            chosen.extend(BENCHMARKS)
        elif name in by_name:
            chosen.append(by_name[name])
        else:
            allowed = ", ".join([GROUP, *(b.key for b in BENCHMARKS)])
            raise ValueError(f"--tasks: unknown task {name!r}; allowed: {allowed}")
    if not chosen:
        raise ValueError(f"--tasks: empty; allowed: {GROUP} or a comma-separated subset of its benchmarks")
    return list(dict.fromkeys(chosen))


# offline_group re-exports local_data.load_local and keeps lm-eval quiet about it
LOCAL_LOADER = "ultramem.eval.offline_group.load_local"


def task_name(bench: Benchmark, offline: bool) -> str:
    """The shipped one-benchmark group: `ultramem_<key>` (Hub data) or `ultramem_<key>_offline` (local copies)."""
    return f"ultramem_{bench.key}_offline" if offline else f"ultramem_{bench.key}"


def task_yaml(bench: Benchmark, offline: bool) -> str:
    """The YAML of `task_name(bench, offline)`: its `ultramem_paper` entry (task or group and shots), alone; offline,
    every task in it reads the local copies (a group-level `custom_dataset`, as in `ultramem_paper_offline`)."""
    import yaml

    source = "local copies (--metadata '{\"data_dir\": ...}')" if offline else "the Hub datasets"
    header = f"# {bench.title} of the ultramem_paper group, alone, on {source}. Generated: ultramem.eval.benchmarks.\n"
    body = yaml.safe_dump({"group": task_name(bench, offline), "task": [group_entries()[bench.task]]}, sort_keys=False)
    loader = f"custom_dataset: !function {LOCAL_LOADER}\n" if offline else ""
    return header + body + loader + "metadata:\n  version: 1.0\n"


def write_task_yamls(folder: Path | None = None) -> list[Path]:
    """(Re)write the shipped one-benchmark YAMLs from `ultramem_paper.yaml`; a test checks they are current."""
    folder = Path(tasks_path()) if folder is None else folder
    paths = []
    for bench in BENCHMARKS:
        for offline in (False, True):
            path = folder / f"{task_name(bench, offline)}.yaml"
            path.write_text(task_yaml(bench, offline), encoding="utf-8")
            paths.append(path)
    return paths


def group_entries() -> dict[str, dict[str, Any]]:
    """The entries of the shipped `ultramem_paper` group (task or group name plus shot settings), by lm-eval name."""
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(Path(tasks_path()) / f"{GROUP}.yaml", resolve_func=False)
    return {entry.get("task") or entry["group"]: entry for entry in config["task"]}
