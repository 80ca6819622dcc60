"""Correctness on a real GPU: the Triton kernels and the Triton model path against the PyTorch reference.

The CI tests run the kernels in Triton's CPU interpreter; this script runs the same comparisons on
compiled kernels on a CUDA device (H100/H200), at the paper's memory shapes, and the whole model:

    python benchmarks/check_gpu.py                 # writes results/check_gpu_<gpu>.json, prints a table

Checks (each row: what was compared, the worst error, the tolerance, pass/fail):
  * `lookup_reduce` forward and backward (float32 atomics, deterministic segments) against
    `ultramem.memory_ops.lookup_reduce`, float32, bfloat16 and float16, at the 151M/680M/1.6B (E, h, Dv, H*m);
  * the deterministic backward gives identical bits on two runs;
  * `tucker_candidate_topk`: same selected score per rank as the reference (ties may reorder indices);
  * `tiny-ultramem` and a 151M-shaped UltraMem, memory_kernel="triton" vs "torch": logits, loss and
    every parameter's gradient;
  * greedy `generate` with the KV/query-conv cache against full recomputation (no cache), Triton path;
  * `torch.compile(fullgraph=True)` of the Triton model's forward against eager.
Exit status 1 if any row fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from ultramem import kernels, memory_ops
from ultramem.presets import get_config
from ultramem.sizing import build_model

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PAPER_MEMORIES = {"151m": "ultramem-151m-x12", "680m": "ultramem-680m-x12", "1.6b": "ultramem-1.6b-x12"}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROWS: list[dict] = []


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (both promoted to float64)."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def record(check: str, error: float, tolerance: float, **detail) -> None:
    ROWS.append(dict(check=check, error=error, tolerance=tolerance, passed=bool(error <= tolerance), **detail))


def check_lookup(name: str, dtype: torch.dtype, tokens: int, num_rows: int, device: torch.device) -> None:
    config = get_config(PAPER_MEMORIES[name])
    slots, groups, cores, dim = config.memory_heads * config.memory_topk, config.ive_expansion, config.mcs_cores, config.memory_value_dim
    generator = torch.Generator(device=device).manual_seed(0)
    values = torch.randn(num_rows, dim, device=device, generator=generator).to(dtype)
    # a small hot range as well, so that many tokens hit the same rows (the atomics' hard case)
    rows = torch.randint(0, num_rows // 64, (tokens, slots), device=device, generator=generator)
    group_index = torch.randint(0, groups, (tokens, slots), device=device, generator=generator)
    scores = torch.randn(tokens, slots, cores, device=device, generator=generator).to(dtype)
    grad_out = torch.randn(tokens, groups, dim, device=device, generator=generator).to(dtype)

    values32, scores32 = values.float().requires_grad_(), scores.float().requires_grad_()
    expected = memory_ops.lookup_reduce(values32, rows, group_index, scores32, groups)
    expected_grads = torch.autograd.grad(expected, (values32, scores32), grad_out.float())
    tolerance = TOLERANCE[dtype]
    shape = dict(config=name, dtype=str(dtype).removeprefix("torch."), tokens=tokens, rows=num_rows)
    for deterministic in (False, True):
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        bits = []
        for _ in range(2):
            values_, scores_ = values.clone().requires_grad_(), scores.clone().requires_grad_()
            out = kernels.lookup_reduce(values_, rows, group_index, scores_, groups)
            grads = torch.autograd.grad(out, (values_, scores_), grad_out)
            bits.append(grads[0])
        mode = "deterministic" if deterministic else "atomic"
        if not deterministic:
            record("lookup_reduce forward", relative_error(out, expected), tolerance, **shape)
        record(f"lookup_reduce backward values ({mode})", relative_error(grads[0], expected_grads[0]), tolerance, **shape)
        record(f"lookup_reduce backward scores ({mode})", relative_error(grads[1], expected_grads[1]), tolerance, **shape)
        if deterministic:
            record("lookup_reduce deterministic backward: identical bits twice",
                   float(not torch.equal(bits[0], bits[1])), 0.0, **shape)
    torch.use_deterministic_algorithms(False)


def check_candidates(name: str, dtype: torch.dtype, tokens: int, device: torch.device) -> None:
    config = get_config(PAPER_MEMORIES[name])
    rank, topk, cores = config.tucker_rank, config.memory_topk, config.mcs_cores
    generator = torch.Generator(device=device).manual_seed(1)
    row = torch.randn(tokens, rank, topk, device=device, generator=generator).to(dtype)
    col = torch.randn(tokens, rank, topk, device=device, generator=generator).to(dtype)
    core = torch.randn(cores, rank, rank, device=device, generator=generator).to(dtype)
    index, core_scores = kernels.tucker_candidate_topk(row, col, core, topk)
    ref_index, ref_scores = memory_ops.tucker_candidate_topk(row.float(), col.float(), core.float(), topk)
    # ties may order winners differently: compare the sorted total scores of the winners
    got = core_scores.float().sum(-1).sort(-1, descending=True).values
    want = ref_scores.sum(-1).sort(-1, descending=True).values
    shape = dict(config=name, dtype=str(dtype).removeprefix("torch."), tokens=tokens)
    record("tucker_candidate_topk winners' scores", relative_error(got, want), TOLERANCE[dtype], **shape)
    record("tucker_candidate_topk same index set (fraction differing)",
           1.0 - (index.sort(-1).values == ref_index.sort(-1).values).float().mean().item(),
           0.0 if dtype == torch.float32 else 0.01, **shape)


def model_pair(preset: str, device: torch.device, dtype: torch.dtype, **overrides):
    """The preset with the reference and the Triton kernels, same weights; dropout off (the paper presets have 0.1),
    since the two training-mode forwards would draw different masks and compare those instead of the kernels."""
    models = {}
    for kernel in ("torch", "triton"):
        torch.manual_seed(0)
        config = get_config(preset, **{**overrides, "memory_kernel": kernel, "hidden_dropout": 0.0, "attention_dropout": 0.0})
        models[kernel] = build_model(config).to(device=device, dtype=dtype)
    models["triton"].load_state_dict(models["torch"].state_dict())
    return models


def check_model(preset: str, device: torch.device, dtype: torch.dtype, batch: int, seq: int, **overrides) -> None:
    models = model_pair(preset, device, dtype, **overrides)
    generator = torch.Generator(device=device).manual_seed(2)
    input_ids = torch.randint(0, models["torch"].config.vocab_size, (batch, seq), device=device, generator=generator)
    outputs, grads = {}, {}
    for kernel, model in models.items():
        model.train()
        out = model(input_ids=input_ids, labels=input_ids)
        out.loss.backward()
        outputs[kernel] = out
        grads[kernel] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    tolerance = 1e-3 if dtype == torch.float32 else 5e-2
    shape = dict(config=preset, dtype=str(dtype).removeprefix("torch."), tokens=batch * seq)
    record("model triton vs torch: logits", relative_error(outputs["triton"].logits, outputs["torch"].logits),
           tolerance, **shape)
    record("model triton vs torch: loss", relative_error(outputs["triton"].loss, outputs["torch"].loss),
           tolerance, **shape)
    worst = max(grads["torch"], key=lambda n: relative_error(grads["triton"][n], grads["torch"][n]))
    record("model triton vs torch: worst parameter gradient",
           relative_error(grads["triton"][worst], grads["torch"][worst]), 10 * tolerance, parameter=worst, **shape)


def check_generation(device: torch.device) -> None:
    torch.manual_seed(0)
    model = build_model(get_config("tiny-ultramem", memory_kernel="triton")).to(device).eval()
    prompt = torch.randint(0, model.config.vocab_size, (3, 12), device=device)
    with torch.no_grad():
        kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        cached = model.generate(prompt, **kwargs)
        recomputed = model.generate(prompt, use_cache=False, **kwargs)
    differing = (cached != recomputed).float().mean().item()
    record("generate: cached vs recomputed, greedy tokens differing", differing, 0.0, config="tiny-ultramem")


def check_compile(device: torch.device) -> None:
    torch.manual_seed(0)
    model = build_model(get_config("tiny-ultramem", memory_kernel="triton")).to(device).eval()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 64), device=device)
    with torch.no_grad():
        eager = model(input_ids=input_ids).logits
        compiled = torch.compile(model.forward, fullgraph=True)(input_ids=input_ids).logits
    record("torch.compile(fullgraph) vs eager logits", relative_error(compiled, eager), 1e-4, config="tiny-ultramem")


def guarded(name: str, fn, *args, **kwargs) -> None:
    """Run one check; an exception becomes a failing row with its message, so later checks still run."""
    try:
        fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - reported as a failed row, with its type and message
        ROWS.append(dict(check=name, error=None, tolerance=None, passed=False,
                         exception=f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"))
        print(f"{name}: {ROWS[-1]['exception']}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1 << 20, help="physical rows of the kernel checks' tables")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the kernel checks")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, Triton's interpreter (TRITON_INTERPRET=1), float32, 151M kernel shapes at 16 tokens and "
                        "the tiny model only: checks the script itself in seconds")  # fmt: skip
    args = parser.parse_args(argv)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        device, names, dtypes = torch.device("cpu"), ["151m"], DTYPES[:1]
        args.tokens, args.rows = 16, min(args.rows, 256)
    elif not torch.cuda.is_available():
        raise SystemExit("check_gpu.py needs a CUDA device (the CPU checks are the test suite; --smoke tries it)")
    else:
        device, names, dtypes = torch.device("cuda"), list(PAPER_MEMORIES), DTYPES
    for name in names:
        for dtype in dtypes:
            guarded(f"lookup {name} {dtype}", check_lookup, name, dtype, args.tokens, args.rows, device)
            guarded(f"candidates {name} {dtype}", check_candidates, name, dtype, args.tokens, device)
    # with the paper presets' dropout, which `model_pair` turns off (the smoke run checks that it does)
    guarded("model tiny float32", check_model, "tiny-ultramem", device, torch.float32, *((1, 16) if args.smoke else (4, 128)),
            hidden_dropout=0.1, attention_dropout=0.1)  # fmt: skip
    if not args.smoke:
        for dtype in DTYPES:
            guarded(f"model 151m {dtype}", check_model, "ultramem-151m-x12", device, dtype, 2, 512,
                    num_hidden_layers=4, memory_layers=[[0, 2], [1, 3]])  # fmt: skip
        guarded("generate", check_generation, device)
        guarded("compile", check_compile, device)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    report = dict(device=name, torch=torch.__version__, command=" ".join(sys.argv), rows=ROWS)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    tag = next((t for t in ("h200", "h100", "a100", "cpu") if t in name.lower()), "gpu")
    path = args.results_dir / f"check_gpu_{tag}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"device: {name}, torch {torch.__version__}, wrote {path}")
    for row in ROWS:
        detail = " ".join(f"{k}={row[k]}" for k in ("config", "dtype", "tokens", "parameter") if k in row)
        error = row.get("exception") or f"{row['error']:.2e} (tol {row['tolerance']:.0e})"
        print(f"{'PASS' if row['passed'] else 'FAIL'}  {row['check']:<62} {detail:<45} {error}")
    return 0 if all(row["passed"] for row in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
