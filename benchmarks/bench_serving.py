"""Serving throughput and latency: vLLM (`ultramem.vllm`) against Transformers' `generate`, UltraMem and dense.

For each model (a preset of `ultramem.presets`, random weights, saved with the shipped tokenizer) both engines get
the same `--requests` prompts of `--prompt-len` random tokens and generate `--max-tokens` tokens greedily:
- Transformers: `generate` on batches of `--max-num-seqs` prompts (equal lengths: no padding), one after another;
- vLLM: one `LLM.generate` call with all requests, `max_num_seqs=--max-num-seqs` (continuous batching).
Reported: requests/s and generated tokens/s over the whole run, and the time to first token of one batch of
`--max-num-seqs` requests arriving together (the same prompts with one token to generate), median of `--iters`.
Each vLLM engine runs in a child process (its start-up, 20-60 s on CPU, is not timed).

Run it in the vLLM environment (.ci/vllm_tests.sh builds .venv-vllm). CPU (tiny presets, float32, a few minutes; one
thread: on shared cores two spinning OpenMP threads made `generate` 6x slower):

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=2 .venv-vllm/bin/python benchmarks/bench_serving.py --sizes tiny --iters 5

GPU (a vLLM build for CUDA, bf16; not run yet). vLLM runs eagerly (`enforce_eager`): the UltraMem class is not
compiled (docs/serving.md):

    python benchmarks/bench_serving.py --device cuda --sizes tiny,small --requests 256 --max-num-seqs 64

Writes benchmarks/results/serving_<device>.json and .png; the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lib import cli, models, report
from lib.env import environment

MODELS = {"tiny": ("tiny-dense", "tiny-ultramem"), "small": ("small-dense", "small-ultramem")}
ENGINES = ("transformers", "vllm")


def parse_args():
    parser = cli.make_parser(__doc__, "serving")
    add = parser.add_argument
    add("--sizes", type=cli.sizes, default=["tiny"], help=f"comma-separated, of {sorted(MODELS)}")
    add("--requests", type=int, default=32, help="prompts per run")
    add("--prompt-len", type=int, default=64, help="tokens per prompt")
    add("--max-tokens", type=int, default=32, help="tokens generated per request")
    add("--max-num-seqs", type=int, default=8, help="vLLM's concurrent sequences; Transformers' batch size")
    add(
        "--vllm-child", nargs=2, metavar=("REQUEST", "RESULT"), help=argparse.SUPPRESS
    )  # internal: the child that runs one engine
    args = parser.parse_args()
    if args.vllm_child:
        return args
    args = cli.resolve(args, "serving")
    cli.at_least(args, requests=1, prompt_len=1, max_tokens=1, max_num_seqs=1)
    for size in args.sizes:
        if size not in MODELS:
            raise SystemExit(f"--sizes: {size!r} is not one of {sorted(MODELS)}")
    return args


def prompts(args) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(10, 50000, (args.requests, args.prompt_len), generator=generator).tolist()


def save_model(preset: str, folder: Path, args) -> torch.nn.Module:
    from ultramem.tokenization import load_tokenizer

    model = models.build(preset, args.device, args.dtype).eval()
    model.save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    return model


def run_transformers(model: torch.nn.Module, batch: list[list[int]], args) -> dict[str, float]:
    def generate(ids: list[list[int]], new_tokens: int) -> None:
        inputs = torch.tensor(ids, device=args.device)
        with torch.no_grad():
            model.generate(inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    first = batch[: args.max_num_seqs]
    generate(first, 2)  # warm-up
    ttft = [_timed(lambda: generate(first, 1), args.device) for _ in range(args.iters)]
    total = sum(
        _timed(lambda i=i: generate(batch[i : i + args.max_num_seqs], args.max_tokens), args.device)
        for i in range(0, len(batch), args.max_num_seqs)
    )
    return _rates(total, statistics.median(ttft), args)


def run_vllm(folder: Path, batch: list[list[int]], args) -> dict[str, float]:
    """One engine in a child process (`--vllm-child`), so its workers are gone when it returns."""
    request, result = folder / "vllm-request.json", folder / "vllm-result.json"
    dtype = str(args.dtype).removeprefix("torch.")
    settings = dict(model=str(folder), dtype=dtype, max_num_seqs=args.max_num_seqs, enforce_eager=True)
    request.write_text(json.dumps(dict(engine=settings, batch=batch, iters=args.iters, max_tokens=args.max_tokens)))
    subprocess.run([sys.executable, __file__, "--vllm-child", str(request), str(result)], check=True)
    times = json.loads(result.read_text())
    return _rates(times["total"], statistics.median(times["ttft"]), args)


def vllm_child(request_file: str, result_file: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.loads(Path(request_file).read_text())
    llm = LLM(**request["engine"], max_model_len=1024, seed=0)
    batch = [TokensPrompt(prompt_token_ids=ids) for ids in request["batch"]]
    first = batch[: request["engine"]["max_num_seqs"]]

    def generate(prompts: list, new_tokens: int) -> None:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)

    generate(first, 2)  # warm-up
    ttft = [_timed(lambda: generate(first, 1), None) for _ in range(request["iters"])]
    total = _timed(lambda: generate(batch, request["max_tokens"]), None)
    Path(result_file).write_text(json.dumps(dict(ttft=ttft, total=total)))


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
        for preset in MODELS[size]:
            with tempfile.TemporaryDirectory() as folder:
                model = save_model(preset, Path(folder), args)
                rows.append(dict(model=preset, engine="transformers", **run_transformers(model, batch, args)))
                del model
                rows.append(dict(model=preset, engine="vllm", **run_vllm(Path(folder), batch, args)))
            print(rows[-2], rows[-1], flush=True)
    settings = dict(dtype=args.dtype, requests=args.requests, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                    max_num_seqs=args.max_num_seqs, iters=args.iters)  # fmt: skip
    path = report.write_json(
        args.results_dir / f"{args.name}.json", {"environment": environment(args.device, **settings), "rows": rows}
    )
    if not args.no_plot:
        report.plot(path.with_suffix(".png"), _panels(rows), suptitle=f"serving, {environment(args.device)['device']}")
    print(f"wrote {path}")
    columns = {"model": "model", "engine": "engine", "requests_per_s": "requests/s", "tokens_per_s": "tokens/s",
               "ttft_ms": "TTFT ms"}  # fmt: skip
    print(report.format_table(rows, columns))


def _panels(rows: list[dict[str, Any]]) -> list[report.Panel]:
    names = list(dict.fromkeys(row["model"] for row in rows))

    def ticks(axis) -> None:
        axis.set_xticks(range(len(names)), names, fontsize=7)

    panels = []
    for key, title in (("tokens_per_s", "generated tokens/s"), ("ttft_ms", "time to first token (ms)")):
        series = {
            engine: (
                list(range(len(names))),
                [next(r[key] for r in rows if r["model"] == n and r["engine"] == engine) for n in names],
            )
            for engine in ENGINES
        }
        panels.append(report.Panel(title, title, series, xlog=False, linestyle="none", draw=ticks))
    return panels


if __name__ == "__main__":
    main()
