"""The query normalisation's robustness (docs/design.md): for each `query_norm`, on `tiny-ultramem` after a few AdamW
steps of random tokens, the gradient norm of a batch of 2-128 tokens (whole model, and the memory layers' query
projections), and how gradient accumulation compares with the full batch (4 micro-batches of 1 x T against 1 batch of
4 x T: cosine of the query projections' gradients, relative difference of the whole gradient). Prints a table, writes
JSON and a PNG.

    python benchmarks/bench_query_statistics.py          # about 2 minutes on one CPU core
"""

from __future__ import annotations

import argparse

import torch
from lib import cli, report

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


def main(argv: list[str] | None = None) -> None:
    parser = cli.make_parser(__doc__, "query_statistics_cpu", device=False, timed=False)
    parser.add_argument("--preset", default="tiny-ultramem")
    parser.add_argument("--modes", type=lambda text: cli.names(text, QUERY_NORMS, "--modes"),
                        default="none,batch_whiten,running_whiten", help=f"of {', '.join(QUERY_NORMS)}")  # fmt: skip
    parser.add_argument("--steps", type=int, default=10, help="AdamW steps before measuring (running statistics)")
    parser.add_argument("--accumulation-tokens", type=int, default=128)
    args = cli.resolve(parser.parse_args(argv), "query_statistics_cpu")
    cli.at_least(args, steps=0, accumulation_tokens=1)
    torch.set_num_threads(1)
    rows = []
    for mode in args.modes:
        rows.append(measure(mode, args))
        print(f"[bench_query_statistics] {mode} done", flush=True)
    settings = {key: getattr(args, key) for key in ("preset", "modes", "steps", "accumulation_tokens")}
    if not args.no_plot:
        series = {row["query_norm"]: (list(TOKENS), [row[f"grad_{t}"] for t in TOKENS]) for row in rows}
        panel = report.Panel("Gradient norm of one batch", "whole-model gradient norm", series, "tokens in the batch",
                             ylog=True)  # fmt: skip
        report.plot(args.results_dir / f"{args.name}.png", [panel], f"{args.preset} after {args.steps} steps")
    columns = {"query_norm": "query_norm", **{f"grad_{t}": f"|g| {t} tok" for t in TOKENS},
               "accumulation_query_cosine": "accum. query cos", "accumulation_relative_difference": "accum. rel diff"}  # fmt: skip
    report.finish(args, {"settings": settings, "rows": rows}, report.format_table(rows, columns))


if __name__ == "__main__":
    main()
