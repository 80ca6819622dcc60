"""Functions the task YAMLs here name with `!function` (lm-eval imports this file by path)."""

from ultramem.eval.local_data import load_local

__all__ = ["load_local"]
