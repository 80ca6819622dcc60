"""Retrieval diagnostics of the memory layers (paper Fig. 8): TDQKR recall, slot usage, top-1 score, output std.

Nothing here materialises the n x n score grid (6.6 GB per chunk of 64 tokens at the 1.6B-x12 preset): the exact
top-m is found by a bounded search over rows (`exact_top_m`). Under DeepSpeed ZeRO-3 the retrieval's own small
parameters (keys, cores) are gathered for the statistics, the value tables never are; under FSDP2 each memory layer
is unsharded for them, as for its forward. Every rank must run the diagnostics there (the gathers are collective).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch
from torch.distributed.fsdp import FSDPModule

from .modeling_ultramem import KeyRetrieval, TuckerQueryKeyRetrieval, UltraMemForCausalLM, UltraMemMemoryLayer
from .ngram_memory import NGramMemory


def score_factors(
    retrieval: KeyRetrieval, row_scores: torch.Tensor, col_scores: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., k, n) factors F_row, F_col of a retrieval's exact grid scores, [x, y] = F_row[:, x] . F_col[:, y], from
    its axis scores (`axis_scores`).

    PKM (k = 2): s_row[x] + s_col[y] = [s_row[x], 1] . [1, s_col[y]]. TDQKR (k = r): in the SVD basis of the summed
    core C = U diag(sigma) T^T, F_row = diag(sigma) U^T S_row and F_col = T^T S_col, so the leading rank-1 term comes
    first and per-axis bounds on the score are tight.
    """
    if not isinstance(retrieval, TuckerQueryKeyRetrieval):
        ones = torch.ones_like(row_scores)  # (..., 1, n): r = 1
        return torch.cat([row_scores, ones], dim=-2), torch.cat([ones, col_scores], dim=-2)
    left, singular_values, right_h = torch.linalg.svd(retrieval.cores.sum(1).float())  # (H, r, r), (H, r), (H, r, r)
    row = torch.einsum("hak,...han->...hkn", left * singular_values.unsqueeze(-2), row_scores.float())
    return row, torch.einsum("hkb,...hbn->...hkn", right_h, col_scores.float())


def exact_top_m(row_factors: torch.Tensor, col_factors: torch.Tensor, top_m: int, rows_per_step: int) -> torch.Tensor:
    """Exact top-m cells x * n + y (P, m) of the grids F_row[:, :, x] . F_col[:, :, y], for P grids of (k, n) factors.

    Each row x is bounded by sum_k max(F_row[k, x] max_y F_col[k, y], F_row[k, x] min_y F_col[k, y]). Rows are
    scored against every column in decreasing order of their bound, `rows_per_step` at a time, and a grid stops
    once the m-th best exact score found beats the bound of every row left. Memory is O(P rows_per_step n), and
    with the factors in the core's SVD basis (`score_factors`) only a few blocks of rows are scored per grid.
    """
    num_grids, _, num_keys = row_factors.shape
    col_max, col_min = col_factors.amax(-1, keepdim=True), col_factors.amin(-1, keepdim=True)  # (P, k, 1)
    bound = torch.maximum(row_factors * col_max, row_factors * col_min).sum(1)  # (P, n)
    bound, order = bound.sort(dim=-1, descending=True)
    best = row_factors.new_full((num_grids, top_m), -torch.inf)  # (P, m) best exact scores so far, descending
    best_index = torch.zeros(num_grids, top_m, dtype=torch.long, device=row_factors.device)
    for start in range(0, num_keys, rows_per_step):
        active = (bound[:, start] > best[:, -1]).nonzero().squeeze(-1)  # grids whose next rows may still enter
        if active.numel() == 0:
            break
        rows = order[active, start : start + rows_per_step]  # (A, c)
        factors = row_factors[active].gather(-1, rows.unsqueeze(1).expand(-1, row_factors.shape[1], -1))  # (A, k, c)
        scores = torch.einsum("akc,akn->acn", factors, col_factors[active])  # (A, c, n)
        cells = (rows.unsqueeze(-1) * num_keys + torch.arange(num_keys, device=rows.device)).flatten(1)  # (A, c*n)
        merged, position = torch.cat([best[active], scores.flatten(1)], -1).topk(top_m, dim=-1)
        best[active] = merged
        best_index[active] = torch.cat([best_index[active], cells], -1).gather(-1, position)
    return best_index


@contextlib.contextmanager
def _fsdp_unsharded(module: FSDPModule) -> Iterator[None]:
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def _retrieval_gathered(layer: UltraMemMemoryLayer) -> contextlib.AbstractContextManager:
    """The retrieval's keys and cores whole, read outside a module call. ZeRO-3: `deepspeed.zero.GatheredParameters`
    over just those (never the value table); FSDP2: the memory layer unsharded, as its own forward does. Both are
    collective: every rank must enter. A no-op for an unsharded model."""
    if isinstance(layer, FSDPModule):
        return _fsdp_unsharded(layer)
    partitioned = [param for param in layer.retrieval.parameters(recurse=False) if hasattr(param, "ds_id")]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned)


@torch.no_grad()
def _layer_statistics(
    layer: UltraMemMemoryLayer,
    queries: torch.Tensor,
    retrieved: tuple[torch.Tensor, torch.Tensor],
    keep: torch.Tensor,
    chunk: int,
    rows_per_step: int,
) -> tuple[dict[str, float], torch.Tensor]:
    """Statistics of one memory layer from its retrieval's inputs and outputs, over the tokens where `keep` (B, T),
    and the table (or pool) rows it read."""
    retrieval = layer.retrieval
    virtual_index, scores = (tensor[keep] for tensor in retrieved)  # (tokens, H, m), (tokens, H, m, h)
    # The queries were captured in the forward's dtype: bfloat16 under mixed precision (Accelerate's autocast),
    # whose keys stay float32 outside it
    queries = queries.to(retrieval.row_keys.dtype)
    with _retrieval_gathered(layer):
        axis_scores = retrieval.axis_scores(queries)  # (B, T, 2, H, r, n)
        row_factors, col_factors = score_factors(retrieval, *axis_scores.unbind(-4))  # (B, T, H, k, n)
    row_factors, col_factors = row_factors[keep], col_factors[keep]  # (tokens, H, k, n)
    hits = torch.zeros((), dtype=torch.long, device=virtual_index.device)
    for start in range(0, virtual_index.shape[0], chunk):  # memory O(chunk H rows_per_step n)
        part = slice(start, start + chunk)
        exact = exact_top_m(
            row_factors[part].flatten(0, 1), col_factors[part].flatten(0, 1), scores.shape[-2], rows_per_step
        )
        hits += (
            (virtual_index[part].flatten(0, 1).unsqueeze(-1) == exact.unsqueeze(-2)).any(-1).sum()
        )  # one sync, at the end

    rows = layer.value_expansion.physical_slots(virtual_index)[0]
    statistics = {
        "tdqkr_recall": hits.item() / max(virtual_index.numel(), 1),
        **row_usage(rows, layer.value_expansion.num_values),  # of its own rows (its window of a pool)
        "query_cosine": mean_cosine(queries[keep][:, :, 0].flatten(1)),  # of the row query
        "top1_score": scores.sum(-1).amax(-1).mean().item(),
    }
    return statistics, rows.unique()


@torch.no_grad()
def ngram_statistics(layer: NGramMemory, call: tuple, keep: torch.Tensor) -> dict[str, float]:
    """How one n-gram memory reads, from the arguments of its call (hidden states, ids, `MemoryInputs`), over
    the tokens where `keep` (B, T): its rows against uniform picks (`row_usage`), `collision_rate` (the share of the
    distinct n-grams of the batch that share a row with another in a head, mean over heads) and its context gate's
    `gate_mean` and `gate_std`."""
    hidden_states, input_ids, inputs = call
    ngrams = layer.ngrams(input_ids, dataclasses.replace(inputs, cache=None))  # (B, T, N); the cache moved on
    rows = layer.rows(ngrams)  # (B, T, heads)
    gate = layer.gate(hidden_states, layer.read(rows).to(hidden_states.dtype))[..., 0][keep]
    picked, kept = rows[keep], ngrams[keep]  # (tokens, heads), (tokens, N)
    heads_per_order = layer.num_heads // (layer.order - 1)
    collided = []
    for head in range(layer.num_heads):
        distinct, inverse = kept[:, : head // heads_per_order + 2].unique(dim=0, return_inverse=True)
        row_of = picked.new_zeros(distinct.shape[0]).scatter_(0, inverse, picked[:, head])  # each n-gram's row
        collided.append((torch.bincount(row_of)[row_of] > 1).double().mean())
    return {
        **row_usage(picked, layer.table_rows),
        "collision_rate": float(torch.stack(collided).mean()),
        "gate_mean": gate.float().mean().item(),
        "gate_std": gate.float().std().item(),
    }


def row_usage(rows: torch.Tensor, num_rows: int) -> dict[str, float]:
    """How widely the picks `rows` (any shape) spread over a table of `num_rows` rows.

    slot_usage: the share of rows read at least once.
    usage_vs_uniform: that count over what as many uniform picks would touch on average, N (1 - (1 - 1/N)^K): 1.0 is
        as spread as chance, and it does not shrink with a short batch as `slot_usage` does.
    usage_kl: KL divergence (nats) of the rows' pick frequencies from the uniform distribution (PKM's health metric);
        0 for perfectly even picks, log N when every pick is one row.
    """
    picks = rows.numel()
    counts = torch.bincount(rows.flatten(), minlength=num_rows).double()
    read = int((counts > 0).sum())
    expected = num_rows * -torch.expm1(torch.tensor(picks * math.log1p(-1.0 / num_rows), dtype=torch.float64))
    share = counts[counts > 0] / max(picks, 1)
    return {
        "slot_usage": read / num_rows,
        "usage_vs_uniform": read / max(float(expected), 1.0),
        "usage_kl": float((share * (share * num_rows).log()).sum()),
    }


def mean_cosine(vectors: torch.Tensor) -> float:
    """Mean cosine similarity over all pairs of distinct rows of `vectors` (n, d), in O(n d): near 0 for unrelated
    directions, 1 when every row points the same way (a collapsed memory layer's inputs)."""
    count = vectors.shape[0]
    if count < 2:
        return float("nan")
    unit = torch.nn.functional.normalize(vectors.double(), dim=-1)
    total = unit.sum(0)
    return float((total.dot(total) - count) / (count * (count - 1)))


@torch.no_grad()
def retrieval_diagnostics(
    model: UltraMemForCausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    chunk: int = 64,
    rows_per_step: int = 64,
) -> dict[str, float]:
    """Retrieval health of every memory layer on one batch, what the paper and PKM track during training.

    Per memory layer j, as `layer_{j}/<name>`:
    tdqkr_recall: fraction of the exact top-m (over all n^2 grid cells) that the two-phase approximate
        top-m retrieves; 1.0 for product keys, where the two-phase search is exact.
    slot_usage, usage_vs_uniform, usage_kl: how the batch's picks spread over the layer's N physical value rows (its
        window, with a shared pool); see `row_usage`.
    input_cosine: mean cosine across tokens of the layer's normed input; query_cosine: the same of its row query
        (after the query's normalisations). Near 1 means every token asks the same question: a collapsed layer.
    top1_score: mean over tokens and heads of the highest selected score (summed over MCS cores).
    memory_output_std: standard deviation of the layer's output.
    Summaries over layers: each name alone is the mean, `min_<name>` the worst layer for `slot_usage` and
    `usage_vs_uniform`, `max_<name>` for `usage_kl` and `input_cosine` (a mean hides one collapsed layer).
    pool_slot_usage: with a value pool shared by the memory layers (`value_pool_size`), the fraction of its rows
        that any layer touches (absent without a pool). Pre-value tables share their values' rows.

    Queries, selections and outputs are recorded during one forward pass (so nothing is recomputed outside a
    module call, which also keeps ZeRO-3's gathering in its hooks). The exact top-m search (`exact_top_m`) runs
    `chunk` tokens and `rows_per_step` rows at a time: its memory is O(chunk H rows_per_step n), not O(n^2).
    """
    if hasattr(model, "get_base_model"):  # a PEFT-wrapped model: the UltraMem model inside, its adapters in place
        model = model.get_base_model()
    memory_layers = list(model.model.memory_layers)
    ngram_memories = list(getattr(model.model, "ngram_memories", ()))  # none in a checkpoint of an older version
    if not (memory_layers or ngram_memories):
        return {}
    captured: dict[int, dict[str, tuple[torch.Tensor, ...]]] = {idx: {} for idx in range(len(memory_layers))}
    ngram_calls: dict[int, tuple] = {}

    def capture(idx: int, name: str):
        def hook(module, args, output):
            captured[idx][name] = (args, output)

        return hook

    handles = []
    for idx, layer in enumerate(memory_layers):
        handles.append(layer.retrieval.register_forward_hook(capture(idx, "retrieval")))
        # the output leaves through the layer's dropout, also where an offloaded store's background read skips the
        # layer's own call (`start`)
        handles.append(layer.dropout.register_forward_hook(capture(idx, "output")))
        handles.append(layer.norm.register_forward_hook(capture(idx, "input")))  # the normed input, inside the call
    for idx, ngram in enumerate(ngram_memories):
        handles.append(ngram.register_forward_pre_hook(lambda module, args, idx=idx: ngram_calls.update({idx: args})))
    was_training = model.training
    model.eval()
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()

    keep = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    summary = _ngram_summary([ngram_statistics(ngram, ngram_calls[i], keep) for i, ngram in enumerate(ngram_memories)])
    if not memory_layers:
        return summary
    per_layer: list[dict[str, float]] = []
    rows_read = []
    for idx, layer in enumerate(memory_layers):
        (queries, _), retrieved = captured[idx]["retrieval"]
        stats, rows = _layer_statistics(layer, queries, retrieved, keep, chunk, rows_per_step)
        layer_output = captured[idx]["output"][1]
        stats["input_cosine"] = mean_cosine(captured[idx]["input"][1][keep].float())
        stats["memory_output_std"] = layer_output[keep].float().std().item()
        per_layer.append(stats)
        rows_read.append(rows.cpu())  # layers may sit on different devices
    summary.update({name: sum(stats[name] for stats in per_layer) / len(per_layer) for name in per_layer[0]})
    for name, worst in WORST_LAYER.items():
        summary[f"{worst.__name__}_{name}"] = worst(stats[name] for stats in per_layer)
    for idx, stats in enumerate(per_layer):
        summary.update({f"layer_{idx}/{name}": value for name, value in stats.items()})
    pool_size = getattr(model.config, "value_pool_size", None)
    if pool_size:
        summary["pool_slot_usage"] = torch.cat(rows_read).unique().numel() / pool_size
    return summary


def _ngram_summary(per_layer: list[dict[str, float]]) -> dict[str, float]:
    """`ngram_{j}/<name>` of each n-gram memory, and its worst layer's usage and collision rate."""
    summary = {f"ngram_{idx}/{name}": value for idx, stats in enumerate(per_layer) for name, value in stats.items()}
    if per_layer:
        summary["min_ngram_usage_vs_uniform"] = min(stats["usage_vs_uniform"] for stats in per_layer)
        summary["max_ngram_collision_rate"] = max(stats["collision_rate"] for stats in per_layer)
    return summary


# The summaries that name the worst layer: a mean over layers hides one collapsed layer
WORST_LAYER = {"slot_usage": min, "usage_vs_uniform": min, "usage_kl": max, "input_cosine": max}
