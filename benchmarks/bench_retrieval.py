"""Which TDQKR candidate rule: the paper's sign-normalised quadrant, a quadrant per token, or signed candidates.

The SVD's sign is arbitrary, so the paper's "top-m of u^T S_row and t^T S_col" needs a sign convention; ours was
"u's largest-magnitude entry is positive", which flips (and changes every selection) when a core crosses
|u_0| = |u_1|. Three rules, measured at `tiny-ultramem` shape on CPU:

  sign-normalised   the rule before the fix: positive quadrant after the sign normalisation, m^2 candidates
  per-token         the quadrant (++ or --) with the higher best rank-1 score, per token: m^2 candidates
  signed            `tdqkr_signed_candidates=True`: m largest and m smallest per axis, 4 m^2 candidates

Metrics: jump (fraction of selected slots changed by a 2e-4 rad rotation of every core across the tie), recall
of the exact top-m over all n^2 cells at init and with rank-1 cores, memory-layer forward time, and the validation
loss of a small byte-level model trained on the shipped corpus (same seeds, same data for every rule).
CPU timings depend on the machine's load; compare them within one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_retrieval.py

Writes benchmarks/results/retrieval_cpu.json; the table is printed last.
"""

from __future__ import annotations

import contextlib
import json
import lzma
import statistics
from collections.abc import Iterator
from unittest import mock

import torch
from lib import cli, report, timing

from ultramem import UltraMemForCausalLM, memory_ops
from ultramem.diagnostics import retrieval_diagnostics
from ultramem.modeling_ultramem import TuckerQueryKeyRetrieval, core_svd
from ultramem.presets import get_config
from ultramem.training.data import embedded_corpus_files

RULES = ("sign-normalised", "per-token", "signed")


def _positive_quadrant(projected, topk, signed):
    """The rule before the fix: the top-m of each axis' rank-1 projection (with the sign-normalised u, t below)."""
    return projected.topk(topk, dim=-1).indices


def _sign_normalised_vectors(self):
    """u, t flipped so that u's largest-magnitude entry is positive."""
    _, u, t = core_svd(self.cores.sum(1).float())
    sign = u.gather(-1, u.abs().argmax(-1, keepdim=True)).sign()  # (H, 1)
    return (torch.stack((u, t)) * sign).unsqueeze(-1).to(self.cores.dtype)  # (2, H, r, 1)


@contextlib.contextmanager
def candidate_rule(rule: str) -> Iterator[None]:
    """Every TDQKR retrieval inside uses `rule`'s candidates ("signed" is the config's `tdqkr_signed_candidates`)."""
    if rule != "sign-normalised":
        yield
        return
    with (
        mock.patch.object(memory_ops, "rank_one_candidates", _positive_quadrant),
        mock.patch.object(TuckerQueryKeyRetrieval, "leading_singular_vectors", _sign_normalised_vectors),
    ):
        yield


def build(rule: str, seed: int, **overrides) -> UltraMemForCausalLM:
    config = get_config("tiny-ultramem", tdqkr_signed_candidates=rule == "signed", **overrides)
    torch.manual_seed(seed)
    return UltraMemForCausalLM(config)


def rotation(angle: float) -> torch.Tensor:
    cos, sin = torch.tensor(angle).cos(), torch.tensor(angle).sin()
    return torch.stack([torch.stack([cos, -sin]), torch.stack([sin, cos])])


@torch.no_grad()
def jump(rule: str, hidden: torch.Tensor) -> float:
    """Fraction of selected slots changed when every core's u rotates by 2e-4 rad across |u_0| = |u_1|."""
    layer = build(rule, seed=0).eval().model.memory_layers[0]
    selections = []
    for angle in (-1e-4, 1e-4):
        core = rotation(3 * torch.pi / 4 + angle) @ torch.diag(torch.tensor([1.0, 0.3])) @ rotation(0.5).T
        layer.retrieval.cores.copy_(core.expand_as(layer.retrieval.cores) / layer.retrieval.cores.shape[1])
        selections.append(layer.retrieve(hidden)[0].sort(-1).values)
    return (selections[0] != selections[1]).float().mean().item()


@torch.no_grad()
def recall(rule: str, input_ids: torch.Tensor, rank_one: bool) -> float:
    model = build(rule, seed=0).eval()
    if rank_one:
        generator = torch.Generator().manual_seed(1)
        for layer in model.model.memory_layers:
            cores = layer.retrieval.cores  # (H, h, r, r)
            u, t = torch.randn(2, cores.shape[0], cores.shape[-1], generator=generator)
            cores.copy_((torch.einsum("ha,hb->hab", u, t) / cores.shape[1]).unsqueeze(1).expand_as(cores))
    return retrieval_diagnostics(model, input_ids)["tdqkr_recall"]


@torch.no_grad()
def forward_ms(rule: str, hidden: torch.Tensor, repeats: int) -> float:
    layer = build(rule, seed=0).eval().model.memory_layers[0]
    return timing.measure(lambda: layer(hidden), hidden.device, warmup=1, iters=repeats)["median_ms"]


def byte_blocks(split: str, count: int, length: int) -> torch.Tensor:
    """`count` blocks of `length` bytes, evenly spaced over the shipped Gutenberg slice."""
    with lzma.open(embedded_corpus_files()[split], "rt", encoding="utf-8") as handle:
        data = torch.tensor(list("".join(json.loads(line)["text"] for line in handle).encode("utf-8")))
    starts = torch.linspace(0, len(data) - length - 1, count).long()
    return torch.stack([data[s : s + length] for s in starts.tolist()])


def train_loss(rule: str, seed: int, train: torch.Tensor, valid: torch.Tensor, steps: int, batch: int) -> float:
    """Validation loss after `steps` AdamW steps of a byte-level tiny-ultramem (vocab 256, context 128)."""
    model = build(rule, seed, vocab_size=256, bos_token_id=None, eos_token_id=None, pad_token_id=None).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    for step in range(steps):
        ids = train[order[(step * batch + torch.arange(batch)) % len(train)]]
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        return statistics.fmean(model(block, labels=block).lm_loss.item() for block in valid.split(8))


def main(argv: list[str] | None = None) -> None:
    parser = cli.make_parser(__doc__, "retrieval_cpu", device=False, timed=False, plot=False)
    parser.add_argument("--seeds", type=int, default=2, help="seeds of the byte-level training runs")
    parser.add_argument("--steps", type=int, default=60, help="AdamW steps of each training run")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20, help="timed forwards of the memory layer (median reported)")
    args = cli.resolve(parser.parse_args(argv), "retrieval_cpu")
    cli.at_least(args, seeds=1, steps=1, batch_size=1, repeats=1)
    torch.set_num_threads(1)
    config = get_config("tiny-ultramem")
    hidden = torch.randn(8, 128, config.hidden_size, generator=torch.Generator().manual_seed(0))
    input_ids = torch.randint(1, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    train, valid = byte_blocks("train", 4096, 128), byte_blocks("validation", 64, 128)
    rows = []
    for rule in RULES:
        with candidate_rule(rule):
            losses = [train_loss(rule, seed, train, valid, args.steps, args.batch_size) for seed in range(args.seeds)]
            rows.append({"rule": rule, "jump": jump(rule, hidden), "recall": recall(rule, input_ids, False),
                         "recall_rank1": recall(rule, input_ids, True),
                         "forward_ms": forward_ms(rule, hidden, args.repeats),
                         "valid_losses": losses, "valid_loss": statistics.fmean(losses)})  # fmt: skip
        print(f"[bench_retrieval] {rule} done", flush=True)
    settings = {"preset": "tiny-ultramem", "n": config.memory_num_keys, "m": config.memory_topk,
                "heads": config.memory_heads, "seeds": args.seeds, "steps": args.steps, "batch_size": args.batch_size,
                "valid_loss": f"byte-level, {args.steps} steps x {args.batch_size} x 128 tokens"}  # fmt: skip
    columns = {"rule": "rule", "jump": "jump", "recall": "recall", "recall_rank1": "recall r1", "forward_ms": "fwd ms",
               "valid_loss": "valid loss (mean over seeds)"}  # fmt: skip
    report.finish(args, {"settings": settings, "rows": rows}, report.format_table(rows, columns))


if __name__ == "__main__":
    main()
