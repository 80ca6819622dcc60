"""Decoding latency of dense, UltraMem and MoE models of equal compute (paper Figure 1 b/c).

One decoding step (sequence length 1) with a KV cache of 2048 tokens, random weights, for each batch size up
to the largest that fits. The three models at a size are this project's dense backbone (`dense-*`), UltraMem
(`ultramem-*-x12`) and Transformers' `MixtralForCausalLM` (`moe-*-2inN`, parameters and FLOPs matched, see
docs/design.md) on its fastest expert path. All three use the same StaticCache, SDPA attention and execution mode
(`--mode compile`: torch.compile(mode="reduce-overhead"), i.e. CUDA graphs; or `--mode eager`), UltraMem's steps as
`generate` runs them (each memory layer's decode step built once, `UltraMemModel.fixed_weights`). Beside each
time the paper's analytic memory access is printed (`lib.models.decode_memory_access`).

H100 / H200 (bf16, CUDA graphs; the 1.6B models at batch 64 need ~80 GB with the KV cache, i.e. an H200):

    python benchmarks/bench_decode.py --device cuda --sizes 680m,1.6b

CPU (tiny presets, float32, eager; a few minutes on 2 cores):

    OMP_NUM_THREADS=2 python benchmarks/bench_decode.py --device cpu --sizes tiny --batch-sizes 1,4,16,64

For a ratio on a machine whose speed drifts (shared cores), `--interleave` times the three models' steps in turn:

    OMP_NUM_THREADS=1 python benchmarks/bench_decode.py --device cpu --sizes tiny --batch-sizes 1 --interleave --iters 300

Where a step's time goes (issue 34): `--account N` profiles N more steps of every model and batch and splits the
median one into kernel time, copies/memsets, gaps on the device's timeline and the launching call's host time,
per memory layer in eager mode (`lib.step_account` says what a CUDA-graph replay lets one attribute); the rows get
an "account" entry and a table of the split, with UltraMem minus dense part by part, is printed before the last:

    python benchmarks/bench_decode.py --device cuda --sizes 680m --batch-sizes 1,16 --account 20 --name decode_account

`--fused-selection` turns on the Triton path's opt-in one-kernel selection (`ultramem.kernels.fused_selection`) for
the whole run, to time it against a run without.

Writes benchmarks/results/decode_<device>.json and .png; the table is printed last.
"""

from __future__ import annotations

from typing import Any

import torch
from lib import cli, models, report, step_account, timing

from ultramem.kernels import fused_selection

DEFAULT_NAME = "decode"
KINDS = ("dense", "ultramem", "moe")


def parse_args(argv: list[str] | None = None):
    parser = cli.make_parser(__doc__, DEFAULT_NAME, decode=True)
    parser.add_argument("--sizes", type=cli.sizes, default=None, help="680m,1.6b on CUDA; tiny on CPU")
    parser.add_argument("--batch-sizes", type=cli.int_list, default=None,
                        help="1,2,...,1024 on CUDA (stops at the first out-of-memory); 1,4,16 on CPU")  # fmt: skip
    parser.add_argument("--interleave", action="store_true",
                        help="hold the three models of a size at once and time their steps in turn (one step of each "
                        "per round), so machine drift does not enter their ratios")  # fmt: skip
    parser.add_argument("--account", type=int, nargs="?", const=10, default=0, metavar="STEPS",
                        help="also profile STEPS (10 if not given) steps of each model and batch and split them into "
                        "kernels, copies, gaps and host time (see lib.step_account)")  # fmt: skip
    cli.add_fused_selection_argument(parser)
    parser.add_argument("--analytic-sizes", type=cli.sizes, default=["680m", "1.6b"],
                        help="sizes whose analytic memory access is tabulated (meta device, nothing timed)")  # fmt: skip
    args = cli.resolve(parser.parse_args(argv), DEFAULT_NAME)
    cli.at_least(args, account=0)
    cuda = args.device.type == "cuda"
    args.sizes = args.sizes or (["680m", "1.6b"] if cuda else ["tiny"])
    args.batch_sizes = args.batch_sizes or ([2**i for i in range(11)] if cuda else [1, 4, 16])
    return args


def build_peer(size: str, kind: str, args) -> tuple[torch.nn.Module, dict[str, Any]]:
    """`models.build_peer`, MoE's expert path probed at the middle batch size."""
    probe_batch = args.batch_sizes[len(args.batch_sizes) // 2]
    model, info = models.build_peer(size, kind, args, lambda m: models.time_decode(m, probe_batch, args))
    return model, {**info, **({"moe_probe_batch": probe_batch} if kind == "moe" else {})}


def row_of(info: dict[str, Any], model, batch: int, args, timing_: dict[str, float] | None = None) -> dict[str, Any]:
    """A result row: the model, the batch, the analytic memory access of one step, and its timing if given."""
    access = models.decode_memory_access(model, batch, args.context, torch.finfo(args.dtype).bits // 8)
    row = {"size": info["size"], "kind": info["kind"], "batch": batch, "access_gb": access.total / 1e9,
           "sparse_gb": access.sparse_weights / 1e9, "kv_gb": access.kv_cache / 1e9}  # fmt: skip
    if timing_ is not None:
        row.update(timing_, status="ok", gbps=row["access_gb"] / (timing_["ms"] / 1e3))
        print(f"{info['preset']:<20} batch {batch:>5}: {timing_['ms']:8.3f} ms  {row['access_gb']:7.3f} GB analytic")
    return row


def bench_model(size: str, kind: str, args) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Time one model at every batch size (stopping at out-of-memory); returns rows and a description."""
    model, info = build_peer(size, kind, args)
    rows = []
    with torch.no_grad():
        for batch in args.batch_sizes:
            try:
                rows.append(row_of(info, model, batch, args, models.time_decode(model, batch, args, args.account)))
            except RuntimeError as error:
                if not timing.is_out_of_memory(error):
                    raise
                rows.append({**row_of(info, model, batch, args), "status": "out of memory"})
                print(f"{info['preset']} batch {batch}: out of memory, larger batches skipped")
                break
            timing.release(args.device)
    del model
    timing.release(args.device)
    return rows, info


def bench_size_interleaved(size: str, args) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`--interleave`: the three models of `size` held at once, their steps timed in turn at every batch size."""
    peers = {kind: build_peer(size, kind, args) for kind in KINDS}
    rows = []
    with torch.no_grad(), models.as_generate_runs(*(model for model, _ in peers.values())):
        for batch in args.batch_sizes:
            steps = {kind: models.decode_step(model, batch, args) for kind, (model, _) in peers.items()}
            times = timing.measure_interleaved(steps, args.device, args.warmup, args.iters, args.statistic)
            for kind, (model, info) in peers.items():
                launches = timing.count_launches(steps[kind], args.device)
                account = models.account_decode(model, steps[kind], args, args.account)
                rows.append(row_of(info, model, batch, args, {**times[kind], **launches, **account}))
    infos = [info for _, info in peers.values()]
    del peers, steps
    timing.release(args.device)
    return rows, infos


def analytic_rows(args) -> list[dict[str, Any]]:
    """The paper's memory-access model at `args.analytic_sizes` for every batch size, from meta-device models."""
    rows = []
    for size in args.analytic_sizes:
        metas = {kind: models.build(preset, "meta", args.dtype) for kind, preset in models.PEERS[size].items()}
        for batch in args.batch_sizes:
            access = {
                k: models.decode_memory_access(m, batch, args.context, torch.finfo(args.dtype).bits // 8)
                for k, m in metas.items()
            }
            gb = {kind: a.total / 1e9 for kind, a in access.items()}
            weights = {kind: a.total - a.kv_cache for kind, a in access.items()}
            rows.append({"size": size, "batch": batch, "kv_gb": access["dense"].kv_cache / 1e9, "dense_gb": gb["dense"],
                         "ultramem_gb": gb["ultramem"], "moe_gb": gb["moe"], "ultramem/dense": gb["ultramem"] / gb["dense"],
                         "moe/ultramem": gb["moe"] / gb["ultramem"],
                         "weights moe/ultramem": weights["moe"] / weights["ultramem"]})  # fmt: skip
    return rows


def ratio_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (size, batch): the three times, the issue's ratios, and the analytic-access ratios."""
    by_key = {(r["size"], r["batch"], r["kind"]): r for r in rows}
    table = []
    for size, batch in sorted(
        {(r["size"], r["batch"]) for r in rows}, key=lambda k: (list(models.PEERS).index(k[0]), k[1])
    ):
        get = {kind: by_key.get((size, batch, kind), {}) for kind in KINDS}
        row = {"size": size, "batch": batch}
        row.update({f"{kind}_ms": get[kind].get("ms") for kind in KINDS})
        row.update(
            {
                "ultramem/dense": models.ratio(row["ultramem_ms"], row["dense_ms"]),
                "moe/ultramem": models.ratio(row["moe_ms"], row["ultramem_ms"]),
            }
        )
        row.update({f"{kind}_gb": get[kind].get("access_gb") for kind in KINDS})
        row["analytic moe/ultramem"] = models.ratio(row["moe_gb"], row["ultramem_gb"])
        row.update({f"{kind}_ops": get[kind].get("aten_ops") for kind in KINDS})
        table.append(row)
    return table


ANALYTIC_COLUMNS = {"size": "size", "batch": "batch", "kv_gb": "KV GB", "dense_gb": "dense GB", "ultramem_gb": "ultramem GB",
                    "moe_gb": "moe GB", "ultramem/dense": "U/D", "moe/ultramem": "M/U",
                    "weights moe/ultramem": "M/U weights only"}  # fmt: skip
TABLE_COLUMNS = {"size": "size", "batch": "batch", "dense_ms": "dense ms", "ultramem_ms": "ultramem ms", "moe_ms": "moe ms",
                 "ultramem/dense": "U/D", "moe/ultramem": "M/U", "dense_gb": "dense GB", "ultramem_gb": "ultramem GB",
                 "moe_gb": "moe GB", "analytic moe/ultramem": "M/U analytic", "dense_ops": "D ops",
                 "ultramem_ops": "U ops", "moe_ops": "M ops"}  # fmt: skip


def account_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The accounted split of every row that has one, and after each (size, batch) UltraMem minus dense."""
    table = []
    for size, batch in dict.fromkeys((r["size"], r["batch"]) for r in rows if "account" in r):
        split = {r["kind"]: r["account"] for r in rows if (r["size"], r["batch"]) == (size, batch) and "account" in r}
        table += [{"size": size, "batch": batch, "kind": kind, **split[kind]} for kind in KINDS if kind in split]
        if "ultramem" in split and "dense" in split:
            difference = step_account.difference(split["ultramem"], split["dense"])
            table.append({"size": size, "batch": batch, "kind": "U - D", **difference})
    return table


ACCOUNT_COLUMNS = {"size": "size", "batch": "batch", "kind": "kind", "step_ms": "step ms", "kernel_ms": "kernels",
                   "copy_ms": "copies", "gap_ms": "gaps", "gap_before_ms": "gap before", "gap_between_ms": "between",
                   "gap_after_ms": "after", "host_ms": "host", "host_runtime_ms": "host runtime",
                   "memory_device_ms": "memory kernels", "memory_host_ms": "memory host"}  # fmt: skip


def plot(args, rows: list[dict[str, Any]]) -> None:
    panels = []
    for size in args.sizes:
        for title, key, ylabel in (("decode time", "ms", "ms / step"), ("memory access", "access_gb", "GB / step")):
            ok = [r for r in rows if r["size"] == size and r["status"] == "ok"]
            series = {
                kind: ([r["batch"] for r in ok if r["kind"] == kind], [r[key] for r in ok if r["kind"] == kind])
                for kind in KINDS
            }
            panels.append(report.Panel(f"{size}: {title}", ylabel, series, xlabel="batch size"))
    report.plot(args.results_dir / f"{args.name}.png", panels, f"decode step, KV cache {args.context}, {args.mode}")


def bench_sizes(args) -> tuple[list[dict], list[dict]]:
    """Every size's rows and model descriptions, saved after each model should the run be cut short."""
    rows, infos = [], []
    for size in args.sizes:
        if args.interleave:
            size_rows, size_infos = bench_size_interleaved(size, args)
        else:
            size_rows, size_infos = [], []
            for kind in KINDS:
                model_rows, info = bench_model(size, kind, args)
                size_rows, size_infos = size_rows + model_rows, size_infos + [info]
                report.save(args, {"complete": False, "rows": rows + size_rows})
        rows += size_rows
        infos += size_infos
    return rows, infos


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(0)
    with fused_selection(args.fused_selection):
        rows, infos = bench_sizes(args)
    analytic = analytic_rows(args)
    print(f"\nAnalytic memory access per decode step ({args.dtype}, KV cache {args.context}):")
    print(report.format_table(analytic, ANALYTIC_COLUMNS) + "\n")
    settings = {"sizes": args.sizes, "batch_sizes": args.batch_sizes, "context": args.context, "mode": args.mode,
                "cache": "StaticCache", "attention": "sdpa", "warmup": args.warmup, "iters": args.iters,
                "interleave": args.interleave, "account_steps": args.account,
                "fused_selection": args.fused_selection}  # fmt: skip
    payload = {
        "settings": settings,
        "analytic_model": "lib.models.decode_memory_access: bytes read per step = every dense weight once + B "
        "input-embedding rows + KV cache (2*B*context*L*D) + MoE: min(2B, N_moe) experts per layer; UltraMem: "
        "min(B*H*m, N) value rows of Dv per memory layer",
        "analytic": analytic,
        "models": infos,
        "rows": rows,
        "ratios": ratio_rows(rows),
        "complete": True,
    }
    if args.account:
        payload["account"] = account_rows(rows)
        print(f"\nWhere a step's time goes (ms; median of {args.account} profiled steps, {args.mode}):")
        print(report.format_table(payload["account"], ACCOUNT_COLUMNS) + "\n")
    if not args.no_plot:
        plot(args, rows)
    report.finish(args, payload, report.format_table(payload["ratios"], TABLE_COLUMNS))
    return payload


if __name__ == "__main__":
    main()
