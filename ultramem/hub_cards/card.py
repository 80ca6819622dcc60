"""The Hub model card (README.md) of a checkpoint: metadata, size, memory layout, training recipe, usage, scores.

Everything is read from the checkpoint folder (config.json, trainer_state.json when the Trainer wrote one: steps,
logs, the value tables' learning rate) and from an `ultramem-eval` results JSON when given. A section or line whose
facts are missing is left out, never printed with empty numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData
from transformers import PreTrainedConfig

from ultramem.configuration_ultramem import (
    BLOCK_SITE,
    INSTEAD_OF_MLP_SITE,
    MLP_SITE,
    NO_GATE,
    PEER,
    PEER_GELU,
    PRODUCT_KEY,
    SWILU,
    UltraMemConfig,
)
from ultramem.eval.benchmarks import BENCHMARKS, group_entries
from ultramem.eval.checkpoint import (
    CheckpointError,
    load_config,
    model_type,
    parameter_counts,
    require_checkpoint,
    trainer_state,
    validation_loss,
)
from ultramem.eval.report import ModelResult, markdown_table, run_notes

PAPER = "https://arxiv.org/abs/2411.12364"
LM_EVAL = "https://github.com/EleutherAI/lm-evaluation-harness"
CITATION = """@inproceedings{huang2025ultramem,
  title     = {Ultra-Sparse Memory Network},
  author    = {Zihao Huang and Qiyang Min and Hongzhi Huang and Defa Zhu and Yutao Zeng and Ran Guo and Xun Zhou},
  booktitle = {International Conference on Learning Representations (ICLR)},
  year      = {2025}
}"""


def require_ultramem(folder: Path) -> Path:
    """Cards are written for UltraMem checkpoints (remote code, memory layers): any other model is one line."""
    kind = model_type(folder, option="checkpoint")
    if kind != UltraMemConfig.model_type:
        raise CheckpointError(
            f"checkpoint {folder}: model_type {kind!r} is not an UltraMem checkpoint (model_type 'ultramem'); "
            "ultramem-push writes UltraMem model cards only (push other models with `hf upload`)"
        )
    return folder


def _kind(config: PreTrainedConfig) -> str:
    if isinstance(config, UltraMemConfig) and config.memory_layers:
        if config.value_gate == SWILU:
            return "Memory+ memory layers (Berges et al. 2024)"
        if config.value_gate in (PEER, PEER_GELU) or config.memory_site != BLOCK_SITE:
            return "UltraMemV2 memory layers (Huang et al. 2025)"
        return "PKM memory-layer baseline" if config.retrieval_mode == PRODUCT_KEY else "UltraMem memory layers"
    if isinstance(config, UltraMemConfig):
        return "dense baseline: the UltraMem backbone without memory layers"
    return config.model_type


def _tables_note(config: PreTrainedConfig) -> str:
    quantized = getattr(config, "memory_quantization", None)
    return f", {quantized} value tables" if quantized else ""


def _human(count: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return f"{count:g}"


def _size_section(config: PreTrainedConfig) -> str | None:
    counts = parameter_counts(config)
    if counts is None:
        return None
    rows = [
        ("Total parameters (embeddings and LM head excluded)", f"{_human(counts['total'])} ({counts['total']:,})"),
        ("Activated parameters per token", f"{_human(counts['activated'])} ({counts['activated']:,})"),
        (
            "Forward FLOPs per token (2 x activated, attention over the context excluded)",
            _human(counts["flops_per_token"]),
        ),
        ("Transformer blocks / hidden size", f"{config.num_hidden_layers} / {config.hidden_size}"),
    ]
    if counts["memory_slots"]:
        rows.append(
            (
                "Memory slots (virtual, all memory layers)",
                f"{_human(counts['memory_slots'])} ({counts['memory_slots']:,})",
            )
        )
        rows.append(("Physical value rows (all memory layers)", f"{counts['physical_values']:,}"))
    return "## Size\n\n| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


def _placement_row(config: UltraMemConfig) -> tuple[str, str]:
    """Where the memory layers read and write, in the words of their `memory_site` (docs/variants.md)."""
    if config.memory_site == MLP_SITE:
        where = "0-based blocks a: beside block a's MLP, reading the MLP's input, its output added with the MLP's"
    elif config.memory_site == INSTEAD_OF_MLP_SITE:
        where = "0-based blocks a: in place of block a's MLP, reading the MLP's input, its output added instead"
    else:
        skip = ", ".join(f"({a}, {b})" for a, b in config.memory_layers)
        return "Placement (a, b), 0-based blocks: reads the input of block a, adds after block b", skip
    return f"Placement, {where}", ", ".join(str(a) for a, _ in config.memory_layers)


def _table_format(config: UltraMemConfig) -> str | None:
    """The quantized value tables' storage format (`ultramem.quantized.format`), None for float tables."""
    if not getattr(config, "memory_quantization", None):
        return None
    group = config.memory_quantization_group_size
    grouping = f"a scale and a bias per group of {group} columns" if group else "a scale and a bias per column group"
    return f"{config.memory_quantization}, rowwise, {grouping}"


def _memory_section(config: PreTrainedConfig) -> str | None:
    if not isinstance(config, UltraMemConfig) or not config.memory_layers:
        return None
    rows = [
        _placement_row(config),
        ("Retrieval", f"{config.retrieval_mode}, Tucker rank r={config.tucker_rank}, MCS cores h={config.mcs_cores}"),
        (
            "Heads H / top-m per head / key dim",
            f"{config.memory_heads} / {config.memory_topk} / {config.memory_key_dim}",
        ),
        ("Keys per axis n / IVE expansion E", f"{config.memory_num_keys} / {config.ive_expansion}"),
        ("Physical values N per layer / value dim", f"{config.memory_num_values:,} / {config.memory_value_dim}"),
    ]
    successor = [  # the UltraMemV2 / Memory+ switches that are on (docs/variants.md)
        ("Site", config.memory_site, config.memory_site != BLOCK_SITE),
        ("Value gate / pre-value dim", f"{config.value_gate} / {config.pre_value_dim}", config.value_gate != NO_GATE),
        ("IVE groups pooled into one projector", "yes", config.ive_single_projector),
        ("Value pool shared by the memory layers (rows)", f"{config.value_pool_size or 0:,}", config.value_pool_size),
        ("Key-balance loss coefficient", f"{config.key_balance_loss_coef:g}", config.key_balance_loss_coef),
    ]
    rows += [(name, value) for name, value, on in successor if on]
    table_format = _table_format(config)
    if table_format:
        rows.append(("Value table format (quantized: frozen in training)", table_format))
    return "## Memory layers\n\n| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


# Where `ultramem.training` records the value tables' learning rate of a run: the `ValueLearningRate` callback among
# the Trainer's stateful callbacks in trainer_state.json (a training argument, not a field of the model's config)
VALUE_LR_RECORD = "ValueLearningRate"


def _value_lr_line(state: Mapping[str, Any] | None) -> str | None:
    """The value tables' learning rate the run recorded; None when it recorded none (the line is left out)."""
    recorded = ((state or {}).get("stateful_callbacks") or {}).get(VALUE_LR_RECORD) or {}
    settings = recorded.get("args")
    if not settings:
        return None
    shape = "decaying linearly to 1x by the end of training" if settings["value_lr_decay"] else "constant"
    return f"- Value-table learning rate: {settings['value_lr_multiplier']:g}x the base rate at the start, {shape}."


def _training_section(config: PreTrainedConfig, folder: Path) -> str | None:
    lines = []
    state = trainer_state(folder)
    if isinstance(config, UltraMemConfig) and config.memory_layers:
        value_lr = _value_lr_line(state)
        lines += [value_lr] if value_lr else []
        lines.append(
            "- Auxiliary loss on the Tucker cores' non-leading singular values: "
            f"alpha={config.aux_loss_alpha:g}, tau={config.aux_loss_tau:g}."
        )
    if state:
        steps = state.get("global_step")
        if steps:
            lines.append(
                f"- Optimizer steps: {steps:,}"
                + (f" of {state['max_steps']:,}" if state.get("max_steps") else "")
                + "."
            )
        if state.get("train_batch_size"):
            lines.append(f"- Batch size per device: {state['train_batch_size']}.")
        history = state.get("log_history", [])
        learning_rates = [entry["learning_rate"] for entry in history if "learning_rate" in entry]
        if learning_rates:
            lines.append(f"- Peak logged learning rate: {max(learning_rates):.3g}.")
        train_losses = [entry["loss"] for entry in history if "loss" in entry]
        if train_losses:
            lines.append(f"- Last logged training loss: {train_losses[-1]:.4f}.")
    loss = validation_loss(folder)
    if loss is not None:
        lines.append(f"- Validation loss of the checkpoint (its own validation split): {loss:.4f}.")
    return "## Training recipe\n\n" + "\n".join(lines) + "\n" if lines else None


@dataclass(frozen=True)
class CardTask:
    """What the card says a checkpoint of one head does: its description, Hub pipeline tag, Auto class and usage."""

    description: str
    pipeline_tag: str
    auto_class: str
    example: str  # Python lines after `tokenizer` and `model` are loaded


CAUSAL_LM = CardTask(
    "causal language model",
    "text-generation",
    "AutoModelForCausalLM",
    """inputs = tokenizer("The capital of France is", return_tensors="pt")
print(tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0]))""",
)
CARD_TASKS = {  # by the suffix of config.architectures[0], as Transformers names its heads
    "ForCausalLM": CAUSAL_LM,
    "ForSequenceClassification": CardTask(
        "sequence classification model",
        "text-classification",
        "AutoModelForSequenceClassification",
        """logits = model(**tokenizer("The whale was never seen again.", return_tensors="pt")).logits  # (1, labels)
print(model.config.id2label[logits.argmax(-1).item()])""",
    ),
    "ForTokenClassification": CardTask(
        "token classification model",
        "token-classification",
        "AutoModelForTokenClassification",
        """logits = model(**tokenizer("Ishmael sailed from Nantucket.", return_tensors="pt")).logits  # (1, tokens, labels)
print([model.config.id2label[label] for label in logits.argmax(-1)[0].tolist()])""",
    ),
    "ForQuestionAnswering": CardTask(
        "extractive question answering model",
        "question-answering",
        "AutoModelForQuestionAnswering",
        """inputs = tokenizer("Who sailed?", "Ishmael sailed from Nantucket.", return_tensors="pt")
outputs = model(**inputs)
start, end = outputs.start_logits.argmax(-1).item(), outputs.end_logits.argmax(-1).item()
print(tokenizer.decode(inputs.input_ids[0, start : end + 1]))""",
    ),
}


def card_task(config: PreTrainedConfig) -> CardTask:
    """The head of the checkpoint (`config.architectures`); a causal LM when none is recorded."""
    architecture = (getattr(config, "architectures", None) or [""])[0]
    return next((task for suffix, task in CARD_TASKS.items() if architecture.endswith(suffix)), CAUSAL_LM)


def _usage_section(repo_id: str, task: CardTask, config: PreTrainedConfig) -> str:
    table_format = getattr(config, "memory_quantization", None)
    if table_format:  # the shipped code hands the uint8 tables to the installed package's quantized stores
        needs = (
            f". The value tables are stored as {table_format} (see Memory layers), which the shipped code reads with "
            "the `ultramem` package: install it (`pip install ultramem`), no import needed. They load as they are, "
            'with no keyword; `memory_offload="cpu"` keeps them in host memory, `memory_offload="disk"` maps them '
            "from the file"
        )
    else:
        needs = "; the `ultramem` package need not be installed"
    return f"""## Usage

`trust_remote_code=True` loads the model code shipped next to the weights (`auto_map` in config.json){needs}:

```python
from transformers import {task.auto_class}, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{repo_id}", trust_remote_code=True)
model = {task.auto_class}.from_pretrained("{repo_id}", trust_remote_code=True)
{task.example}
```
"""


def _eval_section(result: ModelResult, settings: Mapping[str, Any]) -> str:
    return (
        "## Evaluation\n\nlm-eval-harness, task group `ultramem_paper` (the paper's ten benchmarks and shot settings), "
        "scores in percent:\n\n" + markdown_table([result], run_notes(settings))
    )


def _eval_results(result: ModelResult, settings: Mapping[str, Any]) -> list[EvalResult]:
    """The model-index entries; a score of a limited run says so in its name, as the Hub shows no notes."""
    shots = {name: entry.get("num_fewshot") for name, entry in group_entries().items()}
    limit = f", --limit {settings['limit']:g}" if settings.get("limit") is not None else ""
    return [
        EvalResult(
            task_type="text-generation",
            dataset_type=b.dataset,
            dataset_name=b.title,
            metric_type=b.metric.split(",")[0],
            metric_value=round(result.scores[b.key], 2),
            metric_name=f"{b.title} ({shots[b.task]}-shot{limit})",
            source_name="lm-evaluation-harness (ultramem_paper)",
            source_url=LM_EVAL,
        )
        for b in BENCHMARKS
        if b.key in result.scores
    ]


def render_card(
    checkpoint: str | Path,
    repo_id: str,
    result: ModelResult | None = None,
    settings: Mapping[str, Any] | None = None,
    datasets: Sequence[str] = (),
    base_model: str | None = None,
    license: str = "apache-2.0",
) -> str:
    """README.md text for `checkpoint` published as `repo_id`; `result` adds the scores and the model-index.

    `settings` are those of the `ultramem-eval` run that scored `result` (its results JSON): the card states the
    data source and any `--limit` or `--max-gen-toks`, never a local path.
    """
    settings = settings or {}
    folder = require_ultramem(require_checkpoint(checkpoint, option="checkpoint"))
    config = load_config(folder, option="checkpoint")
    name = repo_id.split("/")[-1]
    scored = result is not None and bool(result.scores)
    task = card_task(config)
    data = ModelCardData(
        license=license,
        library_name="transformers",
        pipeline_tag=task.pipeline_tag,
        tags=["ultramem", "memory-layer", config.model_type]
        + (["custom_code"] if getattr(config, "auto_map", None) else []),
        datasets=list(datasets) or None,
        base_model=base_model,
        model_name=name if scored else None,
        eval_results=_eval_results(result, settings) if scored else None,
    )
    sections = [
        f"# {name}\n\n{name} is a {task.description} ({_kind(config)}{_tables_note(config)}) built with "
        f"`ultramem`, the reference implementation of [Ultra-Sparse Memory Network]({PAPER}) (ICLR 2025) for "
        "Transformers.\n",
        _size_section(config),
        _memory_section(config),
        _training_section(config, folder),
        _usage_section(repo_id, task, config),
        _eval_section(replace(result, name=name), settings) if scored else None,
        f"## Citation\n\n```bibtex\n{CITATION}\n```\n",
    ]
    body = "\n".join(section for section in sections if section)
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}"))


def write_card(checkpoint: str | Path, repo_id: str, **kwargs: Any) -> Path:
    """Write the card as `README.md` into the checkpoint folder (see `render_card` for the arguments)."""
    path = Path(checkpoint) / "README.md"
    path.write_text(render_card(checkpoint, repo_id, **kwargs), encoding="utf-8")
    return path
