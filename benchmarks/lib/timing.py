"""The one timer of the benchmarks, and the device bookkeeping around it (synchronize, peak memory, launches)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

STATISTICS = ("median", "min", "cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(
    fn: Callable[[], Any],
    device: torch.device,
    warmup: int,
    iters: int,
    before_each: Callable[[], Any] | None = None,
    after_each: Callable[[], Any] | None = None,
) -> tuple[list[float], list[float]]:
    """Wall-clock and process-CPU milliseconds of `iters` calls of `fn` after `warmup` calls, each call bracketed by
    device synchronization; `before_each` / `after_each` run untimed around every timed call (an L2 flush, an I/O
    counter read)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    wall, cpu = [], []
    for _ in range(iters):
        if before_each is not None:
            before_each()
            synchronize(device)
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        synchronize(device)
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
        if after_each is not None:
            after_each()
    return wall, cpu


def summarize(wall: list[float], cpu: list[float], statistic: str = "median") -> dict[str, float]:
    """Wall-clock median, min and max, median process CPU time, and `ms`: the one chosen by `statistic`.

    On a CPU shared with other jobs the wall clock also counts the time this process waits for a core; its own
    CPU time does not (with one thread it is the single-core cost of the call).
    """
    summary = {"median_ms": statistics.median(wall), "min_ms": min(wall), "max_ms": max(wall),
               "cpu_ms": statistics.median(cpu)}  # fmt: skip
    return {"ms": summary[f"{statistic}_ms"], **summary}


def measure(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int, statistic: str = "median",
            **hooks: Callable[[], Any]) -> dict[str, float]:  # fmt: skip
    """Milliseconds of `fn` per call (`summarize` of `time_calls`)."""
    return summarize(*time_calls(fn, device, warmup, iters, **hooks), statistic)


def measure_interleaved(fns: dict[str, Callable[[], Any]], device: torch.device, warmup: int, iters: int,
                        statistic: str = "median") -> dict[str, dict[str, float]]:  # fmt: skip
    """`measure` of several calls timed in turn (one call of each per round), for ratios between them.

    On a machine whose speed drifts (other jobs, frequency, a neighbour's use of the shared cache) timing one
    model after the other puts the drift into their ratio; interleaving exposes both to the same conditions.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            wall, cpu = time_calls(fn, device, 0, 1)
            times[name][0].extend(wall)
            times[name][1].extend(cpu)
    return {name: summarize(wall, cpu, statistic) for name, (wall, cpu) in times.items()}


def flushed_ms(
    fn: Callable[[], Any], device: torch.device, warmup: int, iters: int, statistic: str = "median"
) -> float:
    """Milliseconds of one call of `fn` (`statistic` of `time_calls`); on CUDA the L2 cache is flushed before each
    call, so a kernel's bandwidth is measured from device memory."""
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.float32, device=device) if device.type == "cuda" else None
    wall, cpu = time_calls(fn, device, warmup, iters, before_each=None if flush is None else flush.zero_)
    return summarize(wall, cpu, statistic)["ms"]


def copy_bandwidth_gbps(device: torch.device, num_bytes: int, iters: int) -> float:
    """Measured device-to-device copy (median wall time): bytes read plus bytes written per second."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    return 2 * num_bytes / flushed_ms(lambda: target.copy_(source), device, 1, iters) / 1e6


def count_launches(fn: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """Operators one call of `fn` dispatches: top-level aten ops, and on CUDA the kernels and graph replays, with
    the kernels' summed device time and the most expensive of them (`kernel_table`).

    Top-level aten ops (those not called from inside another aten op) are what eager mode pays host overhead
    for; a CUDA graph replay launches its kernels without host work, counted as one graph launch. The kernels'
    summed time against the step's wall time says how much of a step is gaps between dependent kernels.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    events = prof.events()
    top_level = (e for e in events if e.name.startswith("aten::"))
    counts = {
        "aten_ops": sum(1 for e in top_level if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    }
    if device.type == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        counts["cuda_kernels"] = len(kernels)
        counts["cuda_graph_launches"] = sum(1 for e in events if e.name == "cudaGraphLaunch")
        counts.update(kernel_table(kernels))
    return counts


def kernel_table(events: list[Any], top: int = 15) -> dict[str, Any]:
    """Profiler events' summed time (us), and the `top` names by total time: calls, total and mean us each."""
    by_name: dict[str, list[float]] = {}
    for event in events:
        by_name.setdefault(event.name[:120], []).append(event.time_range.elapsed_us())
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    return {
        "kernel_us": round(sum(sum(times) for times in by_name.values()), 1),
        "kernel_table": [
            {
                "name": name,
                "calls": len(times),
                "total_us": round(sum(times), 1),
                "mean_us": round(sum(times) / len(times), 2),
            }
            for name, times in ranked
        ],
    }


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> float | None:
    """Peak allocated device memory since `reset_peak_memory` (CUDA only; the CPU allocator keeps no such count)."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def release(device: torch.device) -> None:
    """Give freed blocks back between models, so the next model's peak is its own. Compiled graphs (and their CUDA
    graphs) keep the model's weights and the cache alive: they are dropped first."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
