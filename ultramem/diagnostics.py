"""Retrieval diagnostics of the memory layers (paper Fig. 8): TDQKR recall, slot usage, top-1 score, output std."""

from __future__ import annotations

import torch

from .modeling_ultramem import UltraMemForCausalLM, UltraMemMemoryLayer, select_memory_ops


@torch.no_grad()
def _layer_statistics(
    layer: UltraMemMemoryLayer,
    hidden_states: torch.Tensor,
    padding_mask: torch.Tensor | None,
    keep: torch.Tensor,
    chunk: int,
) -> dict[str, float]:
    """Statistics of one memory layer for its input (B, T, D), over the tokens where `keep` (B, T) is set."""
    config = layer.config
    ops = select_memory_ops(config.memory_kernel, hidden_states.device)
    row_query, col_query = layer.query(layer.norm(hidden_states), padding_mask, None)
    virtual_index, scores = layer.retrieval(row_query, col_query, ops)  # (B, T, H, m), (B, T, H, m, h)
    virtual_index, scores = virtual_index[keep], scores[keep]  # (tokens, H, m), (tokens, H, m, h)
    row_scores, col_scores = layer.retrieval.axis_scores(row_query, col_query)
    row_scores, col_scores = row_scores[keep], col_scores[keep]  # (tokens, H, r, n)

    hits = torch.zeros((), dtype=torch.long, device=virtual_index.device)
    for start in range(0, row_scores.shape[0], chunk):  # exact top-m over all n^2 cells, a chunk at a time
        grid = layer.retrieval.grid_scores(row_scores[start : start + chunk], col_scores[start : start + chunk])
        exact = grid.flatten(-2).topk(config.memory_topk, dim=-1).indices  # (chunk, H, m)
        approx = virtual_index[start : start + chunk]
        hits += (approx.unsqueeze(-1) == exact.unsqueeze(-2)).any(-1).sum()  # one host sync, at the end

    physical, _ = layer.value_expansion.physical_slots(virtual_index)
    return {
        "tdqkr_recall": hits.item() / max(virtual_index.numel(), 1),
        "slot_usage": physical.unique().numel() / layer.value_expansion.num_values,
        "top1_score": scores.sum(-1).amax(-1).mean().item(),
    }


@torch.no_grad()
def retrieval_diagnostics(
    model: UltraMemForCausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    chunk: int = 64,
) -> dict[str, float]:
    """Mean over memory layers of what the paper tracks during training, for one batch.

    tdqkr_recall: fraction of the exact top-m (over all n^2 grid cells) that the two-phase approximate
        top-m retrieves; 1.0 for product keys, where the two-phase search is exact.
    slot_usage: fraction of the N physical value rows the batch touches.
    top1_score: mean over tokens and heads of the highest selected score (summed over MCS cores).
    memory_output_std: standard deviation of the memory layers' outputs.
    """
    memory_layers = list(model.model.memory_layers)
    if not memory_layers:
        return {}
    captured: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = {}

    def capture(layer: UltraMemMemoryLayer):
        def hook(module, args, output):
            hidden_states = args[0]
            padding_mask = args[1] if len(args) > 1 else None
            captured[layer.memory_idx] = (hidden_states, padding_mask, output)

        return hook

    handles = [layer.register_forward_hook(capture(layer)) for layer in memory_layers]
    was_training = model.training
    model.eval()
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()

    keep = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    totals = {"tdqkr_recall": 0.0, "slot_usage": 0.0, "top1_score": 0.0, "memory_output_std": 0.0}
    for layer in memory_layers:
        hidden_states, padding_mask, output = captured[layer.memory_idx]
        stats = _layer_statistics(layer, hidden_states, padding_mask, keep, chunk)
        stats["memory_output_std"] = output[keep].float().std().item()
        for key, value in stats.items():
            totals[key] += value / len(memory_layers)
    return totals
