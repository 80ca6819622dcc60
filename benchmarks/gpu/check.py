"""Correctness on a real GPU, as one command: the `gpu` test suite (tests/gpu) with its comparisons written to JSON.

    python benchmarks/gpu/check.py                       # writes results/check_gpu_<gpu>.json; exit 1 if a check fails
    TRITON_INTERPRET=1 python benchmarks/gpu/check.py --smoke   # the same on CPU, small shapes

The checks themselves are tests (`python -m pytest tests/gpu`, skipped without CUDA); this entry adds the
environment and one file the campaign keeps. Every comparison is written the moment it is made.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for `lib`

from lib import env, report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results-dir", type=env.Path, default=env.RESULTS_DIR)
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, small shapes")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (e.g. -k lookup)")
    args = parser.parse_args(argv)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        os.environ["ULTRAMEM_GPU_SMOKE"] = "1"
    elif not torch.cuda.is_available():
        raise SystemExit("check.py needs a CUDA device (on CPU: --smoke, or the interpreter tests of the suite)")
    device = torch.device("cpu" if args.smoke else "cuda")
    path = args.results_dir / f"check_gpu_{env.device_tag(device)}.json"
    report.write_json(path, {"environment": env.environment(device), "rows": []})
    os.environ["ULTRAMEM_GPU_REPORT"] = str(path)
    status = pytest.main(["-q", "-p", "no:cacheprovider", "-rfE", str(env.REPO / "tests" / "gpu"), *args.pytest_args])
    print(f"wrote {path}")
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
