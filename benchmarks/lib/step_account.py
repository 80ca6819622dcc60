"""Where a decode step's time goes, read from the profiler's trace of a few steps (issue 34, item 1).

Each step is split, on the device's timeline, into kernel time (the union of kernel intervals), copies and memsets
(their union outside kernels) and gaps (nothing running on the device: before its first activity, between
activities, after its last), which sum to the step: from the start of the launching call to the later of its
return and the end of its last device activity. Beside that timeline, the host time of the launching call and the
part of it spent in CUDA runtime calls (launches, copies). The split is per step of the trace, then its median.

Attribution to memory layers comes from `annotate` ranges around their forward calls: a kernel belongs to the
range (on the launching thread) holding the runtime call that launched it. What survives depends on the mode:

- eager (CPU or CUDA): every kernel is launched from inside its op, so memory-layer kernels, their device time and
  their host time (the range's duration) are attributed; the rest is the rest of the model.
- compiled, CUDA-graph replay (`torch.compile(mode="reduce-overhead")`): the ranges are no-ops inside compiled code
  (Dynamo drops `record_function`) and the replayed kernels are launched by one `cudaGraphLaunch`, so they are
  counted as "graph replay" without a layer; kernels launched outside the graph (copies into its static inputs,
  eager work around it such as refreshing UltraMem's inference cache) stay "rest", and `outside_graph` names them.
  Per-layer shares of a replay are therefore not measured here: profile the eager step for those.
- device work whose launching call is missing from the trace (no correlation id) goes to the step it runs in,
  as "unlinked".

On CPU there are no device events: the top-level CPU operators (not called from another operator) stand in for
kernels, so "gaps" are the host time between operators (Python, dispatch), which is how this module is tested.
That reading holds for eager steps only: a compiled CPU step's generated C++ kernels have no profiler ranges, so
its "kernels" are the wrapper ranges around the compiled call (nearly the whole step), not its kernels.
The profiler's own per-operator overhead inflates eager gaps; a graph replay has few host operators to inflate.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .timing import synchronize

STEP_RANGE = "account step"  # the record_function range around each profiled call
MEMORY_PREFIX = "memory "  # prefix of the ranges `annotate` puts around memory layers
GRAPH_REPLAY = "graph replay"
REST = "rest"
UNLINKED = "unlinked"  # device work whose launching call the trace does not name
HOST_CATEGORIES = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"}
KERNEL_CATEGORIES = {"kernel"}
COPY_CATEGORIES = {"gpu_memcpy", "gpu_memset"}
RUNTIME_CATEGORIES = {"cuda_runtime", "cuda_driver"}
SYNC_CALLS = ("Synchronize", "EventQuery", "StreamWait")  # runtime calls that wait rather than launch


@dataclass(frozen=True)
class Span:
    """One complete ("X") event of a chrome trace, times in microseconds."""

    name: str
    cat: str
    start: float
    end: float
    tid: Any = 0
    correlation: int | None = None

    @property
    def dur(self) -> float:
        return self.end - self.start

    def holds(self, time: float) -> bool:
        return self.start <= time <= self.end


def spans(trace: Iterable[dict[str, Any]]) -> list[Span]:
    """The complete events of a chrome trace's `traceEvents` (metadata, instants and flows dropped)."""
    out = []
    for event in trace:
        if event.get("ph") != "X" or "dur" not in event:
            continue
        correlation = (event.get("args") or {}).get("correlation")
        out.append(Span(event["name"], event.get("cat", ""), float(event["ts"]), float(event["ts"]) + float(event["dur"]),
                        event.get("tid", 0), correlation))  # fmt: skip
    return out


def merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals as disjoint sorted intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(start, end) for start, end in out]


def covered(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of intervals."""
    return sum(end - start for start, end in merged(intervals))


def top_level(ops: list[Span]) -> list[Span]:
    """The operators not called from inside another operator of the same thread."""
    out: list[Span] = []
    ends: dict[Any, float] = {}
    for op in sorted(ops, key=lambda s: (s.start, -s.end)):
        if op.start >= ends.get(op.tid, float("-inf")):  # else it runs inside the last top-level operator
            out.append(op)
            ends[op.tid] = op.end
    return out


def account_trace(trace: Iterable[dict[str, Any]], memory_prefix: str = MEMORY_PREFIX) -> list[dict[str, Any]]:
    """The split of every `STEP_RANGE` step in a chrome trace's events (milliseconds), in order; see the module."""
    events = spans(trace)
    steps = sorted((s for s in events if s.cat == "user_annotation" and s.name == STEP_RANGE), key=lambda s: s.start)
    host = [s for s in events if s.cat in HOST_CATEGORIES]
    runtime = {s.correlation: s for s in host if s.cat in RUNTIME_CATEGORIES and s.correlation is not None}
    device = [s for s in events if s.cat in KERNEL_CATEGORIES | COPY_CATEGORIES]
    on_host = not device  # a CPU trace: its top-level operators stand in for kernels
    if on_host:
        device = top_level([s for s in events if s.cat == "cpu_op"])
    # (device event, the host span that launched it): the runtime call of the same correlation id, or itself
    launched = [(d, d if on_host else runtime.get(d.correlation)) for d in device]
    memory_ranges = [s for s in host if s.cat == "user_annotation" and s.name.startswith(memory_prefix)]
    splits = []
    for index, step in enumerate(steps):  # a device event belongs to the step whose call launched it
        in_step = [(d, by) for d, by in launched if by is not None and step.holds(by.start)]
        # one whose launch is not in the trace (no correlation id): to the step it runs in, marked unlinked
        following = steps[index + 1].start if index + 1 < len(steps) else float("inf")
        unlinked = [d for d, by in launched if by is None and step.start <= d.start < following]
        in_step += [(d, Span(UNLINKED, UNLINKED, d.start, d.start, tid=None)) for d in unlinked]
        host_in_step = [s for s in host if step.holds(s.start)]
        splits.append(_account_step(step, in_step, host_in_step, memory_ranges, memory_prefix, on_host))
    return splits


def _label(launcher: Span, memory_ranges: list[Span], memory_prefix: str) -> str:
    """The memory layer whose range holds `launcher` on its thread, else graph replay, unlinked or the rest."""
    if launcher.cat == UNLINKED:
        return UNLINKED
    for memory in memory_ranges:
        if memory.tid == launcher.tid and memory.holds(launcher.start):
            return memory.name[len(memory_prefix) :]
    return GRAPH_REPLAY if "GraphLaunch" in launcher.name else REST


def _account_step(step: Span, launched: list[tuple[Span, Span]], host: list[Span], memory_ranges: list[Span],
                  memory_prefix: str, on_host: bool) -> dict[str, Any]:  # fmt: skip
    ms = 1e-3
    window = (step.start, max([step.end] + [d.end for d, _ in launched]))
    clip = [(d, (max(d.start, window[0]), min(d.end, window[1]))) for d, _ in launched]
    kernels = [iv for d, iv in clip if on_host or d.cat in KERNEL_CATEGORIES]
    copies = [iv for d, iv in clip if not on_host and d.cat in COPY_CATEGORIES]
    busy = merged(kernels + copies)
    kernel_us = covered(kernels)
    step_us = window[1] - window[0]
    before = busy[0][0] - window[0] if busy else step_us
    after = window[1] - busy[-1][1] if busy else 0.0
    busy_us = sum(end - start for start, end in busy)
    runtime = [s for s in host if s.cat in RUNTIME_CATEGORIES]
    waits = [(s.start, s.end) for s in runtime if any(call in s.name for call in SYNC_CALLS)]
    parts: dict[str, dict[str, float]] = {}
    for d, launcher in launched:
        part = parts.setdefault(_label(launcher, memory_ranges, memory_prefix), {"device_ms": 0.0, "launches": 0})
        part["device_ms"] += d.dur * ms
        part["launches"] += 1
    memory_host = [m for m in memory_ranges if step.holds(m.start)]
    for memory in memory_host:
        part = parts.setdefault(memory.name[len(memory_prefix) :], {"device_ms": 0.0, "launches": 0})
        part["host_ms"] = part.get("host_ms", 0.0) + memory.dur * ms
    outside: dict[str, float] = {}  # device work launched outside a graph replay, by name
    for d, launcher in launched:
        if not on_host and "GraphLaunch" not in launcher.name:
            outside[d.name[:120]] = outside.get(d.name[:120], 0.0) + d.dur * ms
    return {
        "step_ms": step_us * ms,
        "kernel_ms": kernel_us * ms,
        "copy_ms": (busy_us - kernel_us) * ms,
        "gap_ms": (step_us - busy_us) * ms,
        "gap_before_ms": before * ms,
        "gap_between_ms": (step_us - busy_us - before - after) * ms,
        "gap_after_ms": after * ms,
        "host_ms": step.dur * ms,
        "host_runtime_ms": covered((s.start, s.end) for s in runtime) * ms,
        "host_wait_ms": covered(waits) * ms,
        "memory_host_ms": covered((m.start, m.end) for m in memory_host) * ms,
        "kernels": len(kernels),
        "copies": len(copies),
        "graph_launches": sum(1 for s in runtime if "GraphLaunch" in s.name),
        "parts": parts,
        "outside_graph": dict(sorted(outside.items(), key=lambda item: -item[1])[:10]),
    }


def median_split(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The split of the median step by step time (a whole step, so that its parts still sum to it), with the
    memory layers' device time summed and every step's time."""
    if not steps:
        raise ValueError(f"no '{STEP_RANGE}' range in the trace")
    median = sorted(steps, key=lambda step: step["step_ms"])[(len(steps) - 1) // 2]
    memory = [p["device_ms"] for label, p in median["parts"].items() if label not in (REST, GRAPH_REPLAY, UNLINKED)]
    return {**median, "memory_device_ms": sum(memory), "steps_ms": [step["step_ms"] for step in steps]}


@contextmanager
def annotate(modules: Mapping[str, torch.nn.Module], prefix: str = MEMORY_PREFIX) -> Iterator[None]:
    """A profiler range `prefix + name` around every forward call of each module (eager only: see the module)."""
    open_ranges: dict[str, list[Any]] = {}
    handles = []
    for name, module in modules.items():

        def enter(_module, _args, name=name):
            open_ranges.setdefault(name, []).append(torch.profiler.record_function(prefix + name).__enter__())

        def leave(_module, _args, _output, name=name):
            open_ranges[name].pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def memory_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """An UltraMem model's memory layers by module name; empty for models without them."""
    named = getattr(model, "named_memory_layers", None)
    return dict(named()) if named is not None else {}


def profile_steps(fn: Callable[[], Any], device: torch.device, steps: int,
                  modules: Mapping[str, torch.nn.Module] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The chrome-trace events of `steps` calls of `fn`, each in a `STEP_RANGE` range and followed by a device
    synchronize (outside the range: the launching call's host time is the range, its device tail comes after).
    With `modules`, their forward calls are `annotate`d."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with annotate(modules or {}), profile(activities=activities) as prof:
        for _ in range(steps):
            with torch.profiler.record_function(STEP_RANGE):
                fn()
            synchronize(device)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


def account_call(fn: Callable[[], Any], device: torch.device, steps: int,
                 modules: Mapping[str, torch.nn.Module] | None = None) -> dict[str, Any]:  # fmt: skip
    """`median_split` of `steps` profiled calls of `fn` (after one unprofiled call)."""
    fn()
    synchronize(device)
    return median_split(account_trace(profile_steps(fn, device, steps, modules)))


SPLIT_COLUMNS = ("step_ms", "kernel_ms", "copy_ms", "gap_ms", "gap_before_ms", "gap_between_ms", "gap_after_ms",
                 "host_ms", "host_runtime_ms", "memory_device_ms", "memory_host_ms")  # fmt: skip


def difference(minuend: dict[str, Any], subtrahend: dict[str, Any]) -> dict[str, float]:
    """Part by part, `minuend` minus `subtrahend` (e.g. UltraMem minus dense: where the extra step time goes)."""
    return {key: minuend[key] - subtrahend[key] for key in SPLIT_COLUMNS}
