"""Shared helpers of the speed benchmarks: model building, timing, the analytic memory-access model, output.

Every speed script builds its models here (same dtype, device, cache and execution mode for all of them),
times them with `measure`, and writes `benchmarks/results/<name>.json` (plus a PNG) with the environment
and the exact command, so a result file says how to reproduce itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, StaticCache

from ultramem.presets import get_config
from ultramem.sizing import build_model

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Transformers' expert paths for Mixtral (integrations/moe.py), tried in this order; the fastest is kept.
MOE_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")


def make_parser(description: str, default_name: str, decode: bool = False) -> argparse.ArgumentParser:
    """A script's argument parser with the shared flags (and the decoding flags when `decode`)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, default_name)
    if decode:
        add_decode_arguments(parser)
    return parser


def add_common_arguments(parser: argparse.ArgumentParser, default_name: str) -> None:
    """Flags every speed script shares: device, dtype, timing repeats, output name."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations before timing")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations (summarized by --statistic)")
    parser.add_argument(
        "--name", default=None, help=f"output stem in benchmarks/results (default {default_name}_<device>)"
    )
    parser.add_argument(
        "--statistic",
        choices=("median", "min", "cpu"),
        default=None,
        help="reported time per call: wall-clock median (default on CUDA) or min, or the median process CPU time "
        "(default on CPU: a shared machine's waiting time excluded; run with OMP_NUM_THREADS=1)",
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON and PNG go")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")


def resolve_common(args: argparse.Namespace, default_name: str) -> None:
    """Fill in device-dependent defaults and validate the shared flags (named errors, allowed ranges)."""
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible; use --device cpu")
    args.dtype = DTYPES[args.dtype or ("bfloat16" if args.device.type == "cuda" else "float32")]
    args.statistic = args.statistic or ("median" if args.device.type == "cuda" else "cpu")
    if args.statistic == "cpu" and args.device.type == "cuda":
        raise SystemExit("--statistic cpu measures host CPU time and is meaningless on CUDA; use median or min")
    for flag in ("warmup", "iters"):
        if getattr(args, flag) < (0 if flag == "warmup" else 1):
            raise SystemExit(f"--{flag} must be >= {0 if flag == 'warmup' else 1}, got {getattr(args, flag)}")
    if args.name is None:
        args.name = f"{default_name}_{device_tag(args.device)}"


def parse_int_list(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]; every entry must be a positive integer."""
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def parse_names(text: str, allowed: Iterable[str], flag: str) -> list[str]:
    """'a,b' -> ['a', 'b']; every entry must be one of `allowed` (else exit naming the flag and the choices)."""
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise SystemExit(f"{flag}: unknown {unknown}; allowed: {', '.join(allowed)}")
    return names


def device_tag(device: torch.device) -> str:
    """Short file-name tag of the device: 'cpu', or the GPU model ('h100', 'h200', ...)."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for model in ("h200", "h100", "a100", "l40s", "a10g"):
        if model in name:
            return model
    return name.split()[-1].replace("-", "")


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """What the numbers were measured on, and the command that reproduces them."""
    import transformers

    device = args.device
    return {
        "command": " ".join(["python", *sys.argv]),
        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()})",
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": str(args.dtype).removeprefix("torch."),
        "statistic": args.statistic,
    }


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build(preset: str, device: torch.device, dtype: torch.dtype, **overrides: Any) -> PreTrainedModel:
    """A randomly initialised preset model, created directly on `device` in `dtype` (no host copy of big tables)."""
    config = get_config(preset, **overrides)
    with torch.device(device), default_dtype(dtype):
        return build_model(config)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(
    fn: Callable[[], Any],
    device: torch.device,
    warmup: int,
    iters: int,
    before_each: Callable[[], Any] | None = None,
) -> tuple[list[float], list[float]]:
    """Wall-clock and process-CPU milliseconds of `iters` calls of `fn` after `warmup` calls, each call bracketed by
    device synchronization; `before_each` runs untimed before every timed call (e.g. an L2 flush)."""
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
    return wall, cpu


def measure(
    fn: Callable[[], Any], args: argparse.Namespace, warmup: int | None = None, iters: int | None = None
) -> dict[str, float]:
    """Milliseconds of `fn` per call, each call bracketed by device synchronization.

    Returns wall-clock median, min and max, the median process CPU time (`cpu_ms`), and `ms`: the statistic
    chosen by `--statistic`. On a CPU shared with other jobs the wall clock also counts the time this process
    waits for a core; its own CPU time does not (with one thread it is the single-core cost of the call).
    """
    warmup = args.warmup if warmup is None else warmup
    return summarize(*time_calls(fn, args.device, warmup, args.iters if iters is None else iters), args)


def measure_interleaved(fns: dict[str, Callable[[], Any]], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """`measure` of several calls timed in turn (one call of each per round), for ratios between them.

    On a machine whose speed drifts (other jobs, frequency, a neighbour's use of the shared cache) timing one
    model after the other puts the drift into their ratio; interleaving exposes both to the same conditions.
    """
    for _ in range(args.warmup):
        for fn in fns.values():
            fn()
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in fns}
    for _ in range(args.iters):
        for name, fn in fns.items():
            wall, cpu = time_calls(fn, args.device, 0, 1)
            times[name][0].extend(wall)
            times[name][1].extend(cpu)
    return {name: summarize(wall, cpu, args) for name, (wall, cpu) in times.items()}


def summarize(wall: list[float], cpu: list[float], args: argparse.Namespace) -> dict[str, float]:
    """Wall-clock median, min and max, median CPU time, and `ms`: the statistic chosen by `--statistic`."""
    summary = {
        "median_ms": statistics.median(wall),
        "min_ms": min(wall),
        "max_ms": max(wall),
        "cpu_ms": statistics.median(cpu),
    }
    return {"ms": summary[f"{args.statistic}_ms"], **summary}


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
    """Give freed blocks back between models, so the next model's peak is its own.

    Compiled graphs (and their CUDA graphs) keep the model's weights and the cache alive: drop them first.
    """
    import gc

    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# The three models of equal compute at each size: this project's dense backbone, UltraMem, and Mixtral.
PEERS: dict[str, dict[str, str]] = {
    "tiny": {"dense": "tiny-dense", "ultramem": "tiny-ultramem", "moe": "tiny-moe"},
    "151m": {"dense": "dense-151m", "ultramem": "ultramem-151m-x12", "moe": "moe-151m-2in32"},
    "680m": {"dense": "dense-680m", "ultramem": "ultramem-680m-x12", "moe": "moe-680m-2in33"},
    "1.6b": {"dense": "dense-1.6b", "ultramem": "ultramem-1.6b-x12", "moe": "moe-1.6b-2in34"},
}


def parse_sizes(text: str) -> list[str]:
    sizes = [s for s in text.split(",") if s]
    unknown = [s for s in sizes if s not in PEERS]
    if unknown or not sizes:
        raise argparse.ArgumentTypeError(f"unknown size(s) {unknown}; allowed: {', '.join(PEERS)}")
    return sizes


# ----------------------------------------------------------------------------------------------------------------
# One decoding step with a KV cache of `context` tokens (shared by bench_decode and bench_scaling)
# ----------------------------------------------------------------------------------------------------------------


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", type=int, default=None, help="KV-cache tokens (2048 on CUDA, 128 on CPU)")
    parser.add_argument(
        "--mode",
        choices=("eager", "compile"),
        default=None,
        help="applied alike to every model: 'compile' = torch.compile(mode='reduce-overhead'), i.e. Inductor "
        "kernels replayed as CUDA graphs (default on CUDA); 'eager' (default on CPU)",
    )
    parser.add_argument(
        "--moe-impl",
        choices=("auto", *MOE_IMPLEMENTATIONS),
        default="auto",
        help="Mixtral experts_implementation; 'auto' times each at the probe batch and keeps the fastest",
    )


def resolve_decode(args: argparse.Namespace) -> None:
    cuda = args.device.type == "cuda"
    args.context = args.context if args.context is not None else (2048 if cuda else 128)
    args.mode = args.mode or ("compile" if cuda else "eager")
    if args.context < 1:
        raise SystemExit(f"--context must be >= 1, got {args.context}")
    if args.mode == "compile" and args.warmup < 3:
        raise SystemExit("--mode compile needs --warmup >= 3 (compile, CUDA-graph record, first replay)")


def decode_cache_length(args: argparse.Namespace) -> int:
    """Cache slots a decoding benchmark needs: the context, the 2-token prefill, every timed and profiled step."""
    return args.context + 3 + args.warmup + args.iters


def decode_overrides(preset: str, args: argparse.Namespace) -> dict[str, Any]:
    """Config overrides for decoding benchmarks: positions for the whole cache, no router-logit collection."""
    overrides: dict[str, Any] = {"max_position_embeddings": decode_cache_length(args)}
    if preset.startswith(("moe", "tiny-moe")):
        overrides["output_router_logits"] = False
    return overrides


def filled_static_cache(model: PreTrainedModel, batch: int, context: int, max_len: int) -> StaticCache:
    """A StaticCache holding `context` tokens of random keys and values (and primed query-conv states).

    A 2-token prefill initializes every cache layer through the model's own code path; the KV buffers
    are then filled with random values and the lengths set to `context`, which costs the decode step
    exactly what a real 2048-token prompt would, without a 2048-token prefill at every batch size.
    """
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    prompt = torch.randint(1, model.config.vocab_size, (batch, 2), device=model.device)
    model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:
            layer.keys[:, :, :context].normal_()
            layer.values[:, :, :context].normal_()
            layer.cumulative_length.fill_(context)
    return cache


def decode_forward(model: PreTrainedModel, args: argparse.Namespace) -> Callable[..., Any]:
    """The model's forward as every model runs it: eager, or torch.compile(mode="reduce-overhead").

    Static shapes (dynamic batch shapes made CPU decode steps 10x slower in a trial), compiled afresh for each
    batch size: the reset also releases the previous size's CUDA graphs, which hold their cache's memory.
    """
    if args.mode == "eager":
        return model.forward
    torch._dynamo.reset()
    return torch.compile(model.forward, mode="reduce-overhead", dynamic=False)


def time_decode(model: PreTrainedModel, batch: int, args: argparse.Namespace) -> dict[str, float]:
    """Time of one decoding step (sequence length 1) for `batch` sequences with `args.context` cached tokens.

    After timing, one more step runs under the profiler to count what it launches (see `count_launches`).
    """
    step = decode_step(model, batch, args)
    return {**measure(step, args), **count_launches(step, args.device)}


def decode_step(model: PreTrainedModel, batch: int, args: argparse.Namespace) -> Callable[[], None]:
    """One decoding step (sequence length 1) for `batch` sequences with `args.context` cached tokens, as a call.

    Every model runs the same way: StaticCache, SDPA attention, `decode_forward`.
    """
    cache = filled_static_cache(model, batch, args.context, decode_cache_length(args))
    tokens = torch.randint(1, model.config.vocab_size, (batch, 1), device=model.device)
    forward = decode_forward(model, args)

    def step() -> None:
        forward(input_ids=tokens, cache=cache, use_cache=True)

    return step


def count_launches(fn: Callable[[], Any], device: torch.device) -> dict[str, int]:
    """Operators one call of `fn` dispatches: top-level aten ops, and on CUDA the kernels and graph replays.

    Top-level aten ops (those not called from inside another aten op) are what eager mode pays host
    overhead for; a CUDA graph replay launches its kernels without host work, counted as one graph launch.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    events = prof.events()
    counts = {
        "aten_ops": sum(
            1
            for e in events
            if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
        )
    }
    if device.type == "cuda":
        counts["cuda_kernels"] = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        counts["cuda_graph_launches"] = sum(1 for e in events if e.name == "cudaGraphLaunch")
    return counts


def choose_moe_implementation(
    model: PreTrainedModel, requested: str, probe: Callable[[PreTrainedModel], dict[str, float]]
) -> tuple[str, dict[str, Any]]:
    """The Mixtral expert path to benchmark: `requested`, or with 'auto' the fastest under `probe(model)`.

    Returns the choice and the probe times (or errors) of every candidate, for the JSON.
    """
    candidates = MOE_IMPLEMENTATIONS if requested == "auto" else (requested,)
    probes: dict[str, Any] = {}
    for implementation in candidates:
        model.set_experts_implementation(implementation)
        try:
            probes[implementation] = probe(model)["ms"] if requested == "auto" else None
        except (RuntimeError, NotImplementedError, ValueError) as error:
            if requested != "auto":
                raise
            probes[implementation] = f"failed: {type(error).__name__}: {str(error)[:200]}"
    timed = {k: v for k, v in probes.items() if isinstance(v, float)}
    choice = min(timed, key=timed.get) if timed else candidates[0]
    model.set_experts_implementation(choice)
    return choice, probes


# ----------------------------------------------------------------------------------------------------------------
# Analytic memory access of one decoding step (paper section "Why UltraMem instead of MoE")
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeAccess:
    """Bytes one decoding step must read, split as in the paper's analysis."""

    dense_weights: int  # every weight read once per step regardless of batch (attention, MLP, keys, projectors, head)
    sparse_weights: int  # MoE: min(2B, N_moe) experts per layer; UltraMem: min(B*H*m, N) value rows per memory layer
    kv_cache: int  # keys and values of the context

    @property
    def total(self) -> int:
        return self.dense_weights + self.sparse_weights + self.kv_cache


def decode_memory_access(model: PreTrainedModel, batch: int, context: int, bytes_per_value: int) -> DecodeAccess:
    """The paper's memory-access model for one step of `batch` tokens with a KV cache of `context` tokens.

    MoE layer: min(k*B, N_moe) x (one expert's weights); the paper's experts are 2-matrix GeLU (2 x D x 2D),
    Mixtral's are SwiGLU (3 x D x 2/3*2D), the same bytes. UltraMem memory layer: min(B*H*m, N) x Dv for the
    values; keys, query and projectors are read whole. Input embeddings count B rows; everything else once.
    """
    config = model.config
    embedding = model.get_input_embeddings().weight
    value_tables = set(model.get_value_table_names()) if hasattr(model, "get_value_table_names") else set()
    dense = sparse = 0
    for name, param in model.named_parameters():
        if param is embedding and not config.tie_word_embeddings:
            dense += min(batch, param.shape[0]) * param.shape[1]
        elif name in value_tables:
            slots = config.memory_heads * config.memory_topk * batch
            sparse += min(slots, param.shape[0]) * param.shape[1]
        elif ".experts." in name:
            experts = param.shape[0]
            sparse += min(config.num_experts_per_tok * batch, experts) * (param.numel() // experts)
        else:
            dense += param.numel()
    kv_width = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * batch * context * config.num_hidden_layers * kv_width * head_dim
    return DecodeAccess(dense * bytes_per_value, sparse * bytes_per_value, kv * bytes_per_value)


# ----------------------------------------------------------------------------------------------------------------
# Output: table, JSON, PNG
# ----------------------------------------------------------------------------------------------------------------


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A fixed-width text table of `rows`; `columns` are (key, header); floats get 3 significant decimals."""

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    cells = [[cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max([len(header)] + [len(r[i]) for r in cells]) for i, (_, header) in enumerate(columns)]
    lines = ["  ".join(h.rjust(w) for (_, h), w in zip(columns, widths, strict=True))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def write_json(directory: Path, name: str, payload: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def plot_panels(
    args: argparse.Namespace,
    panels: Sequence[tuple[str, str, dict[str, tuple[Iterable[float], Iterable[float]]]]],
    xlabel: str,
    suptitle: str,
) -> Path:
    """One PNG with side-by-side log-x panels; each panel is (title, ylabel, {series: (xs, ys)})."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for axis, (title, ylabel, series) in zip(axes[0], panels, strict=True):
        for label, (xs, ys) in series.items():
            points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and math.isfinite(y)]
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=label)
        axis.set_xscale("log", base=2)
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel)
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.suptitle(suptitle)
    figure.tight_layout()
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"{args.name}.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def finish(args: argparse.Namespace, payload: dict[str, Any], table: str) -> None:
    """Write the JSON (environment first), then print the table last, as the scripts promise."""
    path = write_json(args.results_dir, args.name, {"environment": environment(args), **payload})
    print(f"wrote {path}")
    print(table)
