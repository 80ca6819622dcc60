"""The query normalisation's robustness (docs/design.md): for each `query_norm`, on `tiny-ultramem` after a few AdamW
steps of random tokens, the gradient norm of a batch of 2-128 tokens (whole model, and the memory layers' query
projections), and how gradient accumulation compares with the full batch (4 micro-batches of 1 x T against 1 batch of
4 x T: cosine of the query projections' gradients, relative difference of the whole gradient). Prints a table, writes
JSON and a PNG.

    python benchmarks/bench_query_statistics.py          # about 2 minutes on one CPU core
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from lib import env
from lib.report import Panel, format_table, plot, write_json

from ultramem.configuration_ultramem import QUERY_NORMS
from ultramem.presets import get_config
from ultramem.sizing import build_model

TOKENS = (2, 4, 8, 16, 32, 128)


def trained(mode: str, steps: int, preset: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = get_config(preset, query_norm=mode)
    model = build_model(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        input_ids = torch.randint(3, config.vocab_size, (4, 64), generator=generator)
        model(input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def gradients(model: torch.nn.Module, batches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(whole gradient, the query projections' gradient), flattened, of the mean loss over `batches` (accumulated)."""
    model.zero_grad()
    for input_ids in batches:
        (model(input_ids, labels=input_ids).loss / len(batches)).backward()
    queries = [layer.query.proj.weight.grad.flatten() for layer in model.model.memory_layers]
    whole = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    return torch.cat(whole), torch.cat(queries)


def measure(mode: str, args: argparse.Namespace) -> dict:
    model = trained(mode, args.steps, args.preset)
    row: dict = {"query_norm": mode}
    for tokens in TOKENS:
        input_ids = torch.randint(
            3, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tokens)
        )
        whole, query = gradients(model, [input_ids])
        row[f"grad_{tokens}"], row[f"query_grad_{tokens}"] = whole.norm().item(), query.norm().item()
    batch = torch.randint(
        3, model.config.vocab_size, (4, args.accumulation_tokens), generator=torch.Generator().manual_seed(9)
    )
    full, full_query = gradients(model, [batch])
    micro, micro_query = gradients(model, list(batch.split(1)))
    row["accumulation_query_cosine"] = torch.nn.functional.cosine_similarity(micro_query, full_query, dim=0).item()
    row["accumulation_relative_difference"] = ((micro - full).norm() / full.norm()).item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-ultramem")
    parser.add_argument("--modes", default="none,batch_whiten,running_whiten", help=f"of {', '.join(QUERY_NORMS)}")
    parser.add_argument("--steps", type=int, default=10, help="AdamW steps before measuring (running statistics)")
    parser.add_argument("--accumulation-tokens", type=int, default=128)
    parser.add_argument("--results-dir", type=Path, default=env.RESULTS_DIR)
    parser.add_argument("--name", default="query_statistics_cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for mode in args.modes.split(","):
        rows.append(measure(mode, args))
        print(f"[bench_query_statistics] {mode} done", flush=True)
    columns = {"query_norm": "query_norm", **{f"grad_{t}": f"|g| {t} tok" for t in TOKENS},
               "accumulation_query_cosine": "accum. query cos", "accumulation_relative_difference": "accum. rel diff"}  # fmt: skip
    table = format_table(rows, columns)
    settings = {key: value for key, value in vars(args).items() if key not in ("results_dir", "name")}
    path = write_json(
        args.results_dir / f"{args.name}.json", {"environment": env.environment("cpu", **settings), "rows": rows}
    )
    series = {row["query_norm"]: (list(TOKENS), [row[f"grad_{t}"] for t in TOKENS]) for row in rows}
    plot(path.with_suffix(".png"), [Panel("Gradient norm of one batch", "whole-model gradient norm", series,
                                          "tokens in the batch", ylog=True)], f"{args.preset} after {args.steps} steps")  # fmt: skip
    print(f"wrote {path}")
    print(table)


if __name__ == "__main__":
    main()
