"""Where a number was measured and how to reproduce it: one capture for every benchmark's JSON."""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

BENCHMARKS = Path(__file__).resolve().parents[1]
REPO = BENCHMARKS.parent
RESULTS_DIR = BENCHMARKS / "results"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the processor string elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def device_name(device: torch.device | str) -> str:
    """'NVIDIA H100 80GB HBM3' on CUDA, 'CPU (<model>)' otherwise."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({cpu_model()})"


def device_tag(device: torch.device | str) -> str:
    """Short file-name tag of the device: 'cpu', or the GPU model ('h100', 'h200', ...)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return next((m for m in ("h200", "h100", "a100", "l40s", "a10g") if m in name), name.split()[-1].replace("-", ""))


def folder_name(device: str) -> str:
    """A device name as a folder: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9.]+", "-", device.lower()).strip("-")


def versions() -> dict[str, str]:
    """Python and the packages a result depends on ('not installed' where absent)."""
    import importlib.metadata

    found = {"python": platform.python_version()}
    for package in ("torch", "triton", "transformers", "accelerate", "huggingface_hub", "tokenizers"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    found["torch"] = torch.__version__  # the local build tag (+cpu, +cu130) as well
    return found


def nvidia_smi() -> str:
    """The GPU as nvidia-smi reports it (name, memory, driver, max SM clock), or 'unavailable'."""
    query = "name,memory.total,driver_version,clocks.max.sm"
    try:
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        return smi.stdout.strip() or "unavailable"
    except (OSError, subprocess.TimeoutExpired):
        return "unavailable"


def environment(device: torch.device | str = "cpu", **settings: Any) -> dict[str, Any]:
    """What the numbers were measured on and the command that reproduces them; `settings` (dtype, statistic, ...)
    are added as given. The load average says how contended a shared CPU was."""
    device = torch.device(device)
    info: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "device_type": device.type,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0],
        "platform": platform.platform(),
        **versions(),
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(capability=f"sm_{properties.major}{properties.minor}",
                    memory_gib=round(properties.total_memory / 2**30, 1), nvidia_smi=nvidia_smi())  # fmt: skip
    return {**info, **{k: str(v).replace("torch.", "") for k, v in settings.items()}}
