"""Scoring UltraMem checkpoints with lm-eval-harness on the paper's ten benchmarks, online or from local copies."""

from __future__ import annotations

from importlib import resources


def tasks_path() -> str:
    """Folder of the package's lm-eval task YAMLs, for `lm_eval --include_path`."""
    return str(resources.files("ultramem.eval") / "tasks")


__all__ = ["tasks_path"]
