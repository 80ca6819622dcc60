"""Names that moved out of `modeling_ultramem` in 0.2, still found there for one release of grace: its module
`__getattr__` returns them from their new module with a FutureWarning.

This file is copied beside `modeling_ultramem.py` into checkpoints (remote code), so it imports only relatively.
"""

import importlib
import warnings

# name -> the module of this package it moved to
MOVED = {
    "VALUE_STORES": "value_stores",
    "deferred_value_tables": "value_stores",
    "offloaded_by_accelerate": "value_stores",
    "TORCH_MEMORY_OPS": "memory_implementations",
    "EMBEDDING_BAG_MEMORY_OPS": "memory_implementations",
    "svd_2x2": "memory_ops",
}


def moved_attribute(module_name: str, name: str):
    """`module_name`'s `__getattr__` (with `functools.partial`): a moved name, AttributeError for any other."""
    if name not in MOVED:
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
    module = MOVED[name]
    warnings.warn(f"{module_name}.{name} moved to ultramem.{module}.{name}", FutureWarning, stacklevel=2)
    return getattr(importlib.import_module(f".{module}", __package__), name)
