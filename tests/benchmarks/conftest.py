"""The benchmark tests import the scripts of benchmarks/ as modules: that folder goes on `sys.path` for them, as it is
when a script runs (each imports its library, benchmarks/lib, as `lib`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
