"""GPU checks: the Triton kernels and the model's Triton path against the PyTorch reference on a CUDA device.

Every test here carries the `gpu` marker and is skipped without CUDA, so the CPU suite (and CI) skips them.
`ULTRAMEM_GPU_SMOKE=1` runs them on CPU at small shapes with the kernels in Triton's interpreter (the campaign's
smoke run). `ULTRAMEM_GPU_REPORT=<path>` appends every comparison to that JSON as it is made (`rows`), keeping what
the file already holds (benchmarks/check_gpu.py writes the environment there first).
"""

import json
import os
from pathlib import Path

import pytest
import torch

SMOKE = os.environ.get("ULTRAMEM_GPU_SMOKE") == "1"
REPORT = os.environ.get("ULTRAMEM_GPU_REPORT")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one; ULTRAMEM_GPU_SMOKE=1 runs it on "
                            "CPU in Triton's interpreter)")  # fmt: skip


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() or SMOKE:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (ULTRAMEM_GPU_SMOKE=1: on CPU in Triton's interpreter)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cpu" if SMOKE and not torch.cuda.is_available() else "cuda")


@pytest.fixture
def check(request):
    """check(name, error, tolerance, **detail): record one comparison (to the report, if any) and assert it."""

    def record(name: str, error: float, tolerance: float, **detail) -> None:
        row = {"test": request.node.name, "check": name, "error": error, "tolerance": tolerance,
               "passed": bool(error <= tolerance), **detail}  # fmt: skip
        if REPORT:
            path = Path(REPORT)
            report = json.loads(path.read_text()) if path.is_file() else {}
            report.setdefault("rows", []).append(row)
            path.write_text(json.dumps(report, indent=1, default=str) + "\n")
        assert row["passed"], f"{name}: error {error:.3e} > tolerance {tolerance:.0e} ({detail})"

    return record
