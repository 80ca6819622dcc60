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

import argparse
import math
from typing import Any

import torch

from ultramem.presets import get_config
from ultramem.sizing import count_parameters

import _common as common

DEFAULT_NAME = "scaling"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.make_parser(__doc__, DEFAULT_NAME, decode=True)
    parser.add_argument(
        "--size", choices=sorted(common.PEERS), default=None, help="backbone: 1.6b on CUDA, tiny on CPU"
    )
    parser.add_argument("--batch", type=int, default=None, help="decoding batch size (64 on CUDA, 4 on CPU)")
    parser.add_argument(
        "--slots",
        type=common.parse_int_list,
        default=None,
        help="total physical memory slots, summed over memory layers (1M..32M doubling on CUDA, 16k..256k on CPU)",
    )
    args = parser.parse_args(argv)
    common.resolve_common(args, DEFAULT_NAME)
    common.resolve_decode(args)
    cuda = args.device.type == "cuda"
    args.size = args.size or ("1.6b" if cuda else "tiny")
    args.batch = args.batch if args.batch is not None else (64 if cuda else 4)
    if args.batch < 1:
        raise SystemExit(f"--batch must be >= 1, got {args.batch}")
    args.slots = args.slots or [2**i * (2**20 if cuda else 2**14) for i in range(6 if cuda else 5)]
    return args


def scaled_overrides(args: argparse.Namespace, slots: int) -> tuple[dict[str, Any], dict[str, Any], int]:
    """UltraMem and MoE overrides for about `slots` total physical values at `args.size`, and the exact count."""
    peers = common.PEERS[args.size]
    ultramem_config = get_config(peers["ultramem"])
    layers = len(ultramem_config.memory_layers)
    knum = max(1, round(math.sqrt(slots / layers)))  # physical values per layer = knum^2
    expansion_side = math.isqrt(ultramem_config.ive_expansion)  # keys per axis = sqrt(E) * knum
    ultramem = dict(memory_num_keys=expansion_side * knum, **common.decode_overrides(peers["ultramem"], args))
    value_params = layers * knum**2 * ultramem_config.memory_value_dim
    moe_config = get_config(peers["moe"])
    expert_params = moe_config.num_hidden_layers * 3 * moe_config.hidden_size * moe_config.intermediate_size
    experts = max(moe_config.num_experts_per_tok, round(value_params / expert_params))
    moe = dict(num_local_experts=experts, **common.decode_overrides(peers["moe"], args))
    return ultramem, moe, layers * knum**2


def bench_point(kind: str, overrides: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    preset = common.PEERS[args.size][kind]
    model = common.build(preset, args.device, args.dtype, **overrides).eval()
    counts = count_parameters(model.config)
    row: dict[str, Any] = {"kind": kind, "total_params_b": counts["total"] / 1e9}
    row["access_gb"] = (
        common.decode_memory_access(model, args.batch, args.context, torch.finfo(args.dtype).bits // 8).total / 1e9
    )
    with torch.no_grad():
        if kind == "moe":
            row["moe_implementation"], row["moe_probe_ms"] = common.choose_moe_implementation(
                model,
                args.moe_impl,
                lambda m: common.time_decode(m, args.batch, args),
            )
        row.update(common.time_decode(model, args.batch, args))
    del model
    common.release(args.device)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(0)
    points: list[dict[str, Any]] = []
    for slots in args.slots:
        ultramem, moe, physical = scaled_overrides(args, slots)
        point: dict[str, Any] = {
            "slots": slots,
            "physical_slots": physical,
            "memory_num_keys": ultramem["memory_num_keys"],
            "experts": moe["num_local_experts"],
        }
        try:
            for kind, overrides in (("ultramem", ultramem), ("moe", moe)):
                result = bench_point(kind, overrides, args)
                point[kind] = result
                print(f"slots {slots:>10} {kind:<8}: {result['ms']:8.3f} ms  {result['total_params_b']:.3f} B params")
        except RuntimeError as error:
            if not common.is_out_of_memory(error):
                raise
            point["status"] = "out of memory"
            points.append(point)
            common.release(args.device)
            print(f"slots {slots}: out of memory, larger sizes skipped")
            break
        point["status"] = "ok"
        points.append(point)
        # rewritten after each point: a run cut short keeps what it measured
        common.write_json(args.results_dir, args.name, {"environment": common.environment(args), "complete": False,
                                                        "points": points})  # fmt: skip

    done = [p for p in points if p["status"] == "ok"]
    table = []
    for p in done:
        base_u, base_m = done[0]["ultramem"]["ms"], done[0]["moe"]["ms"]
        table.append(
            {
                "slots": p["slots"],
                "ultramem_params_b": p["ultramem"]["total_params_b"],
                "ultramem_ms": p["ultramem"]["ms"],
                "ultramem_vs_first": p["ultramem"]["ms"] / base_u,
                "experts": p["experts"],
                "moe_params_b": p["moe"]["total_params_b"],
                "moe_ms": p["moe"]["ms"],
                "moe_vs_first": p["moe"]["ms"] / base_m,
                "moe/ultramem": p["moe"]["ms"] / p["ultramem"]["ms"],
            }
        )
    spread = None
    if done:
        times = [row["ultramem_ms"] for row in table]
        spread = max(times) / min(times) - 1
    payload = {
        "settings": {
            "size": args.size,
            "batch": args.batch,
            "context": args.context,
            "mode": args.mode,
            "slots": args.slots,
            "range": done[-1]["slots"] / done[0]["slots"] if done else None,
        },
        "ultramem_latency_spread": spread,
        "complete": True,
        "points": points,
        "table": table,
    }
    if not args.no_plot and done:
        xs = [p["slots"] for p in done]
        series = {
            "ultramem": (xs, [p["ultramem"]["ms"] for p in done]),
            f"moe (2 in {done[0]['experts']}..{done[-1]['experts']})": (xs, [p["moe"]["ms"] for p in done]),
        }
        common.plot_panels(
            args,
            [("decode time vs sparse size", "ms / step", series)],
            "UltraMem physical slots (MoE: same sparse params)",
            f"{args.size} backbone, batch {args.batch}, KV cache {args.context}, {args.mode}",
        )
    columns = [
        ("slots", "slots"),
        ("ultramem_params_b", "U params(B)"),
        ("ultramem_ms", "ultramem ms"),
        ("ultramem_vs_first", "U/U0"),
        ("experts", "experts"),
        ("moe_params_b", "M params(B)"),
        ("moe_ms", "moe ms"),
        ("moe_vs_first", "M/M0"),
        ("moe/ultramem", "M/U"),
    ]
    summary = (
        ""
        if spread is None
        else f"\nUltraMem latency spread over {payload['settings']['range']:.0f}x slots: {100 * spread:.1f}%"
    )
    common.finish(args, payload, common.format_table(table, columns) + summary)
    return payload


if __name__ == "__main__":
    main()
