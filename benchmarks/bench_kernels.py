"""Benchmark of the memory layer's operators: PyTorch path vs embedding_bag vs the Triton kernels.

On an H100 / H200 (one command, a few minutes; writes benchmarks/results/bench_kernels_<gpu>.{json,png}):

    python benchmarks/bench_kernels.py --device cuda

On CPU (reduced sizes; Triton is skipped when it would only run in its interpreter):

    OMP_NUM_THREADS=2 python benchmarks/bench_kernels.py --device cpu --quick

`lookup_reduce` is timed at the paper's UltraMem-x12 memory configurations (151M, 680M, 1.6B: heads,
top-m, value dim, physical rows N, IVE groups E and MCS cores h read from `ultramem.presets`), at its
own (E, h) and at E = h = 1: the PyTorch reference, `memory_ops.lookup_reduce_embedding_bag` (one
`F.embedding_bag` with per-sample weights, the CPU path) and the Triton kernels. Forward, backward and
forward+backward are timed separately; forward bandwidth counts the bytes that must move (gathered rows,
indices, scores, output) and is compared with a measured device-to-device copy. `tucker_candidate_topk` (the fused m x m scoring and top-m) is timed against
its PyTorch path at the same configurations. The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import _common as common
from ultramem import kernels, memory_ops
from ultramem.presets import get_config

TOKENS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536]
QUICK_TOKENS = [1, 64, 1024]
SMOKE_TOKENS = [1, 8]
PRESETS = {"151m": "ultramem-151m-x12", "680m": "ultramem-680m-x12", "1.6b": "ultramem-1.6b-x12"}
QUICK_ROWS = 65_536  # physical rows on CPU: a table that fits in RAM next to the other benchmarks
SMOKE_ROWS = 1_024
COLORS = {"torch": "tab:blue", "embedding_bag": "tab:orange", "triton": "tab:green", "triton-deterministic": "tab:red"}


@dataclass(frozen=True)
class MemoryShape:
    """The lookup's dimensions at one configuration."""

    name: str
    heads: int
    topk: int
    value_dim: int
    num_rows: int
    groups: int
    cores: int
    rank: int

    @property
    def slots(self) -> int:
        return self.heads * self.topk


@dataclass
class Result:
    op: str
    config: str
    groups: int
    cores: int
    dtype: str
    tokens: int
    impl: str
    status: str = "ok"
    forward_ms: float | None = None
    backward_ms: float | None = None
    fwd_bwd_ms: float | None = None
    forward_gbps: float | None = None
    forward_pct_of_copy: float | None = None


def memory_shape(name: str, num_rows: int | None) -> MemoryShape:
    config = get_config(PRESETS[name])
    return MemoryShape(
        name=name, heads=config.memory_heads, topk=config.memory_topk, value_dim=config.memory_value_dim,
        num_rows=num_rows or config.memory_num_values, groups=config.ive_expansion, cores=config.mcs_cores,
        rank=config.tucker_rank,
    )


def time_ms(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of `fn` in ms after one warm-up call (`_common.time_calls`); on CUDA, L2 is flushed first."""
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.float32, device=device) if device.type == "cuda" else None
    wall, _ = common.time_calls(fn, device, warmup=1, iters=repeats, before_each=None if flush is None else flush.zero_)
    return statistics.median(wall)


def copy_bandwidth_gbps(device: torch.device, num_bytes: int, repeats: int) -> float:
    """Measured device-to-device copy: bytes read plus bytes written per second."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    return 2 * num_bytes / time_ms(lambda: target.copy_(source), device, repeats) / 1e6


def lookup_impls(interpreted: bool) -> dict:
    """The implementations that run on this device (Triton only compiled, not interpreted), by name."""

    def triton_mode(deterministic: bool):
        def run(*args):
            previous = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(deterministic)
            try:
                return kernels.lookup_reduce(*args)
            finally:
                torch.use_deterministic_algorithms(previous)

        return run

    impls = {"torch": memory_ops.lookup_reduce, "embedding_bag": memory_ops.lookup_reduce_embedding_bag}
    if kernels.triton_available() and not interpreted:
        impls["triton"] = triton_mode(False)
        impls["triton-deterministic"] = triton_mode(True)
    return impls


def lookup_bytes(shape: MemoryShape, tokens: int, groups: int, cores: int, element: int) -> int:
    """Bytes a lookup-reduce must move: gathered rows, rows + groups (int64), scores, output."""
    slots = tokens * shape.slots
    pooled = tokens * groups * shape.value_dim
    return slots * shape.value_dim * element + slots * (16 + cores * element) + pooled * element


def time_lookup(fn, args: tuple, grad_out: torch.Tensor, device: torch.device, repeats: int) -> tuple[float, ...]:
    """(forward, backward, forward+backward) ms of one implementation; gradients w.r.t. values and scores."""
    values, scores = args[0], args[3]
    with torch.no_grad():
        forward = time_ms(lambda: fn(*args), device, repeats)
    out = fn(*args)
    backward = time_ms(lambda: torch.autograd.grad(out, (values, scores), grad_out, retain_graph=True), device, repeats)
    out = None  # free the graph before the next measurement
    both = time_ms(lambda: torch.autograd.grad(fn(*args), (values, scores), grad_out), device, repeats)
    return forward, backward, both


def time_candidates(fn, row: torch.Tensor, col: torch.Tensor, cores: torch.Tensor, topk: int,
                    device: torch.device, repeats: int) -> tuple[float, float]:
    """(forward, forward+backward) ms; the backward flows from the winners' per-core scores."""
    with torch.no_grad():
        forward = time_ms(lambda: fn(row, col, cores, topk), device, repeats)
    both = time_ms(lambda: torch.autograd.grad(fn(row, col, cores, topk)[1].sum(), (row, col, cores)), device, repeats)
    return forward, both


def bench_lookup(shape: MemoryShape, groups: int, cores: int, dtype: torch.dtype, tokens_list: list[int],
                 device: torch.device, copy_gbps: float, repeats: int, interpreted: bool) -> list[Result]:
    values = torch.randn(shape.num_rows, shape.value_dim, device=device, dtype=dtype).requires_grad_()
    results = []
    for tokens in tokens_list:
        generator = torch.Generator(device=device).manual_seed(tokens)
        rows = torch.randint(0, shape.num_rows, (tokens, shape.slots), device=device, generator=generator)
        group_ids = torch.randint(0, groups, (tokens, shape.slots), device=device, generator=generator)
        scores = torch.randn(tokens, shape.slots, cores, device=device, dtype=dtype).requires_grad_()
        grad_out = torch.randn(tokens, groups, shape.value_dim, device=device, dtype=dtype)
        num_bytes = lookup_bytes(shape, tokens, groups, cores, values.element_size())
        for impl, fn in lookup_impls(interpreted).items():
            result = Result("lookup_reduce", shape.name, groups, cores, str(dtype).removeprefix("torch."), tokens, impl)
            try:
                result.forward_ms, result.backward_ms, result.fwd_bwd_ms = time_lookup(
                    fn, (values, rows, group_ids, scores, groups), grad_out, device, repeats
                )
                result.forward_gbps = num_bytes / result.forward_ms / 1e6
                result.forward_pct_of_copy = 100 * result.forward_gbps / copy_gbps
            except torch.OutOfMemoryError:
                result.status = "out of memory"
            except (NotImplementedError, RuntimeError) as error:
                result.status = f"unsupported: {str(error).splitlines()[0][:80]}"
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            results.append(result)
    return results


def bench_candidates(shape: MemoryShape, dtype: torch.dtype, tokens_list: list[int], device: torch.device,
                     repeats: int, interpreted: bool) -> list[Result]:
    impls = {"torch": memory_ops.tucker_candidate_topk}
    if kernels.triton_available() and not interpreted:
        impls["triton"] = kernels.tucker_candidate_topk
    cores = torch.randn(shape.heads, shape.cores, shape.rank, shape.rank, device=device, dtype=dtype)
    cores.requires_grad_()
    results = []
    for tokens in tokens_list:
        grid = (tokens, shape.heads, shape.rank, shape.topk)
        row = torch.randn(grid, device=device, dtype=dtype).requires_grad_()
        col = torch.randn(grid, device=device, dtype=dtype).requires_grad_()
        for impl, fn in impls.items():
            result = Result("tucker_candidate_topk", shape.name, shape.groups, shape.cores,
                            str(dtype).removeprefix("torch."), tokens, impl)
            try:
                result.forward_ms, result.fwd_bwd_ms = time_candidates(fn, row, col, cores, shape.topk, device, repeats)
            except torch.OutOfMemoryError:
                result.status = "out of memory"
            results.append(result)
    return results


def device_info(device: torch.device) -> dict:
    info = {"type": device.type, "torch": torch.__version__, "platform": platform.platform()}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(name=properties.name, capability=f"sm_{properties.major}{properties.minor}",
                    memory_gib=round(properties.total_memory / 2**30, 1))
    else:
        info.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


def file_tag(info: dict) -> str:
    if info["type"] == "cpu":
        return "cpu"
    return "cuda_" + "".join(c if c.isalnum() else "_" for c in info["name"]).strip("_")


def plot(results: list[Result], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lookups = [r for r in results if r.op == "lookup_reduce" and r.status == "ok"]
    panels = list(dict.fromkeys((r.config, r.groups, r.cores, r.dtype) for r in lookups))  # run order
    figure, axes = plt.subplots(2, max(1, len(panels)), figsize=(4.2 * max(1, len(panels)), 7), squeeze=False)
    for column, (config, groups, cores, dtype) in enumerate(panels):
        rows = [r for r in lookups if (r.config, r.groups, r.cores, r.dtype) == (config, groups, cores, dtype)]
        for impl in [impl for impl in COLORS if any(r.impl == impl for r in rows)]:
            series = sorted((r.tokens, r.forward_pct_of_copy, r.fwd_bwd_ms) for r in rows if r.impl == impl)
            tokens = [s[0] for s in series]
            axes[0][column].plot(tokens, [s[1] for s in series], marker="o", label=impl, color=COLORS[impl])
            axes[1][column].plot(tokens, [s[2] for s in series], marker="o", label=impl, color=COLORS[impl])
        axes[0][column].set_title(f"{config} E={groups} h={cores} {dtype}", fontsize=9)
        axes[0][column].set_ylabel("forward, % of copy bandwidth")
        axes[1][column].set_ylabel("forward+backward ms")
        axes[1][column].set_yscale("log")
        for axis in (axes[0][column], axes[1][column]):
            axis.set_xscale("log", base=2)
            axis.set_xlabel("tokens")
            axis.grid(alpha=0.3)
            axis.legend(fontsize=7)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def format_table(results: list[Result]) -> str:
    columns = ["op", "config", "groups", "cores", "dtype", "tokens", "impl", "forward_ms", "backward_ms",
               "fwd_bwd_ms", "forward_gbps", "forward_pct_of_copy", "status"]

    def cell(value) -> str:
        if value is None:
            return "-"
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    rows = [[cell(getattr(r, c)) for c in columns] for r in results]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROWS} rows, tokens {QUICK_TOKENS} (CPU default)")
    parser.add_argument("--smoke", action="store_true", help=f"151M only, {SMOKE_ROWS} rows, tokens {SMOKE_TOKENS}")
    parser.add_argument("--configs", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--tokens", nargs="+", type=int, help="token counts (overrides the mode's list)")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "float16"],
                        help="value dtypes (default: bfloat16 float32 on CUDA, float32 on CPU)")
    parser.add_argument("--repeats", type=int, help="timed calls per measurement (median reported)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible; use --device cpu")
    quick = args.quick or args.smoke or device.type == "cpu"
    configs = ["151m"] if args.smoke else args.configs
    num_rows = SMOKE_ROWS if args.smoke else (QUICK_ROWS if quick else None)
    tokens_list = args.tokens or (SMOKE_TOKENS if args.smoke else QUICK_TOKENS if quick else TOKENS)
    dtypes = args.dtypes or (["bfloat16", "float32"] if device.type == "cuda" else ["float32"])
    repeats = args.repeats or (1 if args.smoke else 3 if device.type == "cpu" else 20)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"

    info = device_info(device)
    copy_gbps = copy_bandwidth_gbps(device, (2**24 if args.smoke else 2**28 if quick else 2**30), repeats)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"bench_kernels_{file_tag(info)}"
    report = {
        "device": info,
        "copy_gbps": copy_gbps,
        "mode": "smoke" if args.smoke else "quick" if quick else "full",
        "num_rows": {name: memory_shape(name, num_rows).num_rows for name in configs},
        "triton": "skipped (interpreter only)" if interpreted or not kernels.triton_available() else "measured",
        "complete": False,  # the JSON is rewritten after each config and dtype: a run cut short keeps what it measured
        "results": [],
    }
    results: list[Result] = []
    for name in configs:
        shape = memory_shape(name, num_rows)
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            for groups, cores in sorted({(shape.groups, shape.cores), (1, 1)}, reverse=True):
                results += bench_lookup(shape, groups, cores, dtype, tokens_list, device, copy_gbps, repeats,
                                        interpreted)
            results += bench_candidates(shape, dtype, tokens_list, device, repeats, interpreted)
            report["results"] = [asdict(r) for r in results]
            stem.with_suffix(".json").write_text(json.dumps(report, indent=1))

    report["complete"] = True
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(results, stem.with_suffix(".png"), f"{info['name']} ({report['mode']}), copy {copy_gbps:.0f} GB/s")
    print(f"device: {info['name']}  copy bandwidth: {copy_gbps:.1f} GB/s  wrote {stem}.json/.png")
    print(format_table(results))


if __name__ == "__main__":
    main()
