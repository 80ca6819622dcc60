"""Serving throughput and latency: vLLM (`ultramem.vllm`) against Transformers' `generate`, for the family and int4.

For each model (a preset of `ultramem.presets` with random weights, saved with the shipped tokenizer; `PRESET:int4` is
that checkpoint converted by `python -m ultramem.quantize`) both engines get the same `--requests` prompts of
`--prompt-len` random tokens and generate `--max-tokens` tokens greedily, `b` requests at a time for each batch size
`b` of `--batch-sizes`:
- Transformers: `generate` on batches of `b` prompts (equal lengths: no padding), one after another;
- vLLM: one engine per model (`max_num_seqs` = the largest `b`), given `b` requests per `LLM.generate` call.
Reported per model, engine and batch size: requests/s and generated tokens/s over the whole run, and the time to first
token of `b` requests arriving together (the same prompts with one token to generate), median of `--iters`. Each vLLM
engine runs in a child process; its start-up (20-60 s on CPU, minutes more to compile) is not timed.

Run it in the vLLM environment (docs/serving.md builds .venv-vllm). CPU (tiny presets, float32, about 15 minutes;
one thread: on shared cores two spinning OpenMP threads made `generate` 6x slower):

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=2 .venv-vllm/bin/python benchmarks/bench_serving.py --sizes tiny --iters 3

GPU (a vLLM build for CUDA, bf16; not run yet):

    python benchmarks/bench_serving.py --device cuda --sizes tiny,small --requests 256 --batch-sizes 1,8,64

vLLM compiles the model (torch.compile, docs/serving.md) unless `--enforce-eager`. Writes
benchmarks/results/serving_<device>.json and .png; the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lib import cli, env, models, report

MODELS = {
    size: (f"{size}-dense", f"{size}-ultramem", f"{size}-ultramemv2", f"{size}-ultramem:int4")
    for size in ("tiny", "small")
}


def parse_args():
    parser = cli.make_parser(__doc__, "serving")
    add = parser.add_argument
    add("--sizes", type=cli.sizes, default=["tiny"], help=f"comma-separated, of {sorted(MODELS)}")
    add("--requests", type=int, default=32, help="prompts per run")
    add("--prompt-len", type=int, default=64, help="tokens per prompt")
    add("--max-tokens", type=int, default=32, help="tokens generated per request")
    add("--batch-sizes", type=cli.int_list, default=[1, 8, 32], help="comma-separated requests served together")
    add("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    add(
        "--vllm-child", nargs=2, metavar=("REQUEST", "RESULT"), help=argparse.SUPPRESS
    )  # internal: the child that runs one engine
    args = parser.parse_args()
    if args.vllm_child:
        return args
    args = cli.resolve(args, "serving")
    cli.at_least(args, requests=1, prompt_len=1, max_tokens=1)
    for size in args.sizes:
        if size not in MODELS:
            raise SystemExit(f"--sizes: {size!r} is not one of {sorted(MODELS)}")
    return args


def prompts(args) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(10, 50000, (args.requests, args.prompt_len), generator=generator).tolist()


def save_model(name: str, folder: Path, args) -> tuple[torch.nn.Module, Path]:
    """The model `name` (PRESET or PRESET:FORMAT) with random weights, saved with the tokenizer: the model as
    Transformers loads it from there, and the folder vLLM serves."""
    from transformers import AutoModelForCausalLM

    from ultramem.quantize import convert
    from ultramem.tokenization import load_tokenizer

    preset, _, format = name.partition(":")
    model = models.build(preset, args.device, args.dtype).eval()
    model.save_pretrained(folder / "float")
    load_tokenizer().save_pretrained(folder / "float")
    if not format:
        return model, folder / "float"
    served = convert(folder / "float", folder / format, format)
    load_tokenizer().save_pretrained(served)
    return AutoModelForCausalLM.from_pretrained(served, dtype=args.dtype).to(args.device).eval(), served


def run_transformers(model: torch.nn.Module, batch: list[list[int]], args) -> list[dict[str, Any]]:
    def generate(ids: list[list[int]], new_tokens: int) -> None:
        inputs = torch.tensor(ids, device=args.device)
        with torch.no_grad():
            model.generate(inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    return [
        dict(batch=size, **_rates(total, statistics.median(ttft), args))
        for size, total, ttft in time_batches(
            generate, batch, args.batch_sizes, args.iters, args.max_tokens, args.device
        )
    ]


def run_vllm(folder: Path, batch: list[list[int]], args) -> list[dict[str, Any]]:
    """One engine in a child process (`--vllm-child`), so its workers are gone when it returns."""
    request, result = folder.parent / "vllm-request.json", folder.parent / "vllm-result.json"
    dtype = str(args.dtype).removeprefix("torch.")
    engine = dict(model=str(folder), dtype=dtype, max_num_seqs=max(args.batch_sizes), enforce_eager=args.enforce_eager)
    request.write_text(json.dumps(dict(engine=engine, batch=batch, iters=args.iters, max_tokens=args.max_tokens,
                                       batch_sizes=args.batch_sizes)))  # fmt: skip
    subprocess.run([sys.executable, __file__, "--vllm-child", str(request), str(result)], check=True)
    times = json.loads(result.read_text())
    return [
        dict(batch=size, **_rates(total, statistics.median(ttft), args))
        for size, total, ttft in zip(args.batch_sizes, times["total"], times["ttft"], strict=True)
    ]


def vllm_child(request_file: str, result_file: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.loads(Path(request_file).read_text())
    llm = LLM(**request["engine"], max_model_len=1024, seed=0)
    batch = [TokensPrompt(prompt_token_ids=ids) for ids in request["batch"]]

    def generate(prompts: list, new_tokens: int) -> None:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)

    timed = time_batches(generate, batch, request["batch_sizes"], request["iters"], request["max_tokens"], None)
    total, ttft = [total for _, total, _ in timed], [ttft for _, _, ttft in timed]
    Path(result_file).write_text(json.dumps(dict(ttft=ttft, total=total)))


def time_batches(
    generate: Callable[[list, int], None], batch: list, sizes: list[int], iters: int, max_tokens: int, device
) -> list[tuple[int, float, list[float]]]:
    """For each size b: (b, seconds to serve `batch` b requests at a time, `iters` times to first token of b requests)."""
    timed = []
    for size in sizes:
        generate(batch[:size], 2)  # warm-up
        ttft = [_timed(lambda: generate(batch[:size], 1), device) for _ in range(iters)]
        total = sum(
            _timed(lambda i=i: generate(batch[i : i + size], max_tokens), device) for i in range(0, len(batch), size)
        )
        timed.append((size, total, ttft))
    return timed


def _timed(fn, device: torch.device | None) -> float:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _rates(total_s: float, ttft_s: float, args) -> dict[str, float]:
    return {
        "requests_per_s": args.requests / total_s,
        "tokens_per_s": args.requests * args.max_tokens / total_s,
        "ttft_ms": 1e3 * ttft_s,
        "total_s": total_s,
    }


def main() -> None:
    args = parse_args()
    if args.vllm_child:
        vllm_child(*args.vllm_child)
        return
    batch = prompts(args)
    rows: list[dict[str, Any]] = []
    for size in args.sizes:
        for name in MODELS[size]:
            with tempfile.TemporaryDirectory() as folder:
                model, served = save_model(name, Path(folder), args)
                rows += [dict(model=name, engine="transformers", **row) for row in run_transformers(model, batch, args)]
                del model
                rows += [dict(model=name, engine="vllm", **row) for row in run_vllm(served, batch, args)]
            print(*rows[-2 * len(args.batch_sizes) :], sep="\n", flush=True)
    settings = dict(requests=args.requests, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                    batch_sizes=args.batch_sizes, iters=args.iters, enforce_eager=args.enforce_eager)  # fmt: skip
    if not args.no_plot:
        report.plot(args.results_dir / f"{args.name}.png", _panels(rows), f"serving, {env.device_name(args.device)}")
    columns = {"model": "model", "engine": "engine", "batch": "batch", "requests_per_s": "requests/s", "tokens_per_s": "tokens/s",
               "ttft_ms": "TTFT ms"}  # fmt: skip
    report.finish(args, {"settings": settings, "rows": rows}, report.format_table(rows, columns))


def _panels(rows: list[dict[str, Any]]) -> list[report.Panel]:
    """Generated tokens/s and time to first token against the batch size, a line per model and engine."""
    names = sorted({f"{row['model']} {row['engine']}" for row in rows})
    panels = []
    for key, title in (("tokens_per_s", "generated tokens/s"), ("ttft_ms", "time to first token (ms)")):
        lines = {
            name: ([r["batch"] for r in rows if f"{r['model']} {r['engine']}" == name],
                   [r[key] for r in rows if f"{r['model']} {r['engine']}" == name])
            for name in names
        }  # fmt: skip
        panels.append(report.Panel(title, title, lines, xlabel="requests served together", ylog=True))
    return panels


if __name__ == "__main__":
    main()
