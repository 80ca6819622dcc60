"""The installed package's registry behind a remote-code copy's.

A checkpoint's own code (`trust_remote_code=True`) is a copy of this package's modules under another name: its
registries (`GeneralInterface`s) are other objects than the package's, and only the package's hold what `import
ultramem` registers (the Triton kernels, the offloaded stores, the quantized formats). A look-up tries its own
registry, then the package's.

This file is copied beside `modeling_ultramem.py` into checkpoints (remote code), so it imports only the standard
library and Transformers.
"""

from __future__ import annotations

import importlib

from transformers.utils.generic import GeneralInterface


def package_registry(registry: GeneralInterface) -> GeneralInterface | None:
    """The installed `ultramem` package's registry of `registry`'s kind (defined in the package module of the same
    name as `registry`'s): `registry` itself when it is the package's, the package's twin when it belongs to a
    remote-code copy, None without the package."""
    try:
        package = importlib.import_module(f"ultramem.{type(registry).__module__.rpartition('.')[2]}")
    except ImportError:
        return None
    twin = getattr(package, type(registry).__name__)
    return registry if twin is type(registry) else twin()
