"""Benchmark of the memory layer's operators: PyTorch path vs embedding_bag vs the Triton kernels.

On an H100 / H200 (one command, a few minutes; writes benchmarks/results/bench_kernels_h100.{json,png}):

    python benchmarks/bench_kernels.py --device cuda

On CPU (reduced sizes; Triton is skipped when it would only run in its interpreter):

    OMP_NUM_THREADS=2 python benchmarks/bench_kernels.py --device cpu --quick

`lookup_reduce` is timed at the paper's UltraMem-x12 memory configurations (151M, 680M, 1.6B: heads,
top-m, value dim, physical rows N, IVE groups E and MCS cores h read from `ultramem.presets`), at its
own (E, h) and at E = h = 1: the PyTorch reference, `embedding_bag_ops.lookup_reduce_embedding_bag` (one
`F.embedding_bag` with per-sample weights, the CPU path) and the Triton kernels. Forward, backward and
forward+backward are timed separately; forward bandwidth counts the bytes that must move (gathered rows,
indices, scores, output) and is compared with a measured device-to-device copy. `tucker_candidate_topk` (the fused m x m scoring and top-m) is timed against
its PyTorch path at the same configurations, and TDQKR's whole selection at inference (`tucker_topk`: the reference
composition, the same with the candidate kernel, the one-kernel selection). The JSON's `summary` reads the issue's targets at >= 4,096 tokens
(Triton forward as % of copy bandwidth; forward+backward against the PyTorch path and embedding_bag). The table
is printed last.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from lib import env, report, timing

from ultramem import kernels, memory_ops
from ultramem.memory_implementations import EMBEDDING_BAG_MEMORY_OPS, TORCH_MEMORY_OPS
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
    num_keys: int

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
    c = get_config(PRESETS[name])
    return MemoryShape(name, c.memory_heads, c.memory_topk, c.memory_value_dim, num_rows or c.memory_num_values,
                       c.ive_expansion, c.mcs_cores, c.tucker_rank, c.memory_num_keys)  # fmt: skip


def lookup_impls(interpreted: bool, op: str = "lookup_reduce") -> dict:
    """The implementations of `op` (lookup_reduce or lookup_dot) that run on this device (Triton only compiled, not
    interpreted), by name."""

    def triton_mode(deterministic: bool):
        def run(*args):
            previous = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(deterministic)
            try:
                return getattr(kernels, op)(*args)
            finally:
                torch.use_deterministic_algorithms(previous)

        return run

    impls = {"torch": getattr(TORCH_MEMORY_OPS, op), "embedding_bag": getattr(EMBEDDING_BAG_MEMORY_OPS, op)}
    if kernels.triton_available() and not interpreted:
        impls["triton"] = triton_mode(False)
        impls["triton-deterministic"] = triton_mode(True)
    return impls


def lookup_bytes(shape: MemoryShape, tokens: int, groups: int, cores: int, element: int) -> int:
    """Bytes a lookup-reduce must move: gathered rows, rows + groups (int64), scores, output."""
    slots = tokens * shape.slots
    pooled = tokens * groups * shape.value_dim
    return slots * shape.value_dim * element + slots * (16 + cores * element) + pooled * element


def time_lookup(
    fn, args: tuple, grad_out: torch.Tensor, device: torch.device, repeats: int, wrt: tuple[int, ...] = (0, 3)
) -> tuple[float, ...]:
    """(forward, backward, forward+backward) ms of one implementation; gradients w.r.t. the arguments at `wrt`
    (lookup_reduce: values and scores)."""
    inputs = tuple(args[i] for i in wrt)
    with torch.no_grad():
        forward = timing.median_ms(lambda: fn(*args), device, repeats)
    out = fn(*args)
    backward = timing.median_ms(lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True), device, repeats)
    out = None  # free the graph before the next measurement
    both = timing.median_ms(lambda: torch.autograd.grad(fn(*args), inputs, grad_out), device, repeats)
    return forward, backward, both


def time_candidates(
    fn, row: torch.Tensor, col: torch.Tensor, cores: torch.Tensor, topk: int, device: torch.device, repeats: int
) -> tuple[float, float]:
    """(forward, forward+backward) ms; the backward flows from the winners' per-core scores."""
    with torch.no_grad():
        forward = timing.median_ms(lambda: fn(row, col, cores, topk), device, repeats)
    both = timing.median_ms(
        lambda: torch.autograd.grad(fn(row, col, cores, topk)[1].sum(), (row, col, cores)), device, repeats
    )
    return forward, both


def bench_lookup(
    shape: MemoryShape,
    groups: int,
    cores: int,
    dtype: torch.dtype,
    tokens_list: list[int],
    device: torch.device,
    copy_gbps: float,
    repeats: int,
    interpreted: bool,
) -> list[Result]:
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


def bench_candidates(
    shape: MemoryShape,
    dtype: torch.dtype,
    tokens_list: list[int],
    device: torch.device,
    repeats: int,
    interpreted: bool,
) -> list[Result]:
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
            result = Result(
                "tucker_candidate_topk",
                shape.name,
                shape.groups,
                shape.cores,
                str(dtype).removeprefix("torch."),
                tokens,
                impl,
            )
            try:
                result.forward_ms, result.fwd_bwd_ms = time_candidates(fn, row, col, cores, shape.topk, device, repeats)
            except torch.OutOfMemoryError:
                result.status = "out of memory"
            results.append(result)
    return results


def bench_selection(
    shape: MemoryShape,
    dtype: torch.dtype,
    tokens_list: list[int],
    device: torch.device,
    repeats: int,
    interpreted: bool,
) -> list[Result]:
    """TDQKR's whole selection at inference (no gradient), from the axis scores (T, H, r, n) to the m addresses and
    their per-core scores: the reference composition, the same with the candidate kernel (the Triton path in training)
    and the one-kernel selection `kernels.tucker_topk`. Forward only: the fused kernel runs only without autograd."""
    impls = {"torch": lambda *args: memory_ops.tucker_topk(*args)}
    if kernels.triton_available() and not interpreted:
        impls["triton-unfused"] = lambda *args: memory_ops.tucker_topk(*args, False, kernels.tucker_candidate_topk)
        impls["triton"] = kernels.tucker_topk
    cores = torch.randn(shape.heads, shape.cores, shape.rank, shape.rank, device=device, dtype=dtype)
    _, u, t = memory_ops.core_svd(cores.sum(1).float())
    results = []
    for tokens in tokens_list:
        row, col = (
            torch.randn(tokens, shape.heads, shape.rank, shape.num_keys, device=device, dtype=dtype) for _ in "rc"
        )
        for impl, fn in impls.items():
            result = Result("tucker_topk", shape.name, shape.groups, shape.cores, str(dtype).removeprefix("torch."),
                            tokens, impl)  # fmt: skip
            try:
                with torch.no_grad(), kernels.fused_selection():  # opt-in: on here to time it
                    result.forward_ms = timing.median_ms(
                        lambda fn=fn: fn(row, col, cores, (u.to(dtype), t.to(dtype)), shape.topk), device, repeats
                    )
            except torch.OutOfMemoryError:
                result.status = "out of memory"
            results.append(result)
    return results


def summary(results: list[Result], op: str = "lookup_reduce") -> list[dict]:
    """The issue's targets per (config, E, h, dtype, tokens >= 4096): Triton's forward as % of the copy bandwidth,
    and its forward+backward speed-up over the PyTorch path and embedding_bag."""
    ok = {
        (r.config, r.groups, r.cores, r.dtype, r.tokens, r.impl): r for r in results if r.op == op and r.status == "ok"
    }
    rows = []
    for (config, groups, cores, dtype, tokens, impl), triton in ok.items():
        if impl != "triton" or tokens < 4096:
            continue
        other = lambda name: ok.get((config, groups, cores, dtype, tokens, name))  # noqa: E731
        speedup = lambda name: other(name).fwd_bwd_ms / triton.fwd_bwd_ms if other(name) else None  # noqa: E731
        rows.append({"config": config, "groups": groups, "cores": cores, "dtype": dtype, "tokens": tokens,
                     "forward_pct_of_copy": triton.forward_pct_of_copy, "fwd_bwd_speedup_vs_torch": speedup("torch"),
                     "fwd_bwd_speedup_vs_embedding_bag": speedup("embedding_bag")})  # fmt: skip
    return rows


def plot(results: list[Result], path: Path, title: str, op: str = "lookup_reduce") -> None:
    """Per (config, E, h, dtype): forward % of copy bandwidth (top) and forward+backward ms (bottom) against tokens."""
    lookups = [r for r in results if r.op == op and r.status == "ok"]
    keys = list(dict.fromkeys((r.config, r.groups, r.cores, r.dtype) for r in lookups))  # run order
    top, bottom = [], []
    for key in keys:
        rows = sorted((r for r in lookups if (r.config, r.groups, r.cores, r.dtype) == key), key=lambda r: r.tokens)
        series = lambda field: {impl: ([r.tokens for r in rows if r.impl == impl], [getattr(r, field) for r in rows if r.impl == impl])
                                for impl in COLORS if any(r.impl == impl for r in rows)}  # noqa: E731 # fmt: skip
        title_ = "{} E={} h={} {}".format(*key)
        top.append(
            report.Panel(title_, "forward, % of copy bandwidth", series("forward_pct_of_copy"), "tokens", colors=COLORS)
        )
        bottom.append(
            report.Panel(title_, "forward+backward ms", series("fwd_bwd_ms"), "tokens", ylog=True, colors=COLORS)
        )
    report.plot(path, top + bottom, title, columns=max(1, len(keys)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROWS} rows, tokens {QUICK_TOKENS} (CPU default)")
    parser.add_argument("--smoke", action="store_true", help=f"151M only, {SMOKE_ROWS} rows, tokens {SMOKE_TOKENS}")
    parser.add_argument("--configs", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--tokens", nargs="+", type=int, help="token counts (overrides the mode's list)")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "float16"],
                        help="value dtypes (default: bfloat16 float32 on CUDA, float32 on CPU)")  # fmt: skip
    parser.add_argument(
        "--own-shape-only", action="store_true", help="time each config at its own (E, h) only, not also at E = h = 1"
    )
    parser.add_argument(
        "--no-candidates", action="store_true", help="skip tucker_candidate_topk and the whole selection (tucker_topk)"
    )
    parser.add_argument("--repeats", type=int, help="timed calls per measurement (median reported)")
    parser.add_argument("--out-dir", type=Path, default=env.RESULTS_DIR)
    parser.add_argument("--name", default="bench_kernels", help="file stem of the JSON and PNG (<name>_<device>)")
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

    copy_gbps = timing.copy_bandwidth_gbps(device, (2**24 if args.smoke else 2**28 if quick else 2**30), repeats)
    path = args.out_dir / f"{args.name}_{env.device_tag(device)}.json"
    report_ = {
        "environment": env.environment(device),
        "copy_gbps": copy_gbps,
        "mode": "smoke" if args.smoke else "quick" if quick else "full",
        "num_rows": {name: memory_shape(name, num_rows).num_rows for name in configs},
        "triton": "skipped (interpreter only)" if interpreted or not kernels.triton_available() else "measured",
        "complete": False,  # the JSON is rewritten after each config and dtype: a run cut short keeps what it measured
        "results": [],
        "summary": [],
    }
    results: list[Result] = []
    for name in configs:
        shape = memory_shape(name, num_rows)
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            variants = (
                [(shape.groups, shape.cores)]
                if args.own_shape_only
                else sorted({(shape.groups, shape.cores), (1, 1)}, reverse=True)
            )
            for groups, cores in variants:
                results += bench_lookup(
                    shape, groups, cores, dtype, tokens_list, device, copy_gbps, repeats, interpreted
                )
                report_.update(results=[asdict(r) for r in results], summary=summary(results))
                report.write_json(path, report_)
            if not args.no_candidates:
                results += bench_candidates(shape, dtype, tokens_list, device, repeats, interpreted)
                results += bench_selection(shape, dtype, tokens_list, device, repeats, interpreted)
            report_["results"] = [asdict(r) for r in results]
            report.write_json(path, report_)

    report_["complete"] = True
    report.write_json(path, report_)
    plot(
        results,
        path.with_suffix(".png"),
        f"{report_['environment']['device']} ({report_['mode']}), copy {copy_gbps:.0f} GB/s",
    )
    print(f"device: {report_['environment']['device']}  copy bandwidth: {copy_gbps:.1f} GB/s  wrote {path} and .png")
    if report_["summary"]:
        print(report.format_table(report_["summary"], list(report_["summary"][0])) + "\n")
    print(report.format_table([asdict(r) for r in results], list(asdict(results[0]))))


if __name__ == "__main__":
    main()
