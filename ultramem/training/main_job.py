"""The README's first command: UltraMem vs a dense model of the same compute, trained on the embedded corpus.

    python -m ultramem.training.main_job [--output_dir runs/main_job]

Trains `tiny-ultramem` and `tiny-dense` with the same recipe, data and steps (302 s and 199 s on 2 CPU cores that
other jobs shared: benchmarks/results/main_job/output.txt), prints their validation loss and perplexity side by side and the retrieval health of every memory layer on
the held-out text, writes `loss_curve.png`, keeps the UltraMem checkpoint (with tokenizer) and prints a sample
generation from it.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ultramem import presets, sizing
from ultramem.diagnostics import retrieval_diagnostics
from ultramem.training.arguments import DataArguments, ModelArguments, UltraMemTrainingArguments
from ultramem.training.pipeline import train

MODELS = ("tiny-ultramem", "tiny-dense")
PROMPT = "It was a dark and stormy night, and"


@dataclass
class RunResult:
    """What one training run left behind."""

    preset: str
    output_dir: str
    eval_loss: float
    seconds: float
    log_history: list[dict]
    health: dict[str, float]  # `retrieval_diagnostics` on the validation blocks; {} without memory layers
    health_tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.eval_loss)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="runs/main_job", help="Where both runs and the plot go.")
    parser.add_argument("--max_steps", type=int, default=120, help="Optimizer steps per model.")
    parser.add_argument("--batch_size", type=int, default=4, help="Blocks per step.")
    parser.add_argument("--block_size", type=int, default=128, help="Tokens per block.")
    parser.add_argument("--learning_rate", type=float, default=2e-3, help="Peak LR (values start at 10x).")
    parser.add_argument("--eval_blocks", type=int, default=32, help="Validation blocks for the evaluations.")
    parser.add_argument(
        "--logging_steps", type=int, default=None,
        help="Steps between training logs with memory diagnostics (default: a twelfth of --max_steps).",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--models", nargs="+", default=list(MODELS), metavar="PRESET",
        help="Presets to train with this recipe, the first kept and sampled (e.g. add tiny-ultramemv2 tiny-memoryplus).",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.logging_steps is not None and args.logging_steps < 1:
        parser.error(f"--logging_steps: {args.logging_steps} is not allowed; give a whole number >= 1")
    unknown = [name for name in args.models if name not in presets.PRESETS]
    if unknown:
        parser.error(f"--models: unknown preset(s) {', '.join(unknown)}; allowed: {', '.join(sorted(presets.PRESETS))}")
    return args


def train_one(preset: str, args: argparse.Namespace, config_overrides: str | None = None) -> RunResult:
    output_dir = os.path.join(args.output_dir, preset)
    training_args = UltraMemTrainingArguments(
        output_dir=output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=16,
        learning_rate=args.learning_rate,
        warmup_steps=0.05,
        seed=args.seed,
        eval_strategy="steps",
        eval_steps=max(1, args.max_steps // 4),
        logging_steps=args.logging_steps or max(1, args.max_steps // 12),
        save_strategy="no",
        report_to="none",
        diagnostics_batch_size=2,
    )
    data_args = DataArguments(block_size=args.block_size, max_eval_samples=args.eval_blocks)
    start = time.perf_counter()
    result = train(ModelArguments(preset=preset, config_overrides=config_overrides), data_args, training_args)
    seconds = time.perf_counter() - start
    model, blocks = result.trainer.model, torch.tensor(result.trainer.eval_dataset["input_ids"])
    has_memory = getattr(model.config, "memory_layers", None) or getattr(model.config, "ngram_layers", None)
    health = retrieval_diagnostics(model, blocks) if has_memory else {}
    metrics = (float(result.metrics["eval_loss"]), seconds, result.log_history, health, blocks.numel())
    return RunResult(preset, output_dir, *metrics)


def comparison_table(results: list[RunResult]) -> str:
    """Validation loss and perplexity of every run, side by side, with parameter counts."""
    lines = [f"{'model':<15}{'params':>10}{'activated':>11}{'val loss':>10}{'perplexity':>12}{'time (s)':>10}"]
    for result in results:
        counts = sizing.count_parameters(presets.get_config(result.preset))
        lines.append(
            f"{result.preset:<15}{counts['total'] / 1e6:>9.2f}M{counts['activated'] / 1e6:>10.2f}M"
            f"{result.eval_loss:>10.4f}{result.perplexity:>12.1f}{result.seconds:>10.0f}"
        )
    return "\n".join(lines)


def health_table(result: RunResult) -> str:
    """Per memory layer: how widely it reads its table on held-out text, and how alike its inputs are."""
    layers = sorted({int(key.split("/")[0][len("layer_") :]) for key in result.health if key.startswith("layer_")})
    lines = [
        f"retrieval health of {result.preset} on {result.health_tokens:,} held-out tokens "
        "(rows read vs uniform: 1.0 = as spread as chance; input cosine near 1: every token asks the same)",
    ]
    if layers:
        lines.append(
            f"{'memory layer':<14}{'rows read':>11}{'vs uniform':>12}{'KL to uniform':>15}{'input cosine':>14}"
        )
    for layer in layers:
        names = ("slot_usage", "usage_vs_uniform", "usage_kl", "input_cosine")
        stats = {name: result.health[f"layer_{layer}/{name}"] for name in names}
        lines.append(
            f"{layer:<14}{stats['slot_usage']:>10.1%}{stats['usage_vs_uniform']:>12.2f}"
            f"{stats['usage_kl']:>15.2f}{stats['input_cosine']:>14.2f}"
        )
    ngrams = sorted({int(key.split("/")[0][len("ngram_") :]) for key in result.health if key.startswith("ngram_")})
    if ngrams:
        lines.append(
            f"{'n-gram memory':<14}{'rows read':>11}{'vs uniform':>12}{'collisions':>12}{'gate mean, std':>17}"
        )
    for layer in ngrams:
        stats = {name: result.health[f"ngram_{layer}/{name}"] for name in NGRAM_HEALTH}
        lines.append(
            f"{layer:<14}{stats['slot_usage']:>10.1%}{stats['usage_vs_uniform']:>12.2f}{stats['collision_rate']:>11.1%}"
            f"{stats['gate_mean']:>11.2f}, {stats['gate_std']:.2f}"
        )
    return "\n".join(lines)


NGRAM_HEALTH = ("slot_usage", "usage_vs_uniform", "collision_rate", "gate_mean", "gate_std")


def plot_losses(results: list[RunResult], path: str) -> None:
    """Training loss (lines) and validation loss (markers) against step for every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for result in results:
        train = [(entry["step"], entry["loss"]) for entry in result.log_history if "loss" in entry]
        valid = [(entry["step"], entry["eval_loss"]) for entry in result.log_history if "eval_loss" in entry]
        (line,) = axis.plot(*zip(*train), label=f"{result.preset} train")
        axis.plot(*zip(*valid), "o--", color=line.get_color(), label=f"{result.preset} validation")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("cross-entropy loss (nats/token)")
    axis.set_title("Embedded Gutenberg corpus, same recipe and data")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def sample(checkpoint: str, seed: int) -> str:
    """A sampled continuation of `PROMPT` from the saved checkpoint, loaded the way users load it."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    torch.manual_seed(seed)
    output = model.generate(**inputs, max_new_tokens=40, do_sample=True, top_k=40, temperature=0.8)
    return tokenizer.decode(output[0], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    results = []
    for index, preset in enumerate(args.models, start=1):
        print(f"\n[{index}/{len(args.models)}] training {preset} for {args.max_steps} steps", flush=True)
        results.append(train_one(preset, args))
    plot_path = os.path.join(args.output_dir, "loss_curve.png")
    plot_losses(results, plot_path)
    checkpoint = results[0].output_dir
    print("\n" + comparison_table(results))
    for result in results:
        if result.health:
            print("\n" + health_table(result))
    print(f"\nloss curve: {plot_path}")
    print(f"UltraMem checkpoint: {checkpoint}  (AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True))")
    print(f"sample from {args.models[0]}: {sample(checkpoint, args.seed)!r}")


if __name__ == "__main__":
    main()
