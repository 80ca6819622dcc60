"""Read local copies of the benchmarks, in the formats they are published in, as the Hub datasets lm-eval expects.

lm-eval's built-in task configs name a Hub dataset (`dataset_path`, `dataset_name`). Offline, each of those
configs gets `custom_dataset: load_local` instead: the reader for that Hub dataset loads the published files
from `data_dir` and returns the same columns and split names, so lm-eval's own prompts, filters and metrics
run unchanged. Reference layout of `data_dir` (mirrored by the test fixtures in tests/eval/fixtures/eval/):

    mmlu/{test,dev}/<subject>_{test,dev}.csv         hendrycks CSV, no header: question,A,B,C,D,answer
    arc/ARC-Challenge-{Test,Dev}.jsonl               AI2 ARC-V1 jsonl (optional ARC-Challenge-Train.jsonl)
    gpqa/gpqa_diamond.csv                            GPQA CSV
    triviaqa/triviaqa_sm_sub.jsonl                   llm-foundry TriviaQA subset: context, answer, aliases
    bbh/bbh/<task>.json                              BIG-Bench Hard {"examples": [{input, target}]}
    boolq/superglue_boolq_val.jsonl                  SuperGLUE BoolQ jsonl (label bool or "true"/"false")
    hellaswag/hellaswag_val.jsonl                    original HellaSwag jsonl, or
    hellaswag/hellaswag_val_full.txt.bz2             6-line text format (activity_label: ctx, label, 4 endings)
    winogrande/dev.jsonl                             winogrande_1.1 (optional train_xl.jsonl)
    drop/drop_dataset_dev.json                       DROP (optional drop_dataset_train.json)
    agieval/v1/<task>.jsonl                          AGIEval data/v1

Where the split lm-eval draws few-shot examples from is not in the layout (TriviaQA, BoolQ, HellaSwag and
WinoGrande train, DROP train unless given, ARC train), the evaluation split stands in: lm-eval's samplers
drop the evaluated document from its own few-shot context. ARC uses its Dev file instead.
"""

from __future__ import annotations

import bz2
import csv
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from datasets import Dataset, DatasetDict

logger = logging.getLogger(__name__)

Rows = list[dict[str, Any]]


class LocalDataMissing(FileNotFoundError):
    """A benchmark file of the reference layout is not in the data directory."""


def _require(path: Path) -> Path:
    if not path.is_file():
        raise LocalDataMissing(f"missing local benchmark file {path}")
    return path


def _read_jsonl(path: Path) -> Rows:
    with _require(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _stand_in(splits: dict[str, Rows], missing: str, source: str, what: str) -> None:
    logger.info("%s: no local %r split; few-shot examples come from the %r split", what, missing, source)
    splits[missing] = splits[source]


def _mmlu(data_dir: Path, subject: str) -> dict[str, Rows]:
    def read(split: str) -> Rows:
        with _require(data_dir / "mmlu" / split / f"{subject}_{split}.csv").open(encoding="utf-8", newline="") as fh:
            return [
                {"question": q, "subject": subject, "choices": [a, b, c, d], "answer": "ABCD".index(letter.strip())}
                for q, a, b, c, d, letter in csv.reader(fh)
            ]

    return {"test": read("test"), "dev": read("dev")}


def _arc(data_dir: Path, name: str) -> dict[str, Rows]:
    def read(split: str) -> Rows:
        return [
            {
                "id": row["id"],
                "question": row["question"]["stem"],
                "choices": {
                    "text": [c["text"] for c in row["question"]["choices"]],
                    "label": [c["label"] for c in row["question"]["choices"]],
                },
                "answerKey": row["answerKey"],
            }
            for row in _read_jsonl(data_dir / "arc" / f"{name}-{split}.jsonl")
        ]

    splits = {"test": read("Test"), "validation": read("Dev")}
    if (data_dir / "arc" / f"{name}-Train.jsonl").is_file():
        splits["train"] = read("Train")
    else:
        _stand_in(splits, "train", "validation", f"{name} (Dev file)")
    return splits


def _gpqa(data_dir: Path, name: str) -> dict[str, Rows]:
    with _require(data_dir / "gpqa" / f"{name}.csv").open(encoding="utf-8", newline="") as fh:
        return {"train": list(csv.DictReader(fh))}


def _triviaqa(data_dir: Path, name: str) -> dict[str, Rows]:
    rows = []
    for row in _read_jsonl(data_dir / "triviaqa" / "triviaqa_sm_sub.jsonl"):
        # The subset stores the rendered prompt "Question: ...?\nAnswer:"; lm-eval renders it from `question`.
        question = row["context"].strip().removeprefix("Question:").removesuffix("Answer:").strip()
        aliases = list(dict.fromkeys([row["answer"], *row["aliases"]]))
        rows.append({"question": question.removesuffix("?"), "answer": {"value": row["answer"], "aliases": aliases}})
    splits = {"validation": rows}
    _stand_in(splits, "train", "validation", "TriviaQA subset")
    return splits


def _bbh(data_dir: Path, name: str) -> dict[str, Rows]:
    with _require(data_dir / "bbh" / "bbh" / f"{name}.json").open(encoding="utf-8") as fh:
        return {"test": json.load(fh)["examples"]}


def _boolq(data_dir: Path, name: str) -> dict[str, Rows]:
    rows = [
        {**row, "label": int(row["label"] if isinstance(row["label"], bool) else row["label"] == "true")}
        for row in _read_jsonl(data_dir / "boolq" / "superglue_boolq_val.jsonl")
    ]
    splits = {"validation": rows}
    _stand_in(splits, "train", "validation", "BoolQ")
    return splits


def _hellaswag_text(path: Path) -> Rows:
    with bz2.open(_require(path), "rt", encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    rows = []
    for i in range(0, len(lines) - len(lines) % 6, 6):
        activity_label, _, ctx = lines[i].partition(": ")
        rows.append(
            {
                "activity_label": activity_label,
                "ctx_a": ctx,
                "ctx_b": "",
                "label": lines[i + 1],
                "endings": lines[i + 2 : i + 6],
            }
        )
    return rows


def _hellaswag(data_dir: Path, name: str | None) -> dict[str, Rows]:
    original = data_dir / "hellaswag" / "hellaswag_val.jsonl"
    rows = (
        _read_jsonl(original)
        if original.is_file()
        else _hellaswag_text(data_dir / "hellaswag" / "hellaswag_val_full.txt.bz2")
    )
    splits = {"validation": [{**row, "label": str(row["label"])} for row in rows]}
    _stand_in(splits, "train", "validation", "HellaSwag")
    return splits


def _winogrande(data_dir: Path, name: str) -> dict[str, Rows]:
    keys = ("sentence", "option1", "option2", "answer")
    splits = {"validation": [{k: row[k] for k in keys} for row in _read_jsonl(data_dir / "winogrande" / "dev.jsonl")]}
    train = data_dir / "winogrande" / "train_xl.jsonl"
    if train.is_file():
        splits["train"] = [{k: row[k] for k in keys} for row in _read_jsonl(train)]
    else:
        _stand_in(splits, "train", "validation", "WinoGrande")
    return splits


def _drop_answer(answer: dict[str, Any]) -> dict[str, Any]:
    date = answer.get("date") or {}
    return {
        "number": str(answer.get("number", "")),
        "date": {k: str(date.get(k, "")) for k in ("day", "month", "year")},
        "spans": list(answer.get("spans", [])),
    }


def _drop_file(path: Path) -> Rows:
    with _require(path).open(encoding="utf-8") as fh:
        passages = json.load(fh)
    rows = []
    for section_id, section in passages.items():
        for qa in section["qa_pairs"]:
            validated = [_drop_answer(a) for a in qa.get("validated_answers", [])]
            rows.append(
                {
                    "section_id": section_id,
                    "query_id": qa["query_id"],
                    "passage": section["passage"],
                    "question": qa["question"],
                    "answer": _drop_answer(qa["answer"]),
                    # The Hub copy stores validated answers column-wise.
                    "validated_answers": {k: [a[k] for a in validated] for k in ("number", "date", "spans")},
                }
            )
    return rows


def _drop(data_dir: Path, name: str | None) -> dict[str, Rows]:
    splits = {"validation": _drop_file(data_dir / "drop" / "drop_dataset_dev.json")}
    train = data_dir / "drop" / "drop_dataset_train.json"
    if train.is_file():
        splits["train"] = _drop_file(train)
    else:
        _stand_in(splits, "train", "validation", "DROP")
    return splits


def _agieval_row(row: dict[str, Any]) -> dict[str, Any]:
    """AGIEval's own zero-shot template (`dataset_loader.convert_zero_shot`), the prompts of hails/agieval-*."""
    passage = row.get("passage") or ""
    if not row.get("options"):  # cloze tasks (math): free-form answer
        return {"query": f"{passage}Q: {row['question']}\nA: The answer is", "answer": row["answer"]}
    options = row["options"]
    last_letter = "ABCDEFG"[len(options) - 1]
    labels = row["label"] if isinstance(row["label"], list) else [row["label"]]
    question = f"{passage}Q: {row['question']} Answer Choices: {' '.join(options)}"
    return {
        "query": f"{question}\nA: Among A through {last_letter}, the answer is",
        "choices": options,
        "gold": ["ABCDEFG".index(label) for label in labels],
    }


def _agieval(data_dir: Path, task: str) -> dict[str, Rows]:
    return {"test": [_agieval_row(row) for row in _read_jsonl(data_dir / "agieval" / "v1" / f"{task}.jsonl")]}


# Hub dataset of lm-eval's built-in config -> reader of the local published files, called with dataset_name.
READERS: dict[str, Callable[[Path, Any], dict[str, Rows]]] = {
    "cais/mmlu": _mmlu,
    "allenai/ai2_arc": _arc,
    "Idavidrein/gpqa": _gpqa,
    "mandarjoshi/trivia_qa": _triviaqa,
    "SaylorTwift/bbh": _bbh,
    "aps/super_glue": _boolq,
    "Rowan/hellaswag": _hellaswag,
    "allenai/winogrande": _winogrande,
    "EleutherAI/drop": _drop,
}
AGIEVAL_PREFIX = "hails/agieval-"


def read_local(data_dir: str | Path, dataset_path: str, dataset_name: str | None) -> DatasetDict:
    """The local copy of Hub dataset `dataset_path`/`dataset_name`, with the Hub copy's columns and splits."""
    root = Path(data_dir)
    if not root.is_dir():
        raise LocalDataMissing(f"data_dir {root} is not a directory")
    if dataset_path.startswith(AGIEVAL_PREFIX):
        splits = _agieval(root, dataset_path.removeprefix(AGIEVAL_PREFIX))
    elif dataset_path in READERS:
        splits = READERS[dataset_path](root, dataset_name)
    else:
        raise ValueError(
            f"no local reader for dataset {dataset_path!r}; known: {sorted(READERS)} and {AGIEVAL_PREFIX}*"
        )
    return DatasetDict({split: Dataset.from_list(rows) for split, rows in splits.items()})


def load_local(data_dir: str | None = None, config_source: str | None = None, **_: Any) -> DatasetDict:
    """lm-eval `custom_dataset` hook: lm-eval passes the task's metadata (`--metadata`) as keyword arguments.

    `config_source` is the built-in YAML the task came from; its `dataset_path`/`dataset_name` say which
    benchmark and subset to read.
    """
    from lm_eval.tasks._yaml_loader import load_yaml

    if not data_dir:
        raise ValueError(
            'offline ultramem tasks need the benchmark folder: --metadata \'{"data_dir": "/path/to/eval"}\''
        )
    if not config_source or not Path(config_source).is_file():
        raise ValueError(f"offline loader got no task YAML (config_source={config_source!r})")
    config = load_yaml(config_source, resolve_func=False)
    return read_local(data_dir, config["dataset_path"], config.get("dataset_name"))
