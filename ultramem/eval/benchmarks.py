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


def group_entries() -> dict[str, dict[str, Any]]:
    """The entries of the shipped `ultramem_paper` group (task or group name plus shot settings), by lm-eval name."""
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(Path(tasks_path()) / f"{GROUP}.yaml", resolve_func=False)
    return {entry.get("task") or entry["group"]: entry for entry in config["task"]}
