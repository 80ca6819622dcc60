"""Bandwidth of the Triton lookup-reduce over quantized value tables (int8, int4) against the bf16 kernel.

    python benchmarks/bench_quantized_kernel.py --device cuda [--configs 680m 1.6b] [--tokens 1024 4096 16384]
    TRITON_INTERPRET=1 python benchmarks/bench_quantized_kernel.py --smoke    # CPU, Triton's interpreter, tiny sizes

At each of the paper's UltraMem-x12 memory shapes (slots H*m, Dv, E, h from `ultramem.presets`; `--rows` physical
rows, 2^20 by default: far beyond L2, so every row comes from device memory) and token count, times the forward of
`kernels.lookup_reduce` on a bf16 table and of `kernels.quantized_lookup.quantized_lookup_reduce` on the int8 (one
group per MCS chunk) and int4 (64-column groups) tables, L2 flushed before each call. A row read is its stored
bytes (bf16 2 Dv, int8 G (g + 8), int4 G (g/2 + 4)) per selected slot; `row_gbps` is those bytes over the forward's
time, `values_per_ns` the pooled table elements per ns (the same work in every format), `speedup_vs_bf16` the bf16
forward's time over this one's. The quantized kernels' score backward (frozen tables) is timed too. Each quantized
forward is checked against the dequantize-then-pool reference at the first token count (`max_relative_error`). Writes
`<out-dir>/bench_quantized_kernel_<device>.json` (rewritten after every row) and prints the table.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from lib import env, report, timing

from ultramem import kernels
from ultramem.kernels._device import interpreting
from ultramem.kernels.quantized_lookup import quantized_lookup_reduce
from ultramem.presets import get_config
from ultramem.quantized import lookup_reduce_quantized_reference, quantize
from ultramem.quantized.format import resolve_group_size

PRESETS = {"151m": "ultramem-151m-x12", "680m": "ultramem-680m-x12", "1.6b": "ultramem-1.6b-x12"}
FORMATS = ("bf16", "int8", "int4")
TOKENS = [256, 1024, 4096, 16384]
SMOKE = dict(configs=["151m"], rows=1024, tokens=[1, 8], repeats=1)
QUANTIZED_ROWS = 65_536  # distinct quantized rows made on the CPU, tiled to --rows on the device (contents do not
# change the kernels' speed; quantizing 2^20 x 1024 floats on the host would take longer than the measurement)


@dataclass
class Row:
    config: str
    format: str
    group_size: int | None
    tokens: int
    row_bytes: int
    forward_ms: float
    row_gbps: float
    values_per_ns: float
    speedup_vs_bf16: float | None = None
    score_backward_ms: float | None = None
    max_relative_error: float | None = None


def tables(config: str, num_rows: int, device: torch.device) -> dict[str, tuple[torch.Tensor, int | None]]:
    """format -> (table on `device`, group size): bf16 (N, Dv), int8 and int4 (N, quantized width) uint8."""
    c = get_config(PRESETS[config])
    generator = torch.Generator().manual_seed(0)
    distinct = torch.randn(min(num_rows, QUANTIZED_ROWS), c.memory_value_dim, generator=generator)
    repeats = -(-num_rows // distinct.shape[0])
    made = {"bf16": (distinct.to(device, torch.bfloat16).repeat(repeats, 1)[:num_rows], None)}
    for format in ("int8", "int4"):
        group_size = resolve_group_size(format, c.memory_value_dim, c.mcs_cores)
        quantized = quantize(distinct, format, c.mcs_cores, group_size).to(device)
        made[format] = (quantized.repeat(repeats, 1)[:num_rows], group_size)
    return made


def lookup_inputs(config: str, tokens: int, num_rows: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """rows, groups (T, H*m), scores (T, H*m, h) bf16, grad_out (T, E, Dv) float32, uniform over the rows."""
    c = get_config(PRESETS[config])
    slots = c.memory_heads * c.memory_topk
    generator = torch.Generator(device=device).manual_seed(tokens)
    rows = torch.randint(0, num_rows, (tokens, slots), device=device, generator=generator)
    groups = torch.randint(0, c.ive_expansion, (tokens, slots), device=device, generator=generator)
    scores = torch.randn(tokens, slots, c.mcs_cores, device=device, generator=generator).to(torch.bfloat16)
    grad_out = torch.randn(tokens, c.ive_expansion, c.memory_value_dim, device=device, generator=generator)
    return rows, groups, scores, grad_out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def measure(
    config: str, tokens_list: list[int], num_rows: int, device: torch.device, repeats: int, on_row=None
) -> list[Row]:
    """Rows of the table above for one memory shape; `on_row(rows)` is called after each (to save partial results)."""
    c = get_config(PRESETS[config])
    num_groups = c.ive_expansion
    made = tables(config, num_rows, device)
    results: list[Row] = []
    for tokens in tokens_list:
        rows, groups, scores, grad_out = lookup_inputs(config, tokens, num_rows, device)
        bf16_ms = None
        for format in FORMATS:
            table, group_size = made[format]
            if format == "bf16":
                forward = lambda: kernels.lookup_reduce(table, rows, groups, scores, num_groups)  # noqa: E731
            else:
                forward = lambda: quantized_lookup_reduce(  # noqa: E731
                    table, rows, groups, scores, num_groups, format, group_size
                )
            with torch.no_grad():
                forward_ms = timing.median_ms(forward, device, repeats)
            row_bytes = table.shape[1] * table.element_size()
            row = Row(config, format, group_size, tokens, row_bytes, forward_ms,
                      row_gbps=tokens * rows.shape[1] * row_bytes / forward_ms / 1e6,
                      values_per_ns=tokens * rows.shape[1] * c.memory_value_dim / forward_ms / 1e6)  # fmt: skip
            if format == "bf16":
                bf16_ms = forward_ms
            else:
                row.speedup_vs_bf16 = bf16_ms / forward_ms
                leaf = scores.clone().requires_grad_(True)
                out = quantized_lookup_reduce(table, rows, groups, leaf, num_groups, format, group_size)
                row.score_backward_ms = timing.median_ms(
                    lambda: torch.autograd.grad(out, leaf, grad_out, retain_graph=True), device, repeats
                )
                if tokens == tokens_list[0]:
                    expected = lookup_reduce_quantized_reference(
                        table, rows, groups, scores, num_groups, format, group_size
                    )
                    row.max_relative_error = relative_error(out.detach(), expected)
            results.append(row)
            if on_row is not None:
                on_row(results)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--smoke", action="store_true", help=f"CPU check of the script: {SMOKE} (TRITON_INTERPRET=1)")
    parser.add_argument("--configs", nargs="+", default=["680m"], choices=list(PRESETS))
    parser.add_argument("--tokens", nargs="+", type=int, default=TOKENS, help="token counts")
    parser.add_argument("--rows", type=int, default=1 << 20, help="physical rows of every table")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per measurement (median reported)")
    parser.add_argument("--out-dir", type=Path, default=env.RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.smoke:
        args.device = "cpu"
        for name, value in SMOKE.items():
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible; use --device cpu with TRITON_INTERPRET=1")
    if device.type == "cpu" and not interpreting():
        raise SystemExit("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    path = args.out_dir / f"bench_quantized_kernel_{env.device_tag(device)}.json"
    payload = {"environment": env.environment(device), "rows": args.rows, "complete": False, "results": []}
    results: list[Row] = []

    def save(partial: list[Row]) -> None:
        payload["results"] = [asdict(r) for r in results + partial]
        report.write_json(path, payload)

    for config in args.configs:
        results += measure(config, args.tokens, args.rows, device, args.repeats, on_row=save)
        timing.release(device)
    payload["complete"] = True
    save([])
    print(f"device: {payload['environment']['device']}  wrote {path}")
    print(report.format_table([asdict(r) for r in results], list(asdict(results[0]))))
    return results


if __name__ == "__main__":
    main()
