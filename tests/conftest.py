"""Shared test setup: offline Hub, few threads, a compiled-graph cache per CPU dispatch level, and the `config` fixture
(the small config with every feature on; the helpers the tests share are in model_support.py)."""

import getpass
import os
import tempfile

import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter; set before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Inductor's compiled-graph cache is not keyed on the CPU vector width (torch 2.13): a graph generated for AVX-512 and
# reloaded under ATEN_CPU_CAPABILITY=avx2 stores 8 of every 16 lanes (garbage indices), the reverse overruns its
# buffers. Each dispatch level the suite runs under gets a cache folder of its own (inherited by launched processes).
if capability := os.environ.get("ATEN_CPU_CAPABILITY"):
    default_cache = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache
    if os.path.basename(cache) != f"capability-{capability}":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, f"capability-{capability}")

import pytest  # noqa: E402
from model_support import small_config  # noqa: E402

from ultramem import UltraMemConfig  # noqa: E402

# Two threads, shared between pytest-xdist's workers (`-n auto`: one per core) rather than oversubscribing the cores
torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture
def config() -> UltraMemConfig:
    return small_config()
