"""Memory parallelism on CPU (gloo): bytes each rank sends per lookup, measured and predicted by the paper's
formulas, and the step time of number-wise (pooling at the source or the owner) and dimension-wise stores.

    OMP_NUM_THREADS=1 python benchmarks/bench_memory_parallel.py            # P = 1, 2, 4; plot + JSON
    OMP_NUM_THREADS=1 python benchmarks/bench_memory_parallel.py --large    # + a table too big to replicate

A step is one lookup-reduce forward and backward of one memory layer for `--tokens` tokens per rank, K = H*m
uniform random slots per token. `--large` trains a sharded table (and its AdamW state) on 4 processes whose
replicated copies would not fit this machine, and reports each rank's peak resident memory.
Writes benchmarks/results/memory_parallel_cpu.json and .png.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lib import cli, report, timing

from ultramem.memory_implementations import TORCH_MEMORY_OPS
from ultramem.parallel import count_bytes
from ultramem.parallel.setup import memory_parallel_mesh
from ultramem.parallel.volume import VOLUMES, LookupShape
from ultramem.value_stores import VALUE_STORES

STORES = {"number": ("number", {"pool_at": "source"}), "number_owner": ("number", {"pool_at": "owner"}),
          "dimension": ("dimension", {})}  # fmt: skip


def _store(key: str, rows: int, value_dim: int, mesh, std: float = 0.02):
    """A sharded store built from a random local shard: no rank ever allocates the whole table."""
    name, options = STORES[key]
    cls = VALUE_STORES[name]
    local_shape = [rows, value_dim]
    local_shape[cls.shard_dim] //= mesh.size(1)
    return cls.from_local(torch.randn(local_shape) * std, mesh, **options)


def _lookups(shape: LookupShape, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    indices = torch.randint(0, rows, (shape.tokens, shape.slots))
    groups = torch.randint(0, shape.num_groups, (shape.tokens, shape.slots))
    return indices, groups, torch.randn(shape.tokens, shape.slots, shape.num_cores, requires_grad=True)


def measure(args: argparse.Namespace, mesh) -> list[dict]:
    """Median step time and bytes sent per partitioning and value dim on this rank."""
    size, found = mesh.size(1), []
    for value_dim in args.value_dims:
        shape = LookupShape(args.tokens, args.slots, value_dim, args.cores, args.groups)
        for key in STORES:
            store, lookups, counted = _store(key, args.rows, value_dim, mesh), [], {}

            def step() -> None:
                with count_bytes() as sent:
                    pooled = store(*lookups[-1], shape.num_groups, TORCH_MEMORY_OPS)
                    counted["forward"] = sum(sent.values())
                    pooled.square().sum().backward()
                counted["step"] = sum(sent.values())

            def new_lookups() -> None:  # fresh random slots every step, drawn untimed; ranks start together
                lookups.append(_lookups(shape, args.rows))
                dist.barrier()

            wall, _ = timing.time_calls(step, torch.device("cpu"), 0, args.steps + 1, before_each=new_lookups)
            found.append({
                "P": size, "value_dim": value_dim, "partitioning": key, "step_seconds": statistics.median(wall[1:]) / 1e3,
                "forward_bytes": counted["forward"], "step_bytes": counted["step"],
                "predicted_forward_bytes": sum(VOLUMES[key](shape, size).values()),
            })  # fmt: skip
    return found


def train_large(args: argparse.Namespace, mesh) -> dict:
    """AdamW on a number-wise sharded table too big to replicate; peak resident memory of this rank."""
    store = _store("number", args.large_rows, args.large_value_dim, mesh)
    optimizer = torch.optim.AdamW(store.parameters(), lr=1e-3)
    shape = LookupShape(args.tokens, args.slots, args.large_value_dim, args.cores, args.groups)
    start = time.perf_counter()
    for _ in range(args.large_steps):
        pooled = store(*_lookups(shape, args.large_rows), shape.num_groups, TORCH_MEMORY_OPS)
        pooled.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    table_bytes = args.large_rows * args.large_value_dim * 4
    return {
        "rows": args.large_rows, "value_dim": args.large_value_dim, "P": mesh.size(1),
        "table_gib": table_bytes / 2**30, "replicated_weight_grad_adamw_gib_all_ranks": 4 * table_bytes * mesh.size(1) / 2**30,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "seconds_per_step": (time.perf_counter() - start) / args.large_steps,
    }  # fmt: skip


def worker(rank: int, world: int, init: str, args: argparse.Namespace, out: str, large: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    mesh = memory_parallel_mesh(world)
    result = train_large(args, mesh) if large else measure(args, mesh)
    report.write_json(Path(out, f"rank{rank}.json"), result)
    dist.destroy_process_group()


def launch(world: int, args: argparse.Namespace, large: bool = False) -> list:
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(worker, args=(world, f"{folder}/init", args, folder, large), nprocs=world)
        return [json.loads(Path(folder, f"rank{rank}.json").read_text()) for rank in range(world)]


def plot(rows: list[dict], args: argparse.Namespace, path: Path) -> None:
    """Like the paper's figure: number / dimension volume over P and value dim (ratio 1 marked), plus the
    measured bytes against the predicted ones."""
    sizes, dims = list(range(2, 65)), [2**k for k in range(4, 12)]
    volume = lambda key, d, p: sum(
        VOLUMES[key](LookupShape(args.tokens, args.slots, d, args.cores, args.groups), p).values()
    )  # noqa: E731
    ratio = [[volume("number", d, p) / volume("dimension", d, p) for p in sizes] for d in dims]

    def contours(axis) -> None:
        axis.figure.colorbar(axis.contourf(sizes, dims, ratio, levels=20, cmap="coolwarm"), ax=axis)
        axis.contour(sizes, dims, ratio, levels=[1.0], colors="black")

    measured = {key: ([r["predicted_forward_bytes"] for r in rows if r["partitioning"] == key and r["P"] > 1],
                      [r["forward_bytes"] for r in rows if r["partitioning"] == key and r["P"] > 1]) for key in STORES}  # fmt: skip
    limit = max(row["forward_bytes"] for row in rows) * 1.1
    report.plot(path, [
        report.Panel(f"number / dimension bytes (K={args.slots}, h={args.cores}, E={args.groups})", "value dim",
                     xlabel="P (shard group size)", xlog=False, ylog=True, draw=contours),
        report.Panel("measured vs paper formulas", "measured", measured, xlabel="predicted bytes / rank / forward",
                     linestyle="none", xlog=False, ylog=True, draw=lambda axis: (axis.set_xscale("log"), axis.plot([1, limit], [1, limit], color="gray", lw=0.8))),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = cli.make_parser(__doc__, "memory_parallel_cpu", device=False, timed=False)
    add = parser.add_argument
    add("--sizes", type=cli.int_list, default=[1, 2, 4], help="shard group sizes P, comma-separated")
    add("--value-dims", type=cli.int_list, default=[64, 256], help="comma-separated")
    add("--rows", type=int, default=1 << 16)
    add("--tokens", type=int, default=512, help="tokens per rank and step")
    add("--slots", type=int, default=32, help="K = memory heads x top-m")
    add("--cores", type=int, default=2)
    add("--groups", type=int, default=4)
    add("--steps", type=int, default=5)
    add("--large", action="store_true", help="also train a table too big to replicate on 4 processes")
    add("--large-rows", type=int, default=1_600_000)
    add("--large-value-dim", type=int, default=256)
    add("--large-steps", type=int, default=3)
    args = cli.resolve(parser.parse_args(argv), "memory_parallel_cpu")
    cli.at_least(
        args, rows=1, tokens=1, slots=1, cores=1, groups=1, steps=1, large_rows=1, large_value_dim=1, large_steps=1
    )
    rows = [row for size in args.sizes for row in launch(size, args)[0]]  # rank 0's view (ranks are symmetric)
    for row in rows:
        row["ms_per_step"] = 1000 * row["step_seconds"]
    settings = {key: value for key, value in vars(args).items() if key not in ("name", "results_dir", "no_plot")}
    payload = {"arguments": settings, "rows": rows, **({"large": launch(4, args, large=True)} if args.large else {})}
    if not args.no_plot:
        plot(rows, args, args.results_dir / f"{args.name}.png")
    columns = {"P": "P", "value_dim": "Dv", "partitioning": "partitioning", "forward_bytes": "fwd bytes",
               "predicted_forward_bytes": "predicted", "step_bytes": "step bytes", "ms_per_step": "ms/step"}  # fmt: skip
    large = "".join(f"\nlarge rank {rank}: {entry}" for rank, entry in enumerate(payload.get("large", [])))
    report.finish(args, payload, report.format_table(rows, columns) + large)


if __name__ == "__main__":
    main()
