"""The flags the benchmark scripts share (output; device, dtype and timing for the timed ones; decoding) with their
device-dependent defaults, and the parsers of list-valued flags. A bad value exits with one line naming the flag and
the allowed range."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from .env import RESULTS_DIR, device_tag
from .models import MOE_IMPLEMENTATIONS, PEERS
from .timing import STATISTICS

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def make_parser(
    doc: str,
    default_name: str,
    *,
    device: bool = True,
    timed: bool = True,
    decode: bool = False,
    plot: bool = True,
    dtypes: bool = False,
) -> argparse.ArgumentParser:
    """A script's parser: where its JSON goes (`--results-dir`, `--name`), with `plot` `--no-plot`, with `device`
    `--device`; with `timed` the dtype and timing flags (`dtypes`: several dtypes, `--dtypes a,b`, instead of
    `--dtype`); with `decode` the decoding ones (context, mode, MoE path)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--name", default=None, help=f"output stem in --results-dir (default {default_name}{'_<device>' * device})")
    add("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON and PNG go")
    if plot:
        add("--no-plot", action="store_true", help="skip the PNG")
    if device:
        add("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    if not timed:
        return parser
    if dtypes:
        add("--dtypes", type=lambda text: names(text, DTYPES, "--dtypes"), default=None,
            help="comma-separated, timed one after the other: bfloat16,float32 on CUDA, float32 on CPU")  # fmt: skip
    else:
        add("--dtype", choices=sorted(DTYPES), default=None, help="bfloat16 on CUDA, float32 on CPU")
    add("--warmup", type=int, default=3, help="untimed iterations before timing")
    add("--iters", type=int, default=10, help="timed iterations (summarized by --statistic)")
    add("--statistic", choices=STATISTICS, default=None,
        help="reported time per call: wall-clock median (default on CUDA) or min, or the median process CPU time "
        "(default on CPU: a shared machine's waiting time excluded; run with OMP_NUM_THREADS=1)")  # fmt: skip
    if decode:
        add("--context", type=int, default=None, help="KV-cache tokens (2048 on CUDA, 128 on CPU)")
        add("--mode", choices=("eager", "compile"), default=None,
            help="applied alike to every model: 'compile' = torch.compile(mode='reduce-overhead'), i.e. Inductor "
            "kernels replayed as CUDA graphs (default on CUDA); 'eager' (default on CPU)")  # fmt: skip
        add_moe_argument(parser, "at the probe batch")
    return parser


def add_moe_argument(parser: argparse.ArgumentParser, probe: str) -> None:
    parser.add_argument("--moe-impl", choices=("auto", *MOE_IMPLEMENTATIONS), default="auto",
                        help=f"Mixtral experts_implementation; 'auto' times each {probe} and keeps the fastest")  # fmt: skip


def add_fused_selection_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fused-selection", action="store_true",
                        help="UltraMem's Triton path with the opt-in one-kernel selection (ultramem.kernels."
                        "fused_selection), to time it against a run without")  # fmt: skip


def resolve(args: argparse.Namespace, default_name: str) -> argparse.Namespace:
    """Fill in device-dependent defaults and check the shared flags (and the decoding ones where present)."""
    if getattr(args, "device", None) is None:
        args.name = args.name or default_name
        return args
    args.device = torch.device(args.device)
    cuda = args.device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible; use --device cpu")
    args.name = args.name or f"{default_name}_{device_tag(args.device)}"
    if not hasattr(args, "statistic"):
        return args
    if hasattr(args, "dtypes"):
        args.dtypes = [DTYPES[name] for name in args.dtypes or (["bfloat16", "float32"] if cuda else ["float32"])]
    else:
        args.dtype = DTYPES[args.dtype] if isinstance(args.dtype, str) else args.dtype
        args.dtype = args.dtype or (torch.bfloat16 if cuda else torch.float32)
    args.statistic = args.statistic or ("median" if cuda else "cpu")
    if args.statistic == "cpu" and cuda:
        raise SystemExit("--statistic cpu measures host CPU time and is meaningless on CUDA; use median or min")
    at_least(args, warmup=0, iters=1)
    if hasattr(args, "context"):
        args.context = args.context if args.context is not None else (2048 if cuda else 128)
        args.mode = args.mode or ("compile" if cuda else "eager")
        at_least(args, context=1)
        if args.mode == "compile" and args.warmup < 3:
            raise SystemExit("--mode compile needs --warmup >= 3 (compile, CUDA-graph record, first replay)")
    return args


def at_least(args: argparse.Namespace, **minimums: int) -> None:
    """Exit naming the flag when one of `minimums` (flag dest: smallest value) is not met (None: not given, the
    script's default follows)."""
    for dest, minimum in minimums.items():
        if getattr(args, dest) is not None and getattr(args, dest) < minimum:
            raise SystemExit(f"--{dest.replace('_', '-')} must be >= {minimum}, got {getattr(args, dest)}")


def timing_of(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of `timing.measure` the shared flags chose."""
    return {"device": args.device, "warmup": args.warmup, "iters": args.iters, "statistic": args.statistic}


def int_list(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]; every entry must be a positive integer."""
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def names(text: str, allowed: Iterable[str], flag: str) -> list[str]:
    """'a,b' -> ['a', 'b']; every entry must be one of `allowed` (else exit naming the flag and the choices)."""
    allowed = list(allowed)
    chosen = [n for n in text.split(",") if n]
    unknown = [n for n in chosen if n not in allowed]
    if unknown or not chosen:
        raise SystemExit(f"{flag}: unknown {unknown}; allowed: {', '.join(allowed)}")
    return chosen


def sizes(text: str) -> list[str]:
    """'680m,1.6b' -> the model sizes of `models.PEERS`."""
    chosen = [s for s in text.split(",") if s]
    unknown = [s for s in chosen if s not in PEERS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown size(s) {unknown}; allowed: {', '.join(PEERS)}")
    return chosen
