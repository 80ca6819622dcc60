"""Two models that should compute one function (sharded against one process, two CPU dispatch levels), compared
where that function is defined: a memory layer's top-m is a step function of its scores, so float32 noise in the
weights may flip a pick that sits on a near-tie, and every later token of that sequence then reads other rows.
Logits are compared strictly before the first flipped pick of each sequence; each flip is counted and its margin
(how far the reference model's own scores are from picking the other model's slots) is reported against the
score noise (how far the two models' scores of one slot are apart)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ultramem.diagnostics import score_factors


@dataclass
class SelectionComparison:
    flipped: list[tuple[int, int, int]]  # (memory layer, sequence, token) whose picks differ
    margins: list[float]  # per flip: the reference's score gap between its own picks and the other's, >= 0
    score_noise: float  # the largest |score difference| of one slot picked by both, over all layers and tokens
    logits_error: float  # the largest |logit difference| before each sequence's first flip
    compared_tokens: int  # the tokens before each sequence's first flip


def _picks(model: torch.nn.Module, input_ids: torch.Tensor, training: bool) -> tuple[list[tuple], torch.Tensor]:
    """Each memory layer's (queries (B, T, H, Q, r, Dk/r), virtual addresses (B, T, H, m), scores (B, T, H, m)) and the
    logits, from one forward: as inference computes it, or (`training`) as a training step's forward does."""
    layers, captured = list(model.model.memory_layers), {}

    def hook(idx):
        return lambda module, args, output: captured.__setitem__(idx, (args[0], output[0], output[1].sum(-1)))

    handles = [layer.retrieval.register_forward_hook(hook(idx)) for idx, layer in enumerate(layers)]
    try:
        with torch.set_grad_enabled(training):
            logits = model.train(training)(input_ids=input_ids, use_cache=False).logits.detach()
    finally:
        for handle in handles:
            handle.remove()
    return [tuple(part.detach() for part in captured[idx]) for idx in range(len(layers))], logits


def _cell_scores(factors: tuple[torch.Tensor, torch.Tensor], cells: torch.Tensor) -> torch.Tensor:
    """The exact grid scores (K,) of `cells` (K, 4): (sequence, token, head, virtual address x * n + y), from the
    retrieval's score factors (B, T, H, k, n) each."""
    row_factors, col_factors = factors
    b, t, h, address = cells.unbind(-1)
    num_keys = row_factors.shape[-1]
    return (row_factors[b, t, h, :, address // num_keys] * col_factors[b, t, h, :, address % num_keys]).sum(-1)


def compare_selections(reference, other, input_ids: torch.Tensor, training: bool = False) -> SelectionComparison:
    picks_ref, logits_ref = _picks(reference, input_ids, training)
    picks_other, logits_other = _picks(other, input_ids, training)
    first_flip = torch.full(input_ids.shape[:1], input_ids.shape[1])
    flipped, margins, noise = [], [], 0.0
    for idx, ((queries, index_ref, scores_ref), (_, index_other, scores_other)) in enumerate(
        zip(picks_ref, picks_other)
    ):
        index_ref, order_ref = index_ref.sort(-1)
        index_other, order_other = index_other.sort(-1)
        same = (index_ref == index_other).all(-1)  # (B, T, H)
        common = scores_ref.gather(-1, order_ref) - scores_other.gather(-1, order_other)
        noise = max(noise, common[same].abs().max().item() if same.any() else 0.0)
        if same.all():
            continue
        retrieval = reference.model.memory_layers[idx].retrieval
        with torch.no_grad():
            # the reference's exact scores
            factors = score_factors(retrieval, *retrieval.axis_scores(queries).unbind(-4))
        for b, t, h in (~same).nonzero().tolist():
            only_ref = [int(x) for x in index_ref[b, t, h] if x not in index_other[b, t, h]]
            only_other = [int(x) for x in index_other[b, t, h] if x not in index_ref[b, t, h]]
            cells = torch.tensor([[b, t, h, x] for x in only_ref + only_other])
            scores = _cell_scores(factors, cells)
            margins.append((scores[: len(only_ref)].min() - scores[len(only_ref) :].max()).item())
            flipped.append((idx, b, t))
            first_flip[b] = min(first_flip[b], t)
    before = torch.arange(input_ids.shape[1]) < first_flip.unsqueeze(-1)  # (B, T)
    error = (logits_ref - logits_other)[before].abs().max().item() if before.any() else 0.0
    return SelectionComparison(sorted(set(flipped)), margins, noise, error, int(before.sum()))
