"""Training step time and peak memory of dense, UltraMem and MoE at equal compute (the 151M rows).

One step = forward (LM loss + the model's aux loss), backward, AdamW step, as `ultramem-train` runs it:
fp32 master weights, bf16 autocast on CUDA, fused AdamW with the value tables in their own parameter group.
Forward, forward+backward, the optimizer step and the full step are timed separately, so the optimizer's
share is visible (AdamW reads and writes every parameter, value tables and experts included, at every step).

H100 / H200 (bf16 autocast; ~2B-parameter models need ~35 GB each with AdamW states):

    python benchmarks/bench_train.py --device cuda --sizes 151m --batch 16 --seq-len 2048

CPU (tiny presets, float32):

    OMP_NUM_THREADS=2 python benchmarks/bench_train.py --device cpu

Writes benchmarks/results/train_<device>.json; the table is printed last.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from transformers import PreTrainedModel

import _common as common

DEFAULT_NAME = "train"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.make_parser(__doc__, DEFAULT_NAME)
    parser.add_argument("--sizes", type=common.parse_sizes, default=None, help="151m on CUDA; tiny on CPU")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (16 on CUDA, 4 on CPU)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (2048 on CUDA, 128 on CPU)")
    parser.add_argument(
        "--moe-impl",
        choices=("auto", *common.MOE_IMPLEMENTATIONS),
        default="auto",
        help="Mixtral experts_implementation; 'auto' times a training step with each and keeps the fastest",
    )
    args = parser.parse_args(argv)
    common.resolve_common(args, DEFAULT_NAME)
    cuda = args.device.type == "cuda"
    args.sizes = args.sizes or (["151m"] if cuda else ["tiny"])
    args.batch = args.batch if args.batch is not None else (16 if cuda else 4)
    args.seq_len = args.seq_len if args.seq_len is not None else (2048 if cuda else 128)
    for flag in ("batch", "seq_len"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return args


def make_optimizer(model: PreTrainedModel, fused: bool) -> torch.optim.Optimizer:
    """AdamW with the value tables in their own group (10x LR, as the value-LR schedule starts)."""
    value_names = set(model.get_value_table_names()) if hasattr(model, "get_value_table_names") else set()
    values = [p for n, p in model.named_parameters() if n in value_names]
    others = [p for n, p in model.named_parameters() if n not in value_names]
    groups = [{"params": others}] + ([{"params": values, "lr": 1e-3}] if values else [])
    return torch.optim.AdamW(groups, lr=1e-4, weight_decay=0.1, fused=fused)


def training_callables(model: PreTrainedModel, args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    """Forward, forward+backward, the optimizer alone and the full step, on one fixed random batch.

    "optimizer" steps on the gradients present (left by "gradients"), so its time is AdamW's own.
    """
    optimizer = make_optimizer(model, fused=args.device.type == "cuda")
    input_ids = torch.randint(1, model.config.vocab_size, (args.batch, args.seq_len), device=args.device)
    autocast = torch.autocast(args.device.type, dtype=args.dtype) if args.dtype != torch.float32 else nullcontext()

    def loss() -> torch.Tensor:
        with autocast:
            return model(input_ids=input_ids, labels=input_ids).loss

    def forward() -> None:
        loss()

    def forward_backward() -> None:
        loss().backward()
        model.zero_grad(set_to_none=True)

    def step() -> None:
        loss().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def gradients() -> None:
        loss().backward()

    return {
        "forward": forward,
        "forward_backward": forward_backward,
        "gradients": gradients,
        "optimizer": optimizer.step,
        "step": step,
    }


def bench_model(size: str, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    preset = common.PEERS[size][kind]
    # fp32 master weights; autocast computes in args.dtype
    model = common.build(preset, args.device, torch.float32, max_position_embeddings=max(args.seq_len, 128)).train()
    row: dict[str, Any] = {"size": size, "kind": kind, "preset": preset}
    row["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    calls = training_callables(model, args)
    if kind == "moe":
        row["moe_implementation"], row["moe_probe_ms"] = common.choose_moe_implementation(
            model, args.moe_impl, lambda m: common.measure(training_callables(m, args)["forward_backward"], args, 1, 2)
        )
    try:
        for phase in ("forward", "forward_backward"):
            row[f"{phase}_ms"] = common.measure(calls[phase], args)["ms"]
        calls["gradients"]()
        row["optimizer_ms"] = common.measure(calls["optimizer"], args)["ms"]
        model.zero_grad(set_to_none=True)
        common.reset_peak_memory(args.device)
        row.update(common.measure(calls["step"], args))
        row["peak_mib"] = common.peak_memory_mib(args.device)
        row["status"] = "ok"
    except RuntimeError as error:
        if not common.is_out_of_memory(error):
            raise
        row["status"] = "out of memory"
    # parameters + gradients + two AdamW moments, fp32: what the step must read and write at least once
    row["state_mib"] = row["params_m"] * 1e6 * 16 / 2**20
    del model, calls
    common.release(args.device)
    if row["status"] == "ok":
        row["tokens_per_s"] = args.batch * args.seq_len / (row["ms"] / 1e3)
        print(f"{preset:<20} step {row['ms']:9.2f} ms  peak {row['peak_mib']} MiB")
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(0)
    rows = [bench_model(size, kind, args) for size in args.sizes for kind in ("dense", "ultramem", "moe")]
    for row in rows:
        dense = next(r for r in rows if r["size"] == row["size"] and r["kind"] == "dense")
        if row.get("ms") and dense.get("ms"):
            row["step_vs_dense"] = row["ms"] / dense["ms"]
    payload = {
        "settings": {
            "sizes": args.sizes,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "precision": "fp32 weights" + ("" if args.dtype == torch.float32 else f", {args.dtype} autocast"),
            "optimizer": "AdamW" + (" (fused)" if args.device.type == "cuda" else " (foreach)"),
            "warmup": args.warmup,
            "iters": args.iters,
        },
        "rows": rows,
    }
    columns = [
        ("preset", "preset"),
        ("params_m", "params(M)"),
        ("forward_ms", "fwd ms"),
        ("forward_backward_ms", "fwd+bwd ms"),
        ("optimizer_ms", "optim ms"),
        ("ms", "step ms"),
        ("step_vs_dense", "step/dense"),
        ("tokens_per_s", "tokens/s"),
        ("peak_mib", "peak MiB"),
        ("state_mib", "state MiB"),
    ]
    common.finish(args, payload, common.format_table(rows, columns))
    return payload


if __name__ == "__main__":
    main()
