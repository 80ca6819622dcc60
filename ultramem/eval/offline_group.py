"""`ultramem_paper_offline` on the plain `lm_eval` command line: scores the benchmarks whose local copies are present
and names the missing ones in one line, instead of aborting.

lm-eval 0.4.13 builds a group whole (one member whose dataset fails to load aborts the run), a task cannot be built
on zero documents, and a group's member list is fixed in its YAML. So the group's YAML takes its `custom_dataset`
from this module, and importing it (lm-eval resolves that `!function` before building the members) makes
`TaskFactory` build the members of `ultramem_paper` one at a time, leaving out those whose local files are missing.
Other groups, and the online `ultramem_paper` (which never raises `LocalDataMissing`), are built as before.

Importing it also keeps lm-eval's hint "Custom kwargs can be passed to `--metadata`" out of the log for the tasks
that read local copies: lm-eval logs it for every task with a `custom_dataset`, which here is every member task (101
lines for the group), and `load_local` names `--metadata` itself when the folder is not given. The one-benchmark
offline YAMLs take `load_local` from this module too, so they get the same.

It also checks, when lm-eval starts evaluating, that the model's context leaves room for every generation
task's token budget (after any `--gen_kwargs`): lm-eval asserts it only at the first generation request, after the
log-likelihood tasks ran for minutes, and the whole run is lost (BBH CoT allows 1024 new tokens). A budget that does
not fit is one line, before any request runs, naming the task and the `--gen_kwargs max_gen_toks=N` that fits; so
is a missing local copy (a data folder or file that is not there).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import lm_eval.evaluator
from lm_eval.api.task import ConfigurableTask
from lm_eval.tasks._factory import TaskFactory

from ultramem.eval.benchmarks import GROUP
from ultramem.eval.local_data import LocalDataMissing, load_local

_build_group_members = TaskFactory._build_group_members


def _member_name(item: str | dict[str, Any]) -> str:
    return item if isinstance(item, str) else item.get("task") or item["group"]


def _build_present_members(
    factory: TaskFactory, member_list: list, group_name: str, overrides: dict[str, Any] | None, registry: dict
) -> list:
    """`TaskFactory._build_group_members`; for `ultramem_paper`, member by member, without those missing data."""
    if group_name != GROUP:
        return _build_group_members(factory, member_list, group_name, overrides, registry)
    children, missing = [], []
    for item in member_list:
        try:
            children += _build_group_members(factory, [item], group_name, overrides, registry)
        except LocalDataMissing as error:
            missing.append(f"{_member_name(item)} ({error})")
    if missing:
        line = f"{GROUP}_offline: not scored, local files missing: {'; '.join(missing)}"
        if not children:
            raise LocalDataMissing(line)
        print(line, file=sys.stderr)
    return children


TaskFactory._build_group_members = _build_present_members


METADATA_HINT = "Custom kwargs can be passed to `--metadata`"
_download = ConfigurableTask.download
_task_logger = logging.getLogger(ConfigurableTask.__module__)


class _WithoutMetadataHint(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return METADATA_HINT not in record.getMessage()


def _download_local_copies_quietly(task: ConfigurableTask, *args: Any, **kwargs: Any) -> None:
    """`ConfigurableTask.download`; for a task that `load_local` reads, without the `--metadata` hint."""
    if task.config.custom_dataset is not load_local:
        return _download(task, *args, **kwargs)
    hint_filter = _WithoutMetadataHint()
    _task_logger.addFilter(hint_filter)
    try:
        return _download(task, *args, **kwargs)
    finally:
        _task_logger.removeFilter(hint_filter)


ConfigurableTask.download = _download_local_copies_quietly


class GenerationBudgetError(ValueError):
    """A generation task may generate as many tokens as the model's context holds, or more."""


def generation_budget_problem(lm: Any, task_dict: Any) -> str | None:
    """Why lm-eval's HF model would stop at a generation task of `task_dict`, or None (also for models without a
    known context). The largest budget of the generation tasks (their `max_gen_toks`, lm's default where unset) must
    be below the model's maximum length, as `HFLM.generate_until` asserts."""
    from lm_eval.models.utils import normalize_gen_kwargs

    try:
        context, default = int(lm.max_length), int(lm.max_gen_toks)
    except (AttributeError, TypeError, ValueError, NotImplementedError):
        return None
    tasks = task_dict.get("tasks", {}) if isinstance(task_dict, dict) else {}
    budgets = [
        (normalize_gen_kwargs(dict(task.config.generation_kwargs or {}), default)["max_gen_toks"], name)
        for name, task in tasks.items()
        if getattr(task, "OUTPUT_TYPE", None) == "generate_until"
    ]
    if not budgets or max(budgets)[0] < context:
        return None
    budget, name = max(budgets)
    return (
        f"{name} may generate {budget} tokens and the model's context is {context} (max_position_embeddings): "
        f"lm-eval would stop there after the other tasks ran; pass --gen_kwargs max_gen_toks=N with N < {context} "
        "(scores then differ from full-budget ones), or evaluate a model with a longer context"
    )


def _launched_by_lm_eval_cli() -> bool:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return (spec is not None and spec.name.startswith("lm_eval")) or sys.argv[0].endswith(("lm_eval", "lm-eval"))


_evaluate = lm_eval.evaluator.evaluate


def _evaluate_if_generation_fits(lm: Any, task_dict: Any, *args: Any, **kwargs: Any) -> Any:
    """`lm_eval.evaluator.evaluate`, refused up front when a generation budget does not fit the model's context."""
    problem = generation_budget_problem(lm, task_dict)
    if problem and _launched_by_lm_eval_cli():
        raise SystemExit(f"lm_eval: error: {problem}")  # one line on the command line, nothing was computed
    if problem:
        raise GenerationBudgetError(problem)
    return _evaluate(lm, task_dict, *args, **kwargs)


lm_eval.evaluator.evaluate = _evaluate_if_generation_fits


def _one_line_when_data_is_missing(hook: Any) -> Any:
    """`sys.excepthook` of the lm_eval command line: a local copy that is not there ends the run with one line naming
    the path and the option, not lm-eval's traceback through its task building (the data is missing, not the code)."""

    def excepthook(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
        if not issubclass(kind, LocalDataMissing):
            return hook(kind, error, traceback)
        print(
            f"lm_eval: error: {error} (--metadata '{{\"data_dir\": DIR}}' names the folder of the benchmarks' local "
            "copies, laid out as ultramem/eval/local_data.py says; tests/eval/fixtures/eval in a clone)",
            file=sys.stderr,
        )

    return excepthook


if _launched_by_lm_eval_cli():
    sys.excepthook = _one_line_when_data_is_missing(sys.excepthook)

__all__ = ["load_local"]
