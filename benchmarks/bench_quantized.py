"""The quality cost of quantized value tables: validation loss and per-token KL to fp32, fp32 vs int8 vs int4.

    OMP_NUM_THREADS=1 python benchmarks/bench_quantized.py --checkpoint runs/tiny-ultramem \
        [--int4-group-sizes 64 32] [--blocks 32 --block-size 128] [--output results/quantized.json]

Every variant is the same checkpoint with its value tables quantized at load (`ultramem.quantized`, the "local"
store, CPU op), run on the same fixed validation blocks (the package's embedded Gutenberg valid split by default,
blocks taken evenly across it). Reported per variant: the language-model loss (mean next-token cross entropy), its
change against fp32 (absolute and relative), the mean per-token KL(fp32 || variant) in nats, the table bytes and
the tables' relative rms error. The KL is computed from the two models' log-probabilities at every position.
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / "ultramem" / "data" / "corpus" / "valid.jsonl.xz"


def validation_blocks(tokenizer, data: Path, blocks: int, block_size: int) -> torch.Tensor:
    """(blocks, block_size) token ids taken evenly across the concatenated validation texts."""
    opener = lzma.open if data.suffix == ".xz" else open
    with opener(data, "rt") as handle:
        text = "\n\n".join(json.loads(line)["text"] for line in handle)
    ids = torch.tensor(tokenizer(text)["input_ids"])
    usable = ids.numel() // block_size
    if usable < blocks:
        sys.exit(f"error: {data} has {usable} blocks of {block_size} tokens, fewer than --blocks {blocks}")
    starts = torch.linspace(0, usable - 1, blocks).long() * block_size
    return torch.stack([ids[s : s + block_size] for s in starts.tolist()])


def table_error(model, reference) -> tuple[int, float]:
    """Bytes of the value tables and their rms error relative to the reference's float tables."""
    from ultramem.quantized import dequantize

    nbytes, error, norm = 0, 0.0, 0.0
    for (_, layer), (_, ref) in zip(model.named_memory_layers(), reference.named_memory_layers(), strict=True):
        table, exact = layer.values.weight, ref.values.weight.detach().float()
        nbytes += table.numel() * table.element_size()
        dense = dequantize(table, layer.values.format, layer.values.group_size) if table.dtype == torch.uint8 else table
        error += (dense.float() - exact).pow(2).sum().item()
        norm += exact.pow(2).sum().item()
    return nbytes, (error / norm) ** 0.5


@torch.no_grad()
def measure(
    checkpoint: str | Path,
    blocks: torch.Tensor,
    variants: list[tuple[str, str | None, int | None]],
    batch_size: int = 8,
) -> list[dict]:
    """One row per (name, format, group size) variant; the first must be the float model (format None).

    Every model is loaded first, then each batch of blocks runs through all of them: the fp32 log-probabilities of a
    batch are compared with each variant's at once (the vocabulary-wide log-probs of every block never coexist).
    """
    from ultramem import UltraMemForCausalLM
    from ultramem.quantized import from_pretrained_quantized

    models = []
    for _, format, group_size in variants:
        if format is None:
            model = UltraMemForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        else:
            model = from_pretrained_quantized(
                UltraMemForCausalLM,
                checkpoint,
                memory_quantization=format,
                memory_quantization_group_size=group_size,
                dtype=torch.float32,
            )
        models.append(model.eval())
    losses, kls = [0.0] * len(models), [0.0] * len(models)
    for batch in blocks.split(batch_size):
        targets = batch[:, 1:].unsqueeze(-1)
        reference = None
        for i, model in enumerate(models):
            lp = F.log_softmax(model(input_ids=batch).logits[:, :-1].float(), dim=-1)
            reference = lp if reference is None else reference
            losses[i] -= lp.gather(-1, targets).sum().item()
            kls[i] += (reference.exp() * (reference - lp)).sum().item()
    tokens = blocks[:, 1:].numel()
    reference_loss = losses[0] / tokens
    rows = []
    for (name, format, _), model, loss_sum, kl_sum in zip(variants, models, losses, kls, strict=True):
        loss = loss_sum / tokens
        nbytes, rms = table_error(model, models[0])
        rows.append(
            dict(
                variant=name,
                format=format,
                group_size=getattr(model.model.memory_layers[0].values, "group_size", None),
                loss=loss,
                loss_change=loss - reference_loss,
                loss_change_relative=(loss - reference_loss) / reference_loss,
                kl_per_token=kl_sum / tokens,
                table_bytes=nbytes,
                table_rms_error=rms,
            )
        )
    return rows


def markdown(rows: list[dict], tokens: int, checkpoint: str) -> str:
    lines = [
        f"Checkpoint `{checkpoint}`, {tokens} predicted tokens.",
        "",
        "| variant | group | loss | change | relative | KL/token (nats) | table MB | table rms error |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['group_size'] or '-'} | {r['loss']:.5f} | {r['loss_change']:+.5f} | "
            f"{r['loss_change_relative']:+.3%} | {r['kl_per_token']:.2e} | {r['table_bytes'] / 1e6:.2f} | "
            f"{r['table_rms_error']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a trained (float) UltraMem checkpoint folder")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="validation jsonl(.xz) with a 'text' field")
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--int4-group-sizes", type=int, nargs="+", default=[64, 32])
    parser.add_argument("--output", type=Path, help="write the rows as JSON here (and the table beside it as .md)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    blocks = validation_blocks(tokenizer, args.data, args.blocks, args.block_size)
    variants = [("fp32", None, None), ("int8", "int8", None)]
    variants += [(f"int4-g{g}", "int4", g) for g in args.int4_group_sizes]
    rows = measure(args.checkpoint, blocks, variants, args.batch_size)
    table = markdown(rows, blocks[:, 1:].numel(), args.checkpoint)
    print(table)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"checkpoint": str(args.checkpoint), "rows": rows}, indent=2) + "\n")
        args.output.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
