"""Training step time and peak memory of dense, UltraMem and MoE at equal compute (the 151M rows).

One step = forward (LM loss + the model's aux loss), backward, AdamW step, as `ultramem-train` runs it:
fp32 master weights, bf16 autocast on CUDA, fused AdamW with the value tables in their own parameter group.
Forward, forward+backward, the optimizer step and the full step are timed separately, so the optimizer's
share is visible (AdamW reads and writes every parameter, value tables and experts included, at every step).

H100 / H200 (bf16 autocast; ~2B-parameter models need ~35 GB each with AdamW states):

    python benchmarks/bench_train.py --device cuda --sizes 151m --batch 16 --seq-len 2048

CPU (tiny presets, float32):

    OMP_NUM_THREADS=2 python benchmarks/bench_train.py --device cpu

`--fused-selection` turns on the Triton path's opt-in one-kernel selection (`ultramem.kernels.fused_selection`) for
the whole run, to time it against a run without.

Writes benchmarks/results/train_<device>.json; the table is printed last.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from lib import cli, models, report, timing

from ultramem.kernels import fused_selection

DEFAULT_NAME = "train"


def parse_args(argv: list[str] | None = None):
    parser = cli.make_parser(__doc__, DEFAULT_NAME)
    parser.add_argument("--sizes", type=cli.sizes, default=None, help="151m on CUDA; tiny on CPU")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (16 on CUDA, 4 on CPU)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (2048 on CUDA, 128 on CPU)")
    cli.add_moe_argument(parser, "with a training step")
    cli.add_fused_selection_argument(parser)
    args = cli.resolve(parser.parse_args(argv), DEFAULT_NAME)
    cuda = args.device.type == "cuda"
    args.sizes = args.sizes or (["151m"] if cuda else ["tiny"])
    args.batch = args.batch if args.batch is not None else (16 if cuda else 4)
    args.seq_len = args.seq_len if args.seq_len is not None else (2048 if cuda else 128)
    cli.at_least(args, batch=1, seq_len=1)
    return args


def make_optimizer(model, fused: bool) -> torch.optim.Optimizer:
    """AdamW with the value tables in their own group (10x LR, as the value-LR schedule starts)."""
    value_names = set(model.get_value_table_names()) if hasattr(model, "get_value_table_names") else set()
    values = [p for n, p in model.named_parameters() if n in value_names]
    others = [p for n, p in model.named_parameters() if n not in value_names]
    groups = [{"params": others}] + ([{"params": values, "lr": 1e-3}] if values else [])
    return torch.optim.AdamW(groups, lr=1e-4, weight_decay=0.1, fused=fused)


def training_callables(model, args) -> dict[str, Callable[[], None]]:
    """Forward, forward+backward, the optimizer alone and the full step, on one fixed random batch.

    "optimizer" steps on the gradients present (left by "gradients"), so its time is AdamW's own.
    """
    optimizer = make_optimizer(model, fused=args.device.type == "cuda")
    input_ids = torch.randint(1, model.config.vocab_size, (args.batch, args.seq_len), device=args.device)
    autocast = torch.autocast(args.device.type, dtype=args.dtype) if args.dtype != torch.float32 else nullcontext()

    def loss() -> torch.Tensor:
        with autocast:
            return model(input_ids=input_ids, labels=input_ids).loss

    def forward_backward() -> None:
        loss().backward()
        model.zero_grad(set_to_none=True)

    def step() -> None:
        loss().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return {"forward": loss, "forward_backward": forward_backward, "gradients": lambda: loss().backward(),
            "optimizer": optimizer.step, "step": step}  # fmt: skip


def bench_model(size: str, kind: str, args) -> dict[str, Any]:
    preset = models.PEERS[size][kind]
    # fp32 master weights; autocast computes in args.dtype
    model = models.build(preset, args.device, torch.float32, max_position_embeddings=max(args.seq_len, 128)).train()
    row: dict[str, Any] = {"size": size, "kind": kind, "preset": preset}
    row["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    calls = training_callables(model, args)
    measure = lambda fn, **kw: timing.measure(fn, **{**cli.timing_of(args), **kw})  # noqa: E731
    if kind == "moe":
        row["moe_implementation"], row["moe_probe_ms"] = models.choose_moe_implementation(
            model, args.moe_impl, lambda m: measure(training_callables(m, args)["forward_backward"], warmup=1, iters=2)
        )
    try:
        for phase in ("forward", "forward_backward"):
            row[f"{phase}_ms"] = measure(calls[phase])["ms"]
        calls["gradients"]()
        row["optimizer_ms"] = measure(calls["optimizer"])["ms"]
        model.zero_grad(set_to_none=True)
        timing.reset_peak_memory(args.device)
        row.update(measure(calls["step"]), peak_mib=timing.peak_memory_mib(args.device), status="ok")
        row.update(timing.count_launches(calls["step"], args.device))  # on CUDA: which kernels the step's time is in
    except RuntimeError as error:
        if not timing.is_out_of_memory(error):
            raise
        row["status"] = "out of memory"
    # parameters + gradients + two AdamW moments, fp32: what the step must read and write at least once
    row["state_mib"] = row["params_m"] * 1e6 * 16 / 2**20
    del model, calls
    timing.release(args.device)
    if row["status"] == "ok":
        row["tokens_per_s"] = args.batch * args.seq_len / (row["ms"] / 1e3)
        print(f"{preset:<20} step {row['ms']:9.2f} ms  peak {row['peak_mib']} MiB")
    return row


COLUMNS = {"preset": "preset", "params_m": "params(M)", "forward_ms": "fwd ms", "forward_backward_ms": "fwd+bwd ms",
           "optimizer_ms": "optim ms", "ms": "step ms", "step_vs_dense": "step/dense", "tokens_per_s": "tokens/s",
           "peak_mib": "peak MiB", "state_mib": "state MiB"}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(0)
    rows = []
    with fused_selection(args.fused_selection):
        for size in args.sizes:
            for kind in ("dense", "ultramem", "moe"):
                rows.append(bench_model(size, kind, args))
                report.save(args, {"complete": False, "rows": rows})  # kept should the run be cut short
    for row in rows:
        dense = next(r for r in rows if r["size"] == row["size"] and r["kind"] == "dense")
        if row.get("ms") and dense.get("ms"):
            row["step_vs_dense"] = row["ms"] / dense["ms"]
    precision = "fp32 weights" + ("" if args.dtype == torch.float32 else f", {args.dtype} autocast")
    optimizer = "AdamW" + (" (fused)" if args.device.type == "cuda" else " (foreach)")
    settings = {"sizes": args.sizes, "batch": args.batch, "seq_len": args.seq_len, "precision": precision,
                "optimizer": optimizer, "warmup": args.warmup, "iters": args.iters,
                "fused_selection": args.fused_selection}  # fmt: skip
    payload = {"settings": settings, "rows": rows, "complete": True}
    report.finish(args, payload, report.format_table(rows, COLUMNS))
    return payload


if __name__ == "__main__":
    main()
