"""Decoding latency of dense, UltraMem and MoE models of equal compute (paper Figure 1 b/c).

One decoding step (sequence length 1) with a KV cache of 2048 tokens, random weights, for each batch size up
to the largest that fits. The three models at a size are this project's dense backbone (`dense-*`), UltraMem
(`ultramem-*-x12`) and Transformers' `MixtralForCausalLM` (`moe-*-2inN`, parameters and FLOPs matched, see
docs/DECISIONS.md) on its fastest expert path. All three use the same StaticCache, SDPA attention and execution mode
(`--mode compile`: torch.compile(mode="reduce-overhead"), i.e. CUDA graphs; or `--mode eager`). Beside each
time the paper's analytic memory access is printed (section "Why UltraMem instead of MoE").

H100 / H200 (bf16, CUDA graphs; the 1.6B models at batch 64 need ~80 GB with the KV cache, i.e. an H200):

    python benchmarks/bench_decode.py --device cuda --sizes 680m,1.6b

CPU (tiny presets, float32, eager; a few minutes on 2 cores):

    OMP_NUM_THREADS=2 python benchmarks/bench_decode.py --device cpu --sizes tiny --batch-sizes 1,4,16,64

For a ratio on a machine whose speed drifts (shared cores), `--interleave` times the three models' steps in turn:

    OMP_NUM_THREADS=1 python benchmarks/bench_decode.py --device cpu --sizes tiny --batch-sizes 1 --interleave --iters 300

Writes benchmarks/results/decode_<device>.json and .png; the table is printed last.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from transformers import PreTrainedModel

import _common as common

DEFAULT_NAME = "decode"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.make_parser(__doc__, DEFAULT_NAME, decode=True)
    parser.add_argument("--sizes", type=common.parse_sizes, default=None, help="680m,1.6b on CUDA; tiny on CPU")
    parser.add_argument(
        "--batch-sizes",
        type=common.parse_int_list,
        default=None,
        help="1,2,...,1024 on CUDA (stops at the first out-of-memory); 1,4,16 on CPU",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="hold the three models of a size at once and time their steps in turn (one step of each per round), "
        "so machine drift does not enter their ratios; for CPU runs, or sizes whose models fit the device together",
    )
    parser.add_argument(
        "--analytic-sizes",
        type=common.parse_sizes,
        default=["680m", "1.6b"],
        help="sizes whose analytic memory access is tabulated (meta device, nothing timed)",
    )
    args = parser.parse_args(argv)
    common.resolve_common(args, DEFAULT_NAME)
    common.resolve_decode(args)
    cuda = args.device.type == "cuda"
    args.sizes = args.sizes or (["680m", "1.6b"] if cuda else ["tiny"])
    args.batch_sizes = args.batch_sizes or ([2**i for i in range(11)] if cuda else [1, 4, 16])
    return args


def build_peer(size: str, kind: str, args: argparse.Namespace) -> tuple[PreTrainedModel, dict[str, Any]]:
    """The eval-mode model of `kind` at `size` and its description; for MoE, its fastest expert path chosen."""
    preset = common.PEERS[size][kind]
    model = common.build(preset, args.device, args.dtype, **common.decode_overrides(preset, args)).eval()
    info: dict[str, Any] = {"size": size, "kind": kind, "preset": preset}
    if kind == "moe":
        probe_batch = args.batch_sizes[len(args.batch_sizes) // 2]
        with torch.no_grad():
            info["moe_implementation"], info["moe_probe_ms"] = common.choose_moe_implementation(
                model,
                args.moe_impl,
                lambda m: common.time_decode(m, probe_batch, args),
            )
        info["moe_probe_batch"] = probe_batch
    return model, info


def row_of(info: dict[str, Any], model: PreTrainedModel, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """A result row before timing: the model, the batch and the analytic memory access of one step."""
    access = common.decode_memory_access(model, batch, args.context, torch.finfo(args.dtype).bits // 8)
    row: dict[str, Any] = {"size": info["size"], "kind": info["kind"], "batch": batch, "access_gb": access.total / 1e9}
    row.update(sparse_gb=access.sparse_weights / 1e9, kv_gb=access.kv_cache / 1e9)
    return row


def timed(row: dict[str, Any], timing: dict[str, float], info: dict[str, Any]) -> dict[str, Any]:
    """`row` with its timing, and the time printed."""
    row = {**row, **timing, "status": "ok", "gbps": row["access_gb"] / (timing["ms"] / 1e3)}
    print(f"{info['preset']:<20} batch {row['batch']:>5}: {timing['ms']:8.3f} ms  {row['access_gb']:7.3f} GB analytic")
    return row


def bench_model(size: str, kind: str, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Time one model at every batch size (stopping at out-of-memory); returns rows and a description."""
    model, info = build_peer(size, kind, args)
    rows = []
    with torch.no_grad():
        for batch in args.batch_sizes:
            row = row_of(info, model, batch, args)
            try:
                timing = common.time_decode(model, batch, args)
            except RuntimeError as error:
                if not common.is_out_of_memory(error):
                    raise
                rows.append({**row, "status": "out of memory"})
                print(f"{info['preset']} batch {batch}: out of memory, larger batches skipped")
                break
            rows.append(timed(row, timing, info))
            common.release(args.device)
    del model
    common.release(args.device)
    return rows, info


def bench_size_interleaved(size: str, args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`--interleave`: the three models of `size` held at once, their steps timed in turn at every batch size."""
    peers = {kind: build_peer(size, kind, args) for kind in ("dense", "ultramem", "moe")}
    rows = []
    with torch.no_grad():
        for batch in args.batch_sizes:
            steps = {kind: common.decode_step(model, batch, args) for kind, (model, _) in peers.items()}
            timings = common.measure_interleaved(steps, args)
            for kind, (model, info) in peers.items():
                timing = {**timings[kind], **common.count_launches(steps[kind], args.device)}
                rows.append(timed(row_of(info, model, batch, args), timing, info))
    infos = [info for _, info in peers.values()]
    del peers, steps
    common.release(args.device)
    return rows, infos


def analytic_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The paper's memory-access model at `args.analytic_sizes` for every batch size, from meta-device models."""
    bytes_per_value = torch.finfo(args.dtype).bits // 8
    rows = []
    for size in args.analytic_sizes:
        access = {}
        for kind, preset in common.PEERS[size].items():
            model = common.build(preset, torch.device("meta"), args.dtype)
            access[kind] = {
                b: common.decode_memory_access(model, b, args.context, bytes_per_value) for b in args.batch_sizes
            }
        for batch in args.batch_sizes:
            dense, ultramem, moe = (access[kind][batch] for kind in ("dense", "ultramem", "moe"))
            weights = {kind: access[kind][batch].total - access[kind][batch].kv_cache for kind in access}
            rows.append(
                {
                    "size": size,
                    "batch": batch,
                    "kv_gb": dense.kv_cache / 1e9,
                    "dense_gb": dense.total / 1e9,
                    "ultramem_gb": ultramem.total / 1e9,
                    "moe_gb": moe.total / 1e9,
                    "ultramem/dense": ultramem.total / dense.total,
                    "moe/ultramem": moe.total / ultramem.total,
                    "weights moe/ultramem": weights["moe"] / weights["ultramem"],
                }
            )
    return rows


ANALYTIC_COLUMNS = [
    ("size", "size"),
    ("batch", "batch"),
    ("kv_gb", "KV GB"),
    ("dense_gb", "dense GB"),
    ("ultramem_gb", "ultramem GB"),
    ("moe_gb", "moe GB"),
    ("ultramem/dense", "U/D"),
    ("moe/ultramem", "M/U"),
    ("weights moe/ultramem", "M/U weights only"),
]


def ratio_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (size, batch): the three times, the issue's ratios, and the analytic-access ratios."""
    by_key = {(r["size"], r["batch"], r["kind"]): r for r in rows}
    table = []
    for size, batch in sorted(
        {(r["size"], r["batch"]) for r in rows}, key=lambda k: (list(common.PEERS).index(k[0]), k[1])
    ):
        get = {kind: by_key.get((size, batch, kind), {}) for kind in ("dense", "ultramem", "moe")}
        ms = {kind: get[kind].get("ms") for kind in get}
        gb = {kind: get[kind].get("access_gb") for kind in get}
        ops = {kind: get[kind].get("aten_ops") for kind in get}
        table.append(
            {
                "size": size,
                "batch": batch,
                "dense_ms": ms["dense"],
                "ultramem_ms": ms["ultramem"],
                "moe_ms": ms["moe"],
                "ultramem/dense": ms["ultramem"] / ms["dense"] if ms["ultramem"] and ms["dense"] else None,
                "moe/ultramem": ms["moe"] / ms["ultramem"] if ms["moe"] and ms["ultramem"] else None,
                "dense_gb": gb["dense"],
                "ultramem_gb": gb["ultramem"],
                "moe_gb": gb["moe"],
                "analytic moe/ultramem": gb["moe"] / gb["ultramem"] if gb["moe"] and gb["ultramem"] else None,
                "dense_ops": ops["dense"],
                "ultramem_ops": ops["ultramem"],
                "moe_ops": ops["moe"],
            }
        )
    return table


TABLE_COLUMNS = [
    ("size", "size"),
    ("batch", "batch"),
    ("dense_ms", "dense ms"),
    ("ultramem_ms", "ultramem ms"),
    ("moe_ms", "moe ms"),
    ("ultramem/dense", "U/D"),
    ("moe/ultramem", "M/U"),
    ("dense_gb", "dense GB"),
    ("ultramem_gb", "ultramem GB"),
    ("moe_gb", "moe GB"),
    ("analytic moe/ultramem", "M/U analytic"),
    ("dense_ops", "D ops"),
    ("ultramem_ops", "U ops"),
    ("moe_ops", "M ops"),
]


def plot(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    panels = []
    for size in args.sizes:
        for title, key, ylabel in (("decode time", "ms", "ms / step"), ("memory access", "access_gb", "GB / step")):
            series = {}
            for kind in ("dense", "ultramem", "moe"):
                points = [r for r in rows if r["size"] == size and r["kind"] == kind and r["status"] == "ok"]
                series[kind] = ([r["batch"] for r in points], [r[key] for r in points])
            panels.append((f"{size}: {title}", ylabel, series))
    common.plot_panels(args, panels, "batch size", f"decode step, KV cache {args.context}, {args.mode}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(0)
    rows, models = [], []
    for size in args.sizes:
        if args.interleave:
            size_rows, infos = bench_size_interleaved(size, args)
            rows += size_rows
            models += infos
            continue
        for kind in ("dense", "ultramem", "moe"):
            model_rows, info = bench_model(size, kind, args)
            rows += model_rows
            models.append(info)
    table = ratio_rows(rows)
    analytic = analytic_rows(args)
    print(f"\nAnalytic memory access per decode step ({args.dtype}, KV cache {args.context}):")
    print(common.format_table(analytic, ANALYTIC_COLUMNS) + "\n")
    payload = {
        "settings": {
            "sizes": args.sizes,
            "batch_sizes": args.batch_sizes,
            "context": args.context,
            "mode": args.mode,
            "cache": "StaticCache",
            "attention": "sdpa",
            "warmup": args.warmup,
            "iters": args.iters,
            "interleave": args.interleave,
        },
        "analytic_model": (
            "bytes read per step: every dense weight once + B input-embedding rows + KV cache (2*B*context*L*D) + "
            "MoE: min(2B, N_moe) experts per layer; UltraMem: min(B*H*m, N) value rows of Dv per memory layer"
        ),
        "analytic": analytic,
        "models": models,
        "rows": rows,
        "ratios": table,
    }
    if not args.no_plot:
        plot(args, rows)
    common.finish(args, payload, common.format_table(table, TABLE_COLUMNS))
    return payload


if __name__ == "__main__":
    main()
