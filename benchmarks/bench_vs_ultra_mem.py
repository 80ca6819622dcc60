"""This project's memory layer against the `ultra-mem` package from PyPI (lucidrains), forward and backward.

Both layers are built with the same hyperparameters: hidden size D, keys per axis n (`num_memories` = n^2
virtual slots there), top-m per head, query/key dim, Tucker rank 2, 2 cores, IVE expansion 4, value dim
D/2, causal query conv of kernel 5, query/key LayerNorm. Differences that remain (their design, not a
setting): `ultra-mem` keeps one value table per core ("head") and runs one top-m per core, so its table
is twice ours for the same rows read per token (2 x m each); it pools with `scatter` and reads
`self.keys` without the key LayerNorm it computes. The ratio is `ultra-mem` time / ours, in training
mode (their forward also counts its value-LR gradient scaling), float32. Ours runs `--memory-implementation` (default
"auto": the `embedding_bag` lookup on CPU; "torch" times the reference).

CPU (the only comparison this script makes; `pip install ultra-mem`, it pulls einx and einops):

    OMP_NUM_THREADS=2 python benchmarks/bench_vs_ultra_mem.py

Writes benchmarks/results/vs_ultra_mem_cpu.json; the table is printed last.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from lib import cli, report, timing
from torch import nn

from ultramem import UltraMemConfig
from ultramem.configuration_ultramem import MEMORY_IMPLEMENTATIONS
from ultramem.memory_ops import tucker_aux_loss
from ultramem.modeling_ultramem import UltraMemMemoryLayer

DEFAULT_NAME = "vs_ultra_mem"


@dataclass(frozen=True)
class LayerShape:
    name: str
    hidden: int
    num_keys: int  # keys per axis n; n^2 virtual slots, n^2 / 4 physical rows (ours)
    topk: int
    key_dim: int
    batch: int
    seq_len: int


SHAPES = {
    "tiny": LayerShape("tiny (tiny-ultramem layer)", 256, 512, 16, 64, 4, 128),
    "small": LayerShape("small (151M width, 1M slots)", 1024, 1024, 16, 256, 2, 256),
    "smoke": LayerShape("smoke", 64, 32, 4, 16, 2, 8),
}


def parse_args(argv: list[str] | None = None):
    parser = cli.make_parser(__doc__, DEFAULT_NAME)
    parser.add_argument("--shapes", default="tiny,small", help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--memory-implementation", "--memory-kernel", default="auto", choices=MEMORY_IMPLEMENTATIONS,
                        help="how ours computes its lookups ('auto': the device's default)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.device != "cpu":
        raise SystemExit("--device: this comparison runs on CPU only (ultra-mem's CUDA path is not compared)")
    cli.resolve(args, DEFAULT_NAME)
    args.shapes = cli.names(args.shapes, SHAPES, "--shapes")
    return args


def ours(shape: LayerShape, memory_implementation: str) -> nn.Module:
    config = UltraMemConfig(
        vocab_size=8,
        hidden_size=shape.hidden,
        intermediate_size=4 * shape.hidden,
        num_attention_heads=4,
        num_hidden_layers=1,
        memory_layers=[[0, 0]],
        memory_heads=2,
        memory_topk=shape.topk,
        memory_key_dim=shape.key_dim,
        memory_num_keys=shape.num_keys,
        memory_value_dim=shape.hidden // 2,
        ive_expansion=4,
        tucker_rank=2,
        mcs_cores=2,
        query_conv_kernel_size=5,
        memory_implementation=None if memory_implementation == "auto" else memory_implementation,
    )
    layer = UltraMemMemoryLayer(config, 0)
    for module in layer.modules():
        if hasattr(module, "init_ultramem"):
            module.init_ultramem()
    return layer


def theirs(shape: LayerShape) -> nn.Module:
    from ultra_mem import UltraMem

    return UltraMem(
        dim=shape.hidden,
        dim_values=shape.hidden // 2,
        num_memories=shape.num_keys**2,
        topk=shape.topk,
        dim_queries_keys=shape.key_dim,
        core_rank=2,
        core_heads=2,
        value_expansion=4,
        pre_query_causal_conv=True,
        query_conv_kernel_size=5,
        qk_layernorm=True,
    )


def losses(layer: nn.Module, x: torch.Tensor, is_ours: bool) -> torch.Tensor:
    """Output summed plus the layer's aux loss, for both APIs."""
    if is_ours:
        config = layer.config
        return layer(x).sum() + tucker_aux_loss(layer.retrieval.cores, config.aux_loss_alpha, config.aux_loss_tau)
    out, _, aux = layer(x)
    return out.sum() + aux


def time_layer(layer: nn.Module, x: torch.Tensor, is_ours: bool, args) -> dict[str, float]:
    """Forward, and forward+backward (gradients dropped after each), of one layer on `x`."""

    def forward() -> None:
        losses(layer, x, is_ours)

    def forward_backward() -> None:
        losses(layer, x, is_ours).backward()
        layer.zero_grad(set_to_none=True)

    return {
        "forward_ms": timing.measure(forward, **cli.timing_of(args))["ms"],
        "forward_backward_ms": timing.measure(forward_backward, **cli.timing_of(args))["ms"],
    }


def bench_shape(shape: LayerShape, args) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    x = torch.randn(shape.batch, shape.seq_len, shape.hidden)
    rows = []
    builders = (
        ("ultramem (this project)", lambda s: ours(s, args.memory_implementation), True),
        ("ultra-mem (PyPI)", theirs, False),
    )
    for label, build, is_ours in builders:
        layer = build(shape).train()
        row = {"shape": shape.name, "impl": label, "params_m": sum(p.numel() for p in layer.parameters()) / 1e6}
        row.update(time_layer(layer, x, is_ours, args))
        rows.append(row)
        print(
            f"{shape.name:<30} {label:<24} fwd {row['forward_ms']:8.2f} ms  fwd+bwd {row['forward_backward_ms']:8.2f}"
        )
    mine, other = rows
    for phase in ("forward", "forward_backward"):
        other[f"{phase}_vs_ours"] = other[f"{phase}_ms"] / mine[f"{phase}_ms"]
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import importlib.metadata

    rows = [row for name in args.shapes for row in bench_shape(SHAPES[name], args)]
    payload = {
        "settings": {
            "shapes": [asdict(SHAPES[s]) for s in args.shapes],
            "memory_implementation": args.memory_implementation,
            "warmup": args.warmup,
            "iters": args.iters,
        },
        "ultra_mem_version": importlib.metadata.version("ultra-mem"),
        "rows": rows,
    }
    columns = {
        "shape": "shape",
        "impl": "implementation",
        "params_m": "params(M)",
        "forward_ms": "fwd ms",
        "forward_backward_ms": "fwd+bwd ms",
        "forward_vs_ours": "fwd / ours",
        "forward_backward_vs_ours": "fwd+bwd / ours",
    }
    report.finish(args, payload, report.format_table(rows, columns))
    return payload


if __name__ == "__main__":
    main()
