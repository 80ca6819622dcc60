"""Decoding latency as sparse parameters grow at fixed activation (paper Figure 6(c)).

UltraMem keeps its backbone and top-m and grows its physical memory slots (value rows, summed over its memory
layers) from 1M up to the largest that fits; the MoE peer (Transformers' Mixtral, same backbone, top-2) grows
its experts so that its expert parameters equal UltraMem's value parameters at every point (at least 2
experts). The paper uses 1.6B activated parameters, batch 512 and a 2048-token KV cache; a 1.6B model's KV cache
at batch 512 alone is ~270 GB, so the default batch here is 64 (`--batch` to change). Same execution for both
models as bench_decode.py (StaticCache, SDPA, `--mode compile` = CUDA graphs, or eager).

H100 / H200 (bf16; 1M..32M slots, stops at the first out-of-memory):

    python benchmarks/bench_scaling.py --device cuda --size 1.6b --batch 64

CPU (tiny backbone, 16k..256k slots, float32, eager):

    OMP_NUM_THREADS=2 python benchmarks/bench_scaling.py --device cpu

Writes benchmarks/results/scaling_<device>.json and .png; the table is printed last.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lib import cli, models, report, timing

from ultramem.presets import get_config
from ultramem.sizing import count_parameters

DEFAULT_NAME = "scaling"


def parse_args(argv: list[str] | None = None):
    parser = cli.make_parser(__doc__, DEFAULT_NAME, decode=True)
    parser.add_argument(
        "--size", choices=sorted(models.PEERS), default=None, help="backbone: 1.6b on CUDA, tiny on CPU"
    )
    parser.add_argument("--batch", type=int, default=None, help="decoding batch size (64 on CUDA, 4 on CPU)")
    parser.add_argument("--slots", type=cli.int_list, default=None,
                        help="total physical memory slots, summed over memory layers (1M..32M doubling on CUDA, "
                        "16k..256k on CPU)")  # fmt: skip
    args = cli.resolve(parser.parse_args(argv), DEFAULT_NAME)
    cuda = args.device.type == "cuda"
    args.size = args.size or ("1.6b" if cuda else "tiny")
    args.batch = args.batch if args.batch is not None else (64 if cuda else 4)
    cli.at_least(args, batch=1)
    args.slots = args.slots or [2**i * (2**20 if cuda else 2**14) for i in range(6 if cuda else 5)]
    return args


def scaled_overrides(args, slots: int) -> tuple[dict[str, Any], dict[str, Any], int]:
    """UltraMem and MoE overrides for about `slots` total physical values at `args.size`, and the exact count."""
    peers = models.PEERS[args.size]
    ultramem_config = get_config(peers["ultramem"])
    layers = len(ultramem_config.memory_layers)
    knum = max(1, round(math.sqrt(slots / layers)))  # physical values per layer = knum^2
    expansion_side = math.isqrt(ultramem_config.ive_expansion)  # keys per axis = sqrt(E) * knum
    ultramem = dict(memory_num_keys=expansion_side * knum, **models.decode_overrides(peers["ultramem"], args))
    value_params = layers * knum**2 * ultramem_config.memory_value_dim
    moe_config = get_config(peers["moe"])
    expert_params = moe_config.num_hidden_layers * 3 * moe_config.hidden_size * moe_config.intermediate_size
    experts = max(moe_config.num_experts_per_tok, round(value_params / expert_params))
    moe = dict(num_local_experts=experts, **models.decode_overrides(peers["moe"], args))
    return ultramem, moe, layers * knum**2


def bench_point(kind: str, overrides: dict[str, Any], args) -> dict[str, Any]:
    model = models.build(models.PEERS[args.size][kind], args.device, args.dtype, **overrides).eval()
    access = models.decode_memory_access(model, args.batch, args.context, torch.finfo(args.dtype).bits // 8)
    row: dict[str, Any] = {"kind": kind, "total_params_b": count_parameters(model.config)["total"] / 1e9,
                           "access_gb": access.total / 1e9}  # fmt: skip
    with torch.no_grad():
        if kind == "moe":
            row["moe_implementation"], row["moe_probe_ms"] = models.choose_moe_implementation(
                model, args.moe_impl, lambda m: models.time_decode(m, args.batch, args)
            )
        row.update(models.time_decode(model, args.batch, args))
    del model
    timing.release(args.device)
    return row


def table_rows(done: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per point: both models' times, each relative to its first point, and MoE / UltraMem."""
    first = done[0] if done else None
    return [{"slots": p["slots"], "ultramem_params_b": p["ultramem"]["total_params_b"], "ultramem_ms": p["ultramem"]["ms"],
             "ultramem_vs_first": p["ultramem"]["ms"] / first["ultramem"]["ms"], "experts": p["experts"],
             "moe_params_b": p["moe"]["total_params_b"], "moe_ms": p["moe"]["ms"],
             "moe_vs_first": p["moe"]["ms"] / first["moe"]["ms"], "moe/ultramem": p["moe"]["ms"] / p["ultramem"]["ms"]}
            for p in done]  # fmt: skip


COLUMNS = {"slots": "slots", "ultramem_params_b": "U params(B)", "ultramem_ms": "ultramem ms", "ultramem_vs_first": "U/U0",
           "experts": "experts", "moe_params_b": "M params(B)", "moe_ms": "moe ms", "moe_vs_first": "M/M0",
           "moe/ultramem": "M/U"}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(0)
    points: list[dict[str, Any]] = []
    for slots in args.slots:
        ultramem, moe, physical = scaled_overrides(args, slots)
        point: dict[str, Any] = {"slots": slots, "physical_slots": physical,
                                 "memory_num_keys": ultramem["memory_num_keys"], "experts": moe["num_local_experts"]}  # fmt: skip
        try:
            for kind, overrides in (("ultramem", ultramem), ("moe", moe)):
                point[kind] = result = bench_point(kind, overrides, args)
                print(f"slots {slots:>10} {kind:<8}: {result['ms']:8.3f} ms  {result['total_params_b']:.3f} B params")
        except RuntimeError as error:
            if not timing.is_out_of_memory(error):
                raise
            points.append({**point, "status": "out of memory"})
            timing.release(args.device)
            print(f"slots {slots}: out of memory, larger sizes skipped")
            break
        points.append({**point, "status": "ok"})
        # rewritten after each point: a run cut short keeps what it measured
        report.save(args, {"complete": False, "points": points})

    done = [p for p in points if p["status"] == "ok"]
    table = table_rows(done)
    spread = max(r["ultramem_ms"] for r in table) / min(r["ultramem_ms"] for r in table) - 1 if table else None
    settings = {"size": args.size, "batch": args.batch, "context": args.context, "mode": args.mode, "slots": args.slots,
                "range": done[-1]["slots"] / done[0]["slots"] if done else None}  # fmt: skip
    payload = {
        "settings": settings,
        "ultramem_latency_spread": spread,
        "complete": True,
        "points": points,
        "table": table,
    }
    if not args.no_plot and done:
        xs = [p["slots"] for p in done]
        series = {"ultramem": (xs, [p["ultramem"]["ms"] for p in done]),
                  f"moe (2 in {done[0]['experts']}..{done[-1]['experts']})": (xs, [p["moe"]["ms"] for p in done])}  # fmt: skip
        panel = report.Panel("decode time vs sparse size", "ms / step", series,
                             xlabel="UltraMem physical slots (MoE: same sparse params)")  # fmt: skip
        report.plot(args.results_dir / f"{args.name}.png", [panel],
                    f"{args.size} backbone, batch {args.batch}, KV cache {args.context}, {args.mode}")  # fmt: skip
    summary = (
        "" if spread is None else f"\nUltraMem latency spread over {settings['range']:.0f}x slots: {100 * spread:.1f}%"
    )
    report.finish(args, payload, report.format_table(table, COLUMNS) + summary)
    return payload


if __name__ == "__main__":
    main()
