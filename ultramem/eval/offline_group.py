"""`ultramem_paper_offline` on the plain `lm_eval` command line: scores the benchmarks whose local copies are present
and names the missing ones in one line, instead of aborting.

lm-eval 0.4.13 builds a group whole (one member whose dataset fails to load aborts the run), a task cannot be built
on zero documents, and a group's member list is fixed in its YAML. So the group's YAML takes its `custom_dataset`
from this module, and importing it (lm-eval resolves that `!function` before building the members) makes
`TaskFactory` build the members of `ultramem_paper` one at a time, leaving out those whose local files are missing.
Other groups, and the online `ultramem_paper` (which never raises `LocalDataMissing`), are built as before.
"""

from __future__ import annotations

import sys
from typing import Any

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

__all__ = ["load_local"]
