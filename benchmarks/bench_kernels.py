"""The memory layer's kernels against their PyTorch paths: one registry of ops (`OPS`), a bench function each, one runner.

    python benchmarks/bench_kernels.py --device cuda       # H100 / H200: lookup_reduce, tucker_candidate_topk, tucker_topk
    python benchmarks/bench_kernels.py --device cuda --ops lookup_dot --configs 680m --tokens 4096,16384,65536
    python benchmarks/bench_kernels.py --device cuda --ops quantized_lookup_reduce --configs 680m,1.6b --rows 1048576
    OMP_NUM_THREADS=2 python benchmarks/bench_kernels.py --device cpu --quick    # CPU: reduced sizes, no Triton
    TRITON_INTERPRET=1 python benchmarks/bench_kernels.py --smoke --ops quantized_lookup_reduce   # CPU, interpreted

Every op is timed at the paper's UltraMem-x12 memory shapes (heads, top-m, value dim, physical rows N, IVE groups E,
MCS cores h, from the presets), at each token count and dtype, for each implementation that runs on the device
(Triton only compiled, not in its interpreter, except where the op needs Triton):

- `lookup_reduce`: the PyTorch reference, `embedding_bag` (one `F.embedding_bag` with per-sample weights, the CPU
  path) and the Triton kernel with its atomic and deterministic value gradient, at the shape's own (E, h) and at
  E = h = 1 (`--own-shape-only`: its own only); forward, backward, forward+backward, and the forward's bandwidth (the
  bytes that must move: gathered rows, indices, scores, output) against a measured device-to-device copy.
- `tucker_candidate_topk`: the fused m x m scoring and top-m against its PyTorch path, forward and forward+backward.
- `tucker_topk`: TDQKR's whole selection at inference, from the axis scores to the m addresses: the reference
  composition, the same with the candidate kernel, and the one-kernel selection (forward only, as it runs).
- `lookup_dot`: PEER's gate (UltraMemV2 Eq. 15) at each pre-value width Dp (`--pre-value-dims`), as lookup_reduce.
- `quantized_lookup_reduce`: the Triton kernel over int8 (one group per MCS chunk) and int4 (64-column groups) tables
  against the dense kernel: a row read is its stored bytes; `row_gbps` those bytes over the forward's time,
  `values_per_ns` the pooled elements per ns (the same work in every format), the score backward (frozen tables), and
  the error against the dequantize-then-pool reference at the first token count. CUDA, or CPU in the interpreter.

Writes `<results-dir>/<name>.json` (rewritten after every op, shape and dtype: a run cut short keeps what it measured)
with a `summary` of issue 22's targets at >= 4,096 tokens (Triton's forward as % of copy bandwidth, its
forward+backward speed-up over the PyTorch path and embedding_bag), and a PNG of the lookups; the tables print last.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lib import cli, env, models, report, timing

from ultramem import kernels, memory_ops
from ultramem.kernels.quantized_lookup import quantized_lookup_reduce
from ultramem.memory_implementations import EMBEDDING_BAG_MEMORY_OPS, TORCH_MEMORY_OPS
from ultramem.presets import get_config
from ultramem.quantized import lookup_reduce_quantized_reference, quantize
from ultramem.quantized.format import resolve_group_size

DEFAULT_NAME = "bench_kernels"
DEFAULT_OPS = ["lookup_reduce", "tucker_candidate_topk", "tucker_topk"]
SIZES = ["151m", "680m", "1.6b"]
# tokens, physical rows (None: the preset's), timed calls and copied bytes of each mode
MODES = {
    "full": ([1, 4, 16, 64, 256, 1024, 4096, 16384, 65536], None, 20, 2**30),
    "quick": ([1, 64, 1024], 65_536, 3, 2**28),  # CPU: a table that fits in RAM next to the other benchmarks
    "smoke": ([1, 8], 1_024, 1, 2**24),
}
QUANTIZED_ROWS = 65_536  # distinct quantized rows made on the host, tiled to the table's rows on the device (contents
# do not change the kernels' speed; quantizing 2^20 x 1024 floats on the host would take longer than the measurement)
LOOKUPS = ("lookup_reduce", "lookup_dot")  # the ops timed against the copy bandwidth, summarized and plotted
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


def memory_shape(size: str, num_rows: int | None) -> MemoryShape:
    """The UltraMem-x12 preset's memory at `size`, with `num_rows` physical rows (None: the preset's)."""
    c = get_config(models.PEERS[size]["ultramem"])
    return MemoryShape(size, c.memory_heads, c.memory_topk, c.memory_value_dim, num_rows or c.memory_num_values,
                       c.ive_expansion, c.mcs_cores, c.tucker_rank, c.memory_num_keys)  # fmt: skip


@dataclass(frozen=True)
class Case:
    """What a bench function measures: its op at one memory shape and dtype, at every token count, timed alike."""

    shape: MemoryShape
    dtype: torch.dtype
    args: argparse.Namespace  # device, timing, tokens, and the ops' own flags
    copy_gbps: float

    @property
    def device(self) -> torch.device:
        return self.args.device

    def ms(self, fn: Callable[[], Any]) -> float:
        return timing.flushed_ms(fn, self.device, self.args.warmup, self.args.iters, self.args.statistic)

    def row(self, op: str, impl: str, tokens: int, config: str | None = None, **fields: Any) -> dict[str, Any]:
        """A result row's identity: op, memory shape (`fields`: its E, h, ...), dtype, tokens, implementation."""
        return {"op": op, "config": config or self.shape.name, **fields, "dtype": str(self.dtype).removeprefix("torch."),
                "tokens": tokens, "impl": impl, "status": "ok"}  # fmt: skip

    def randn(self, *size: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(*size, device=self.device, dtype=self.dtype).requires_grad_(grad)


def compiled_triton() -> bool:
    """Triton runs compiled here (in its interpreter it checks correctness, it does not measure speed)."""
    return kernels.triton_available() and os.environ.get("TRITON_INTERPRET") != "1"


OPS: dict[str, Callable[[Case], list[dict[str, Any]]]] = {}


def op(name: str) -> Callable:
    """Register a bench function: `Case` -> its rows."""

    def register(bench: Callable[[Case], list[dict[str, Any]]]) -> Callable[[Case], list[dict[str, Any]]]:
        OPS[name] = bench
        return bench

    return register


def measured(row: dict[str, Any], measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`row` with what `measure()` returns, or with why the implementation cannot run here."""
    try:
        row.update(measure())
    except torch.OutOfMemoryError:
        row["status"] = "out of memory"
    except (NotImplementedError, RuntimeError) as error:  # e.g. embedding_bag has no bf16 CUDA weight backward
        row["status"] = f"unsupported: {str(error).splitlines()[0][:80]}"
    finally:
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    return row


def lookup_impls(case: Case, op_name: str) -> dict[str, Callable]:
    """The implementations of `op_name` (lookup_reduce or lookup_dot) that run on this device, by name."""

    def triton_mode(deterministic: bool) -> Callable:
        def run(*args: Any) -> torch.Tensor:
            previous = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(deterministic)
            try:
                return getattr(kernels, op_name)(*args)
            finally:
                torch.use_deterministic_algorithms(previous)

        return run

    impls = {"torch": getattr(TORCH_MEMORY_OPS, op_name), "embedding_bag": getattr(EMBEDDING_BAG_MEMORY_OPS, op_name)}
    if compiled_triton():
        impls.update({"triton": triton_mode(False), "triton-deterministic": triton_mode(True)})
    return impls


def time_lookup(case: Case, fn: Callable, args: tuple, grad_out: torch.Tensor, wrt: tuple[int, ...], num_bytes: int):
    """Forward, backward and forward+backward ms of one lookup implementation, gradients w.r.t. the arguments at
    `wrt`, and the forward's bandwidth against the copy's."""
    inputs = tuple(args[i] for i in wrt)
    with torch.no_grad():
        forward = case.ms(lambda: fn(*args))
    out = fn(*args)
    backward = case.ms(lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True))
    out = None  # free the graph before the next measurement
    both = case.ms(lambda: torch.autograd.grad(fn(*args), inputs, grad_out))
    gbps = num_bytes / forward / 1e6
    return {"forward_ms": forward, "backward_ms": backward, "fwd_bwd_ms": both, "forward_gbps": gbps,
            "forward_pct_of_copy": 100 * gbps / case.copy_gbps}  # fmt: skip


@op("lookup_reduce")
def bench_lookup_reduce(case: Case) -> list[dict[str, Any]]:
    shape, rows = case.shape, []
    values = case.randn(shape.num_rows, shape.value_dim, grad=True)
    own = (shape.groups, shape.cores)
    for groups, cores in [own] if case.args.own_shape_only else sorted({own, (1, 1)}, reverse=True):
        for tokens in case.args.tokens:
            generator = torch.Generator(device=case.device).manual_seed(tokens)
            indices = torch.randint(0, shape.num_rows, (tokens, shape.slots), device=case.device, generator=generator)
            group_ids = torch.randint(0, groups, (tokens, shape.slots), device=case.device, generator=generator)
            scores = case.randn(tokens, shape.slots, cores, grad=True)
            grad_out = case.randn(tokens, groups, shape.value_dim)
            element = values.element_size()  # gathered rows, rows + groups (int64), scores, output
            num_bytes = tokens * shape.slots * (shape.value_dim * element + 16 + cores * element)
            num_bytes += tokens * groups * shape.value_dim * element
            arguments = (values, indices, group_ids, scores, groups)
            for impl, fn in lookup_impls(case, "lookup_reduce").items():
                row = case.row("lookup_reduce", impl, tokens, groups=groups, cores=cores)
                rows.append(measured(row, lambda: time_lookup(case, fn, arguments, grad_out, (0, 3), num_bytes)))
    return rows


@op("lookup_dot")
def bench_lookup_dot(case: Case) -> list[dict[str, Any]]:
    """out[t, k] = <pre_values[rows[t, k]], query[t]> at the shape's slots per token, for each width Dp."""
    shape, rows = case.shape, []
    for dim in case.args.pre_value_dims:
        table = case.randn(shape.num_rows, dim, grad=True)
        for tokens in case.args.tokens:
            generator = torch.Generator(device=case.device).manual_seed(tokens)
            indices = torch.randint(0, shape.num_rows, (tokens, shape.slots), device=case.device, generator=generator)
            query, grad_out = case.randn(tokens, dim, grad=True), case.randn(tokens, shape.slots)
            element = table.element_size()  # gathered rows, rows (int64), queries, output
            num_bytes = tokens * (shape.slots * (dim * element + 8 + element) + dim * element)
            for impl, fn in lookup_impls(case, "lookup_dot").items():
                row = case.row("lookup_dot", impl, tokens, config=f"{shape.name} Dp={dim}", groups=1, cores=1)
                rows.append(measured(row, lambda: time_lookup(case, fn, (table, indices, query), grad_out, (0, 2),
                                                              num_bytes)))  # fmt: skip
    return rows


@op("tucker_candidate_topk")
def bench_candidates(case: Case) -> list[dict[str, Any]]:
    """Forward, and forward+backward from the winners' per-core scores."""
    shape, rows = case.shape, []
    impls = {"torch": memory_ops.tucker_candidate_topk}
    if compiled_triton():
        impls["triton"] = kernels.tucker_candidate_topk
    cores = case.randn(shape.heads, shape.cores, shape.rank, shape.rank, grad=True)
    for tokens in case.args.tokens:
        row_scores, col_scores = (case.randn(tokens, shape.heads, shape.rank, shape.topk, grad=True) for _ in "rc")

        def times(fn: Callable) -> dict[str, float]:
            with torch.no_grad():
                forward = case.ms(lambda: fn(row_scores, col_scores, cores, shape.topk))
            inputs = (row_scores, col_scores, cores)
            both = case.ms(lambda: torch.autograd.grad(fn(*inputs, shape.topk)[1].sum(), inputs))
            return {"forward_ms": forward, "fwd_bwd_ms": both}

        for impl, fn in impls.items():
            row = case.row("tucker_candidate_topk", impl, tokens, groups=shape.groups, cores=shape.cores)
            rows.append(measured(row, lambda: times(fn)))
    return rows


@op("tucker_topk")
def bench_selection(case: Case) -> list[dict[str, Any]]:
    """From the axis scores (T, 2, H, r, n) to the m addresses and their per-core scores, without autograd (the fused
    kernel runs only there): the reference, the reference with the candidate kernel, the one-kernel selection."""
    shape, rows = case.shape, []
    impls = {"torch": lambda *args: memory_ops.tucker_topk(*args)}
    if compiled_triton():
        impls["triton-unfused"] = lambda *args: memory_ops.tucker_topk(*args, False, kernels.tucker_candidate_topk)
        impls["triton"] = kernels.tucker_topk
    cores = case.randn(shape.heads, shape.cores, shape.rank, shape.rank)
    _, u, t = memory_ops.core_svd(cores.sum(1).float())
    singular = torch.stack((u, t)).unsqueeze(-1).to(case.dtype)  # (2, H, r, 1)
    for tokens in case.args.tokens:
        axis_scores = case.randn(tokens, 2, shape.heads, shape.rank, shape.num_keys)

        def forward(fn: Callable) -> dict[str, float]:
            with torch.no_grad(), kernels.fused_selection():  # opt-in: on here to time it
                return {"forward_ms": case.ms(lambda: fn(axis_scores, cores, singular, shape.topk))}

        for impl, fn in impls.items():
            row = case.row("tucker_topk", impl, tokens, groups=shape.groups, cores=shape.cores)
            rows.append(measured(row, lambda: forward(fn)))
    return rows


@op("quantized_lookup_reduce")
def bench_quantized(case: Case) -> list[dict[str, Any]]:
    """The dense kernel at the case's dtype, then int8 and int4: forward, score backward, error."""
    shape, rows = case.shape, []
    distinct = torch.randn(
        min(shape.num_rows, QUANTIZED_ROWS), shape.value_dim, generator=torch.Generator().manual_seed(0)
    )
    repeats = -(-shape.num_rows // distinct.shape[0])
    dense = str(case.dtype).removeprefix("torch.")
    tables = {dense: (distinct.to(case.device, case.dtype).repeat(repeats, 1)[: shape.num_rows], None)}
    for format in ("int8", "int4"):
        group_size = resolve_group_size(format, shape.value_dim, shape.cores)
        quantized = quantize(distinct, format, shape.cores, group_size).to(case.device)
        tables[format] = (quantized.repeat(repeats, 1)[: shape.num_rows], group_size)
    for tokens in case.args.tokens:
        generator = torch.Generator(device=case.device).manual_seed(tokens)
        indices = torch.randint(0, shape.num_rows, (tokens, shape.slots), device=case.device, generator=generator)
        groups = torch.randint(0, shape.groups, (tokens, shape.slots), device=case.device, generator=generator)
        scores = case.randn(tokens, shape.slots, shape.cores)
        grad_out = torch.randn(tokens, shape.groups, shape.value_dim, device=case.device)
        dense_ms = None
        for format, (table, group_size) in tables.items():
            arguments = (table, indices, groups, scores, shape.groups, format, group_size)
            if group_size is None:
                forward = lambda: kernels.lookup_reduce(table, indices, groups, scores, shape.groups)
            else:
                forward = lambda: quantized_lookup_reduce(*arguments)
            with torch.no_grad():
                forward_ms = case.ms(forward)
            dense_ms = dense_ms or forward_ms
            row = case.row("quantized_lookup_reduce", format, tokens, group_size=group_size)
            row_bytes = table.shape[1] * table.element_size()
            row.update(row_bytes=row_bytes, forward_ms=forward_ms,
                       row_gbps=tokens * shape.slots * row_bytes / forward_ms / 1e6,
                       values_per_ns=tokens * shape.slots * shape.value_dim / forward_ms / 1e6)  # fmt: skip
            if group_size is not None:
                leaf = scores.clone().requires_grad_(True)
                out = quantized_lookup_reduce(table, indices, groups, leaf, shape.groups, format, group_size)
                row["speedup_vs_dense"] = dense_ms / forward_ms
                row["score_backward_ms"] = case.ms(lambda: torch.autograd.grad(out, leaf, grad_out, retain_graph=True))
                if tokens == case.args.tokens[0]:
                    expected = lookup_reduce_quantized_reference(*arguments)
                    error = (out.detach() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)
                    row["max_relative_error"] = error.item()
            rows.append(row)
    return rows


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets per lookup (op, config, E, h, dtype) at >= 4,096 tokens: Triton's forward as % of the copy
    bandwidth, and its forward+backward speed-up over the PyTorch path and embedding_bag."""
    where = ("op", "config", "groups", "cores", "dtype", "tokens")
    ok = {(*(r[k] for k in where), r["impl"]): r for r in rows if r["op"] in LOOKUPS and r["status"] == "ok"}
    table = []
    for (*at, impl), triton in ok.items():
        if impl == "triton" and triton["tokens"] >= 4096:
            speedup = {name: ok[(*at, name)]["fwd_bwd_ms"] / triton["fwd_bwd_ms"] if (*at, name) in ok else None
                       for name in ("torch", "embedding_bag")}  # fmt: skip
            table.append({**{k: triton[k] for k in where}, "forward_pct_of_copy": triton["forward_pct_of_copy"],
                          "fwd_bwd_speedup_vs_torch": speedup["torch"],
                          "fwd_bwd_speedup_vs_embedding_bag": speedup["embedding_bag"]})  # fmt: skip
    return table


def plot(rows: list[dict[str, Any]], args: argparse.Namespace, title: str) -> None:
    """Per lookup (op, config, E, h, dtype): forward % of copy bandwidth (top) and forward+backward ms (bottom)
    against tokens."""
    lookups = [r for r in rows if r["op"] in LOOKUPS and r["status"] == "ok"]
    keys = list(dict.fromkeys((r["op"], r["config"], r["groups"], r["cores"], r["dtype"]) for r in lookups))
    if not keys:
        return
    top, bottom = [], []
    for key in keys:
        mine = sorted((r for r in lookups if (r["op"], r["config"], r["groups"], r["cores"], r["dtype"]) == key),
                      key=lambda r: r["tokens"])  # fmt: skip
        series = lambda field: {impl: ([r["tokens"] for r in mine if r["impl"] == impl], [r[field] for r in mine if r["impl"] == impl])
                                for impl in COLORS if any(r["impl"] == impl for r in mine)}  # fmt: skip
        name = "{} {} E={} h={} {}".format(*key)
        top.append(
            report.Panel(name, "forward, % of copy bandwidth", series("forward_pct_of_copy"), "tokens", colors=COLORS)
        )
        bottom.append(
            report.Panel(name, "forward+backward ms", series("fwd_bwd_ms"), "tokens", ylog=True, colors=COLORS)
        )
    report.plot(args.results_dir / f"{args.name}.png", top + bottom, title, columns=len(keys))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.make_parser(__doc__, DEFAULT_NAME, dtypes=True)
    parser.set_defaults(warmup=1, iters=None, statistic="median")  # a kernel's time: wall clock, L2 flushed
    add = parser.add_argument
    add("--ops", type=lambda text: cli.names(text, OPS, "--ops"), default=DEFAULT_OPS,
        help=f"comma-separated, of {', '.join(OPS)} (default {','.join(DEFAULT_OPS)})")  # fmt: skip
    add("--configs", type=lambda text: cli.names(text, SIZES, "--configs"), default=SIZES, help="memory shapes")
    add("--tokens", type=cli.int_list, help="token counts (default: the mode's)")
    add("--rows", type=int, help="physical rows of every table (default: the mode's; full: the preset's)")
    add("--pre-value-dims", type=cli.int_list, default=[256], help="lookup_dot's widths Dp (V2's run script: 256)")
    add(
        "--own-shape-only",
        action="store_true",
        help="lookup_reduce at each shape's own (E, h) only, not also E = h = 1",
    )
    add("--quick", action="store_true", help=f"{MODES['quick'][1]} rows, tokens {MODES['quick'][0]} (CPU default)")
    add("--smoke", action="store_true", help=f"151M only, {MODES['smoke'][1]} rows, tokens {MODES['smoke'][0]}")
    args = cli.resolve(parser.parse_args(argv), DEFAULT_NAME)
    args.mode = "smoke" if args.smoke else "quick" if args.quick or args.device.type == "cpu" else "full"
    tokens, rows, iters, args.copy_bytes = MODES[args.mode]
    args.tokens, args.rows, args.iters = args.tokens or tokens, args.rows or rows, args.iters or iters
    args.configs = ["151m"] if args.smoke else args.configs
    cli.at_least(args, iters=1)
    if (
        "quantized_lookup_reduce" in args.ops
        and args.device.type == "cpu"
        and os.environ.get("TRITON_INTERPRET") != "1"
    ):
        raise SystemExit(
            "--ops quantized_lookup_reduce on CPU runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1"
        )
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    copy_gbps = timing.copy_bandwidth_gbps(args.device, args.copy_bytes, args.iters)
    payload = {"copy_gbps": copy_gbps, "mode": args.mode, "ops": args.ops,
               "num_rows": {size: memory_shape(size, args.rows).num_rows for size in args.configs},
               "triton": "measured" if compiled_triton() else "interpreted or absent: only the ops that need it run it",
               "complete": False, "results": [], "summary": []}  # fmt: skip
    rows: list[dict[str, Any]] = []
    for name in args.ops:
        for size in args.configs:
            for dtype in args.dtypes:
                rows += OPS[name](Case(memory_shape(size, args.rows), dtype, args, copy_gbps))
                payload.update(results=rows, summary=summary(rows))
                report.save(args, payload)  # a run cut short keeps what it measured
    payload["complete"] = True
    if not args.no_plot:
        plot(rows, args, f"{env.device_name(args.device)} ({args.mode}), copy {copy_gbps:.0f} GB/s")
    tables = [report.format_table(payload["summary"], list(payload["summary"][0]))] if payload["summary"] else []
    for name in args.ops:
        mine = [r for r in rows if r["op"] == name]
        tables.append(report.format_table(mine, list(dict.fromkeys(k for r in mine for k in r))))
    report.finish(args, payload, f"copy bandwidth {copy_gbps:.1f} GB/s\n\n" + "\n\n".join(tables))
    return payload


if __name__ == "__main__":
    main()
