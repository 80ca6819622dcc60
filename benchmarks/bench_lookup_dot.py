"""Benchmark of `lookup_dot` (PEER's gate, UltraMemV2 Eq. 15): the PyTorch reference vs embedding_bag vs Triton.

On an H100 / H200 (seconds; writes benchmarks/results/bench_lookup_dot_<device>.{json,png}):

    python benchmarks/bench_lookup_dot.py --device cuda --configs 680m --pre-value-dims 256 --tokens 4096 16384 65536

out[t, k] = <pre_values[rows[t, k]], query[t]> at each UltraMem-x12 configuration's slots per token (heads x top-m)
and physical rows, for pre-value widths Dp: forward, backward (table and query gradients) and forward+backward ms,
and forward bandwidth (gathered rows, indices, queries, output) against a measured device-to-device copy, with
`bench_kernels.py`'s timer and report. The JSON's `summary` reads Triton's forward as % of copy and its
forward+backward speed-up over the PyTorch path and embedding_bag at >= 4,096 tokens.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict
from pathlib import Path

import torch
from bench_kernels import (
    PRESETS,
    QUICK_ROWS,
    QUICK_TOKENS,
    SMOKE_ROWS,
    SMOKE_TOKENS,
    TOKENS,
    MemoryShape,
    Result,
    lookup_impls,
    memory_shape,
    plot,
    summary,
    time_lookup,
)
from lib import env, report, timing

from ultramem import kernels


def lookup_dot_bytes(shape: MemoryShape, tokens: int, dim: int, element: int) -> int:
    """Bytes a lookup_dot must move: gathered rows, rows (int64), queries, output."""
    slots = tokens * shape.slots
    return slots * dim * element + slots * 8 + tokens * dim * element + slots * element


def bench_lookup_dot(
    shape: MemoryShape,
    dim: int,
    dtype: torch.dtype,
    tokens_list: list[int],
    device: torch.device,
    copy_gbps: float,
    repeats: int,
    interpreted: bool,
) -> list[Result]:
    table = torch.randn(shape.num_rows, dim, device=device, dtype=dtype).requires_grad_()
    results = []
    for tokens in tokens_list:
        generator = torch.Generator(device=device).manual_seed(tokens)
        rows = torch.randint(0, shape.num_rows, (tokens, shape.slots), device=device, generator=generator)
        query = torch.randn(tokens, dim, device=device, dtype=dtype).requires_grad_()
        grad_out = torch.randn(tokens, shape.slots, device=device, dtype=dtype)
        num_bytes = lookup_dot_bytes(shape, tokens, dim, table.element_size())
        for impl, fn in lookup_impls(interpreted, "lookup_dot").items():
            config = f"{shape.name} Dp={dim}"
            result = Result("lookup_dot", config, 1, 1, str(dtype).removeprefix("torch."), tokens, impl)
            try:
                timings = time_lookup(fn, (table, rows, query), grad_out, device, repeats, wrt=(0, 2))
                result.forward_ms, result.backward_ms, result.fwd_bwd_ms = timings
                result.forward_gbps = num_bytes / result.forward_ms / 1e6
                result.forward_pct_of_copy = 100 * result.forward_gbps / copy_gbps
            except torch.OutOfMemoryError:
                result.status = "out of memory"
            except (NotImplementedError, RuntimeError) as error:  # embedding_bag has no bf16 CUDA weight backward
                result.status = f"unsupported: {str(error).splitlines()[0][:80]}"
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            results.append(result)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--smoke", action="store_true", help=f"151M only, {SMOKE_ROWS} rows, tokens {SMOKE_TOKENS}")
    parser.add_argument("--configs", nargs="+", default=["680m"], choices=list(PRESETS))
    parser.add_argument("--pre-value-dims", nargs="+", type=int, default=[256], help="Dp (V2's run script: 256)")
    parser.add_argument("--tokens", nargs="+", type=int, help="token counts (overrides the mode's list)")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "float16"],
                        help="table dtypes (default: bfloat16 float32 on CUDA, float32 on CPU)")  # fmt: skip
    parser.add_argument("--repeats", type=int, help="timed calls per measurement (median reported)")
    parser.add_argument("--out-dir", type=Path, default=env.RESULTS_DIR)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible; use --device cpu")
    quick = args.smoke or device.type == "cpu"
    configs = ["151m"] if args.smoke else args.configs
    num_rows = SMOKE_ROWS if args.smoke else (QUICK_ROWS if quick else None)
    tokens_list = args.tokens or (SMOKE_TOKENS if args.smoke else QUICK_TOKENS if quick else TOKENS)
    dtypes = args.dtypes or (["bfloat16", "float32"] if device.type == "cuda" else ["float32"])
    repeats = args.repeats or (1 if args.smoke else 3 if device.type == "cpu" else 20)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"

    copy_gbps = timing.copy_bandwidth_gbps(device, (2**24 if args.smoke else 2**28 if quick else 2**30), repeats)
    path = args.out_dir / f"bench_lookup_dot_{env.device_tag(device)}.json"
    report_ = {
        "environment": env.environment(device),
        "copy_gbps": copy_gbps,
        "mode": "smoke" if args.smoke else "quick" if quick else "full",
        "num_rows": {name: memory_shape(name, num_rows).num_rows for name in configs},
        "triton": "skipped (interpreter only)" if interpreted or not kernels.triton_available() else "measured",
        "complete": False,  # rewritten after each config, width and dtype: a run cut short keeps what it measured
        "results": [],
        "summary": [],
    }
    results: list[Result] = []
    for name in configs:
        shape = memory_shape(name, num_rows)
        for dim in args.pre_value_dims:
            for dtype_name in dtypes:
                dtype = getattr(torch, dtype_name)
                results += bench_lookup_dot(shape, dim, dtype, tokens_list, device, copy_gbps, repeats, interpreted)
                report_.update(results=[asdict(r) for r in results], summary=summary(results, "lookup_dot"))
                report.write_json(path, report_)

    report_["complete"] = True
    report.write_json(path, report_)
    title = f"lookup_dot, {report_['environment']['device']} ({report_['mode']}), copy {copy_gbps:.0f} GB/s"
    plot(results, path.with_suffix(".png"), title, "lookup_dot")
    print(f"device: {report_['environment']['device']}  copy bandwidth: {copy_gbps:.1f} GB/s  wrote {path} and .png")
    if report_["summary"]:
        print(report.format_table(report_["summary"], list(report_["summary"][0])) + "\n")
    print(report.format_table([asdict(r) for r in results], list(asdict(results[0]))))


if __name__ == "__main__":
    main()
