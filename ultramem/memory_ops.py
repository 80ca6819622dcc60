"""The memory layer's math as plain functions on tensors: retrieval (PKM's and TDQKR's top-m), implicit value
expansion, the lookup-reduce, the Tucker cores' SVD and aux loss.

The modules of `modeling_ultramem` hold the parameters and call these; another runtime (an inference engine's model
class) can call the same functions without the Transformers model classes. `lookup_reduce` and
`tucker_candidate_topk` are also the numerical reference for the Triton kernels and for the embedding_bag path
(`embedding_bag_ops`), the fast path on CPU.

This module is flat on purpose: `save_pretrained` copies it next to `modeling_ultramem.py`, so a
checkpoint loaded with `trust_remote_code=True` runs this path without the `ultramem` package.
Every function is vectorized (no Python loop over tokens, heads or candidates).

Shapes use T for flattened tokens, H memory heads, K = H * m selected slots per token,
r Tucker rank, h MCS cores, E IVE groups, N physical rows and Dv the value dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def lookup_reduce(
    values: torch.Tensor,
    rows: torch.Tensor,
    groups: torch.Tensor,
    scores: torch.Tensor,
    num_groups: int,
) -> torch.Tensor:
    """Gather the selected physical rows and pool them into their IVE groups.

    out[t, e, c * Dv/h + j] = sum_k [groups[t, k] == e] * scores[t, k, c] * values[rows[t, k], c * Dv/h + j]

    Args:
        values: (N, Dv) physical value table.
        rows: (T, K) int64 physical row of every selected slot.
        groups: (T, K) int64 IVE projector group in [0, num_groups) of every selected slot.
        scores: (T, K, h) score of every MCS core for every selected slot; chunk c of a row is weighted
            by core c.
        num_groups: E, the number of IVE groups.

    Returns:
        (T, E, Dv) pooled values in the dtype of `values`, accumulated in float32.
    """
    return lookup_reduce_on(values, num_groups)(rows, groups, chunk_weights(scores))


def chunk_weights(scores: torch.Tensor) -> torch.Tensor:
    """The scores (..., h) as the weights of the rows' h chunks (`lookup_reduce_on`): (..., h, 1), or as they are
    with one core (..., 1)."""
    return scores if scores.shape[-1] == 1 else scores.unsqueeze(-1)


def lookup_reduce_on(values: torch.Tensor, num_groups: int) -> Callable[..., torch.Tensor]:
    """`lookup_reduce` on a table whose rows stay as they are (the decode steps of one `generate` call): what depends
    on the table alone taken once. The returned call takes rows and groups (T, K) and the scores as
    the chunks' weights (`chunk_weights`: (T, K, h, 1), or (T, K, 1) with one core), the shape a caller can give
    them in the view it takes anyway."""
    value_dim = values.shape[-1]
    # group e's one-hot is row e of the identity: F.one_hot checks its range with a host synchronisation, every step
    one_hot = torch.eye(num_groups, dtype=torch.float32, device=values.device) if num_groups > 1 else None

    def lookup(rows: torch.Tensor, groups: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gathered = F.embedding(rows, values).float()  # (T, K, Dv)
        if weights.dim() == gathered.dim():  # one core: (T, K, 1)
            weighted = gathered * weights.float()
        else:  # chunk c of each row by core c: (T, K, h, Dv/h) * (T, K, h, 1)
            weighted = (gathered.view(*weights.shape[:-1], -1) * weights.float()).view(*rows.shape, value_dim)
        if one_hot is None:
            pooled = weighted.sum(dim=1, keepdim=True)  # (T, 1, Dv)
        else:
            pooled = torch.bmm(F.embedding(groups, one_hot).transpose(1, 2), weighted)  # (T, E, K) @ (T, K, Dv)
        return pooled.to(values.dtype)

    return lookup


def tucker_candidate_topk(
    row_scores: torch.Tensor,
    col_scores: torch.Tensor,
    cores: torch.Tensor,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact Tucker scores on the m x m candidate grid, then the final top-m (TDQKR steps 6-7).

    The per-core score of candidate (x, y) is S_row[:, x]^T C^(i) S_col[:, y]; the top-m is taken on
    the sum over cores (the full Tucker score), and the per-core scores of the winners are returned
    for multi-core scoring.

    Args:
        row_scores: (..., r, m) scores of the m candidate rows for each of the r query parts.
        col_scores: (..., r, m) same for the m candidate columns.
        cores: (..., h, r, r) the h MCS component cores, broadcastable against the leading dims.
        topk: number of winners to keep (m).

    Returns:
        flat_index: (..., topk) int64 index x * m + y into the candidate grid, best first.
        core_scores: (..., topk, h) per-core scores of the winners.
    """
    return core_last_candidate_topk(row_scores, col_scores, core_last(cores), topk)


def core_last(cores: torch.Tensor) -> torch.Tensor:
    """The MCS cores (..., h, r, r) laid out for `core_last_candidate_topk`: (..., r, r, 1, 1, h), the core index
    last, so that the winners' per-core scores are gathered as they lie, (..., topk, h)."""
    *lead, num_cores, rank, _ = cores.shape
    return cores.movedim(-3, -1).reshape(*lead, rank, rank, 1, 1, num_cores)


def core_last_candidate_topk(
    row_scores: torch.Tensor, col_scores: torch.Tensor, cores_last: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`tucker_candidate_topk` on the cores laid out by `core_last`."""
    # S_row^T C^(i) S_col as two broadcast products, each summed over one rank index: r is 2 in the paper, too narrow
    # for a matmul to pay (broadcast matmuls copied their operands: twice the operators at decode, T = 1)
    *lead, rank, num_candidates = col_scores.shape
    num_cores = cores_last.shape[-1]
    col_parts = col_scores.reshape(*lead, 1, rank, 1, num_candidates, 1)  # (..., 1, r, 1, m, 1)
    core_times_col = (cores_last * col_parts).sum(-4)  # (..., r, 1, m, h): C^(i) S_col
    row_parts = row_scores.reshape(*lead, rank, num_candidates, 1, 1)  # (..., r, m, 1, 1)
    per_core = (row_parts * core_times_col).sum(-4).flatten(-3, -2)  # (..., m*m, h)
    _, flat_index = per_core.sum(dim=-1).topk(topk, dim=-1)  # (..., topk)
    core_scores = per_core.gather(-2, flat_index.unsqueeze(-1).expand(*flat_index.shape, num_cores))  # (..., topk, h)
    return flat_index, core_scores


def product_key_topk(
    row_scores: torch.Tensor, col_scores: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PKM's two-phase top-m over the n x n grid of additive scores s_row[x] + s_col[y].

    Args:
        row_scores, col_scores: (..., n) scores of every row and column key.
        topk: m.

    Returns:
        virtual addresses x * n + y (..., m) and their scores (..., m, 1).
    """
    num_keys = row_scores.shape[-1]
    row_top, row_index = row_scores.topk(topk, dim=-1)  # (..., m)
    col_top, col_index = col_scores.topk(topk, dim=-1)
    grid = (row_top.unsqueeze(-1) + col_top.unsqueeze(-2)).flatten(-2)  # (..., m*m)
    scores, flat_index = grid.topk(topk, dim=-1)
    rows = row_index.gather(-1, flat_index // topk)
    cols = col_index.gather(-1, flat_index % topk)
    return rows * num_keys + cols, scores.unsqueeze(-1)


AMINMAX_CPU_ROWS_MAX = 8
"""Most rows whose extremes `axis_extremes` takes with one `aminmax` on CPU, whose kernel there is not vectorised along
the last dim (rows of 512: 37 us at 32 rows against 5.7 for `amin` + `amax`, 2.3 ms at 2,048 against 0.11): a decode
step at batch 1 or 2 keeps the one operator, which like every operator of the step runs cold there (an `add` 17.7 us
after the LM head against 2.3 in a loop); a prefill or a training batch takes the two."""


def axis_extremes(projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The minimum and maximum of `projected` (..., n) along its last dim, kept: (..., 1) each."""
    if projected.device.type == "cpu" and projected.numel() > AMINMAX_CPU_ROWS_MAX * projected.shape[-1]:
        return projected.amin(-1, keepdim=True), projected.amax(-1, keepdim=True)
    return projected.aminmax(dim=-1, keepdim=True)


def rank_one_candidates(projected: torch.Tensor, topk: int, signed: bool) -> torch.Tensor:
    """Candidate rows and columns (..., 2, H, 1, m') from the rank-1 projections (..., 2, H, 1, n): a = u^T S_row and
    b = t^T S_col, the axis first (the rank's dim kept: the candidates then gather the axis scores as they lie).

    sigma a_x b_y is large where a_x and b_y are both large, or both very negative. The SVD's sign is arbitrary
    ((u, t) and (-u, -t) are the same rank-1 core), so picking the positive quadrant after a sign normalisation makes
    retrieval jump when the normalisation flips. Both quadrants are considered instead, which is sign-invariant: by
    default each token takes the quadrant, (top-m a, top-m b) or (bottom-m a, bottom-m b), whose best rank-1 score is
    higher (m' = m, the paper's m^2 candidates); `signed` keeps the m largest and m smallest of each axis (m' = 2m,
    4 m^2 candidates, exact for rank-1 cores). Measured in docs/design.md (`benchmarks/bench_retrieval.py`).
    """
    if signed:
        return torch.cat(
            [projected.topk(topk, dim=-1).indices, projected.topk(topk, dim=-1, largest=False).indices], -1
        )
    # The quadrant is chosen from the axes' extremes, then one top-m runs on both axes, sign-flipped where the bottom
    # quadrant wins (the bottom-m of a is the top-m of -a): one topk call for the four candidate sets.
    low, high = axis_extremes(projected)  # (..., 2, H, 1, 1)
    bottom = high.prod(-4, keepdim=True) < low.prod(-4, keepdim=True)  # (..., 1, H, 1, 1): max a max b < min a min b
    return torch.where(bottom, -projected, projected).topk(topk, dim=-1).indices


def tucker_topk(
    axis_scores: torch.Tensor,
    cores: torch.Tensor,
    leading_vectors: torch.Tensor,
    topk: int,
    signed: bool = False,
    candidate_topk=tucker_candidate_topk,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TDQKR's approximate top-m: candidates by the rank-1 SVD of the summed core, then exact scores on them.

    Args:
        axis_scores: (..., 2, H, r, n) S_row and S_col of every key, the axis first (one GEMM's output, viewed).
        cores: (H, h, r, r) the MCS cores, as `candidate_topk` takes them.
        leading_vectors: (2, H, r, 1) u and t, the leading singular vectors of each head's summed core.
        topk: m.
        signed: see `rank_one_candidates`.
        candidate_topk: the implementation of `tucker_candidate_topk` (reference or kernel).

    Returns:
        virtual addresses x * n + y (..., H, m) and per-core scores (..., H, m, h).
    """
    num_keys, rank = axis_scores.shape[-1], axis_scores.shape[-2]
    # a = u^T S_row, b = t^T S_col, summed over the rank by broadcasting (an einsum here goes through a bmm on a
    # permuted copy: 10x slower on CPU); the choice of candidates has no gradient
    with torch.no_grad():
        index = rank_one_candidates((axis_scores * leading_vectors).sum(-2, keepdim=True), topk, signed)
    candidates = axis_scores.gather(-1, index.expand(*index.shape[:-2], rank, -1))  # (..., 2, H, r, m')
    flat_index, core_scores = candidate_topk(*candidates.unbind(-4), cores, topk)  # (..., H, m), (..., H, m, h)
    return winner_addresses(index, flat_index, num_keys), core_scores


ADDRESS_GRID_MAX = 1 << 16
"""Most candidate pairs (tokens x heads x m'^2) whose addresses `winner_addresses` lays out as a grid (512 KB of int64):
a decode step's few tokens, where the grid saves operators; a training batch's addresses take O(m) a token instead."""


def winner_addresses(index: torch.Tensor, flat_index: torch.Tensor, num_keys: int) -> torch.Tensor:
    """The virtual addresses x * n + y (..., H, m) of the winners `flat_index` (..., H, m) of the candidate grid of the
    rows and columns `index` (..., 2, H, 1, m'). For few tokens read from every candidate pair's address (one broadcast
    add); for many from the winners' row and column (a divide, a remainder and a gather), the same integers."""
    num_candidates = index.shape[-1]
    rows, cols = index.unbind(-4)  # (..., H, 1, m') each
    if flat_index.numel() // flat_index.shape[-1] * num_candidates**2 <= ADDRESS_GRID_MAX:
        addresses = torch.add(cols, rows.transpose(-1, -2), alpha=num_keys).flatten(-2)  # (..., H, m' * m')
        return addresses.gather(-1, flat_index)
    row = rows.squeeze(-2).gather(-1, torch.div(flat_index, num_candidates, rounding_mode="floor"))  # (..., H, m)
    return row.mul(num_keys).add_(cols.squeeze(-2).gather(-1, flat_index % num_candidates))


def tucker_topk_on(
    cores: torch.Tensor, leading_vectors: torch.Tensor, topk: int, signed: bool = False
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """`tucker_topk` as a function of the axis scores on cores that stay as they are (the decode steps of one
    `generate` call): their layout for the candidates' scores (`core_last`) taken once."""
    arranged = core_last(cores)
    return lambda axis_scores: tucker_topk(
        axis_scores, arranged, leading_vectors, topk, signed, core_last_candidate_topk
    )


def physical_slots(
    virtual_index: torch.Tensor, virtual_to_physical: torch.Tensor | None, num_values: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Implicit value expansion: virtual addresses (...) -> physical rows in [0, N) and IVE groups, same shape.

    The addresses go through the fixed shuffle first (when E > 1), so each group reads a random subset of rows.
    """
    if virtual_to_physical is not None:
        virtual_index = torch.take(virtual_to_physical, virtual_index)  # an index's machinery costs more per call
    return virtual_index % num_values, torch.div(virtual_index, num_values, rounding_mode="floor")


def _polar(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Radius and angle of (x, y) with finite gradients at the origin (radius 0, angle 0, zero gradient there).

    `hypot` and `atan2` have 0/0 gradients at (0, 0): a pure rotation or reflection, or a zero core, would give
    NaN gradients through the aux loss. The origin is replaced by (1, 0) in both branches of the `where`.
    """
    origin = (x == 0) & (y == 0)
    x_safe, y_safe = torch.where(origin, 1.0, x), torch.where(origin, 0.0, y)
    radius = torch.where(origin, 0.0, torch.hypot(x_safe, y_safe))
    return radius, torch.atan2(y_safe, x_safe)


def svd_2x2(matrices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Closed-form SVD of 2x2 matrices (..., 2, 2): singular values (..., 2) descending, leading u and t (..., 2).

    matrices = R(phi) diag(q + r, q - r) R(-theta), with q and r the norms of the rotation and reflection
    parts. The signs of u and t are arbitrary (callers normalize them). Gradients are finite everywhere
    (see `_polar`); where the SVD is differentiable they are those of `torch.linalg.svd`.
    """
    a, b, c, d = matrices[..., 0, 0], matrices[..., 0, 1], matrices[..., 1, 0], matrices[..., 1, 1]
    q, rotation = _polar((a + d) / 2, (c - b) / 2)
    r, reflection = _polar((a - d) / 2, (c + b) / 2)
    phi, theta = (rotation + reflection) / 2, (rotation - reflection) / 2
    u = torch.stack([phi.cos(), phi.sin()], dim=-1)
    t = torch.stack([theta.cos(), -theta.sin()], dim=-1)
    return torch.stack([q + r, (q - r).abs()], dim=-1), u, t


def core_svd(cores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Singular values (..., r) descending, and the leading left/right singular vectors u, t (..., r) of cores.

    On an accelerator with the paper's rank r = 2 this is `svd_2x2`: a few elementwise ops instead of
    `torch.linalg.svd`, which synchronizes a CUDA device with the host at every call (twice per memory layer
    per forward: retrieval and aux loss) and so stalls decoding and breaks CUDA graphs. On CPU, where there is
    no device to wait for, LAPACK's 2x2 SVD costs less than the dozen small ops of the closed form.
    """
    if cores.shape[-1] == 2 and cores.device.type != "cpu":
        return svd_2x2(cores)
    left, singular_values, right_h = torch.linalg.svd(cores)
    return singular_values, left[..., :, 0], right_h[..., 0, :]


def tucker_aux_loss(cores: torch.Tensor, alpha: float, tau: float) -> torch.Tensor:
    """alpha/(r-1) * sum_{i>=2} max(0, lambda_i - tau)^2 of each head's summed core, summed over heads.

    cores: (..., h, r, r), the MCS cores of one memory layer or of several stacked (one SVD call for all).
    """
    rank = cores.shape[-1]
    if rank == 1:
        return cores.new_zeros(())
    singular_values, _, _ = core_svd(cores.sum(-3).float())  # (..., r), descending
    excess = F.relu(singular_values[..., 1:] - tau)
    return alpha / (rank - 1) * excess.pow(2).sum()


def key_balance_loss(axis_scores: torch.Tensor, topk: int) -> torch.Tensor:
    """UltraMemV2's key-balance loss of one key axis (Eq. 18-20): n * sum_x f_x p_x, averaged over heads.

    Args:
        axis_scores: (..., H, n) the scores each token's top-m of this axis is taken on.
        topk: m.

    p_x is the mean over tokens of softmax(scores)_x (the differentiable share of key x), f_x the fraction of tokens
    whose top-m holds key x (no gradient; sums to m as in the paper). Uniform use gives its minimum, m.
    """
    num_heads, num_keys = axis_scores.shape[-2:]
    scores = axis_scores.float().reshape(-1, num_heads, num_keys)  # (T, H, n)
    share = scores.softmax(-1).mean(0)  # (H, n)
    chosen = scores.detach().topk(topk, dim=-1).indices.transpose(0, 1).flatten(1)  # (H, T*m)
    counts = torch.zeros_like(share).scatter_add_(1, chosen, torch.ones_like(chosen, dtype=share.dtype))
    return num_keys * (counts / scores.shape[0] * share).sum(-1).mean()


class _WithLossGradient(torch.autograd.Function):
    """The identity on x whose backward also back-propagates `loss` with gradient 1."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_dtype = loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=grad.device)


def with_loss_gradient(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """x, unchanged, with `loss` added to whatever loss is back-propagated through it (a regulariser that needs no
    output of its own; UltraMemV2's key-balance loss is added this way, as in its official code)."""
    return _WithLossGradient.apply(x, loss)


def lookup_dot(table: torch.Tensor, rows: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The inner product of each selected row with its token's query: PEER's (and UltraMemV2's Eq. 15) gate.

    out[t, k] = sum_d table[rows[t, k], d] * query[t, d]

    Args:
        table: (N, Dp) physical table (UltraMemV2's pre-value table).
        rows: (T, K) int64 physical row of every selected slot.
        query: (T, Dp) one query per token.

    Returns:
        (T, K) in the dtype of `table`, accumulated in float32 (as `lookup_reduce`).
    """
    gathered = F.embedding(rows, table).float()  # (T, K, Dp)
    # a bmm: an einsum spends a dozen permutes and views around the same product (a decode step pays each)
    return torch.bmm(gathered, query.float().unsqueeze(-1)).squeeze(-1).to(table.dtype)
