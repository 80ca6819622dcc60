"""How a memory layer's parameters start: the init-scale rules (`MemoryInitScales`: the paper's appendix A, PKM's
init, UltraMemV2's gated variants) and the two modules that start at a scale they give (`ScaledLayerNorm`'s gain,
`ValueProjector`'s std). The other modules of `modeling_ultramem` init themselves from these scales.

This file is copied beside `modeling_ultramem.py` into checkpoints (remote code), so it imports only relatively.
"""

import functools
import math
from dataclasses import dataclass
from statistics import NormalDist

import torch
from torch import nn
from transformers import initialization as init

from .configuration_ultramem import NO_GATE, PEER, PEER_GELU, SWILU, TUCKER, UltraMemConfig
from .memory_ops import rank_one_candidates, tucker_candidate_topk

# E[act(z)^2] for z ~ N(0, 1): how a value gate scales the pooled values' variance at init (see MemoryInitScales)
GATE_SECOND_MOMENTS = {NO_GATE: 1.0, PEER: 1.0, PEER_GELU: 0.42522, SWILU: 0.35578}


def expected_top_m_mean(num_candidates: int, top_m: int) -> float:
    """E[mean of the top-m of `num_candidates` standard normals] (appendix A), in closed form.

    The paper estimates it by sampling; the mean of a standard normal above its (1 - m/N) quantile,
    phi(z) / (m/N), is the same quantity for m << N, deterministic, and allocation-free.
    """
    tail = min(top_m / num_candidates, 0.5)
    normal = NormalDist()
    return normal.pdf(normal.inv_cdf(1.0 - tail)) / tail


@functools.cache
def mcs_output_gain(num_keys: int, top_m: int, rank: int, num_cores: int, samples: int = 512) -> float:
    """sqrt(E[S^2] / E[mean_i s_i^2]) over the top-m slots at init: the value scale that makes h cores match one.

    See `sampled_core_scores` and `init_scales.MemoryInitScales`.
    """
    if num_cores == 1:
        return 1.0
    selected = sampled_core_scores(num_keys, top_m, rank, num_cores, samples, signed=True)
    return (selected.sum(-1).pow(2).mean() / selected.pow(2).mean()).sqrt().item()


@functools.cache
def core_score_second_moment(
    num_keys: int, top_m: int, rank: int, num_cores: int, signed: bool, samples: int = 2048
) -> float:
    """E[s_i^2] of the per-core scores of the top-m slots at init, for unit-variance row and column scores: the
    (1 + sigma_s^2) of UltraMemV2's appendix A (Eq. 22), sampled as the paper does, with the model's candidates."""
    return sampled_core_scores(num_keys, top_m, rank, num_cores, samples, signed).pow(2).mean().item()


def sampled_core_scores(
    num_keys: int, top_m: int, rank: int, num_cores: int, samples: int, signed: bool
) -> torch.Tensor:
    """Per-core scores (S, m, h) of the top-m slots of `samples` draws at init (seeded, float64): standard normal
    row/column scores (r, n) and random cores, the top-m taken by the two-phase search over the rank-1 candidates
    (`rank_one_candidates`)."""
    generator = torch.Generator().manual_seed(0)
    # torch.normal, not torch.randn (the same numbers): DeepSpeed's `zero.Init` casts what torch.randn makes to the
    # training dtype, and torch.linalg.svd has no bfloat16 kernel (ZeRO-3 with --bf16 failed building the model)
    float64 = dict(generator=generator, dtype=torch.float64, device="cpu")
    rows, cols = torch.normal(0.0, 1.0, (2, samples, rank, num_keys), **float64)
    cores = torch.normal(0.0, 1.0, (samples, num_cores, rank, rank), **float64)
    cores = cores / (num_cores * rank * rank) ** 0.5  # E||sum_i C^(i)||_F^2 = 1, as `TuckerQueryKeyRetrieval`
    left, _, right_h = torch.linalg.svd(cores.sum(1))
    projected = torch.stack(
        (torch.einsum("srn,sr->sn", rows, left[..., :, 0]), torch.einsum("srn,sr->sn", cols, right_h[..., 0, :])), 1
    )  # (S, 2, n): a and b
    indices = rank_one_candidates(projected[:, :, None, None], top_m, signed)[:, :, 0, 0].unbind(1)  # (S, m') each
    row_candidates, col_candidates = (
        scores.gather(-1, index.unsqueeze(1).expand(-1, rank, -1)) for scores, index in zip((rows, cols), indices)
    )  # (S, r, m')
    return tucker_candidate_topk(row_candidates, col_candidates, cores, top_m)[1]  # (S, m, h)


@dataclass(frozen=True)
class MemoryInitScales:
    """Initial scales of a memory layer: appendix A when `improved_init`, PKM's init otherwise.

    Improved: values ~ N(0, E / (2 m H L)), so the layer's output starts like an MLP's, N(0, 1/(2L));
    query/key LayerNorm gains make the mean selected score about 1 (see `expected_top_m_mean`); the
    projectors keep the pooled variance. PKM: values ~ N(0, 1/Dv), unit gains. With V2's single projector
    (`ive_single_projector`) the E groups pool into one, so E counts as 1 in both rules.

    Value gates keep that target. PEER (V2 Eq. 15): each score is multiplied by g = <W_p x, P[row]>; with x
    LayerNorm'd, W_p ~ N(0, 1/D) and pre-values P ~ N(0, 1/Dp), g ~ N(0, 1) at init, so E[act(g)^2] = 1 without
    an activation and E[GELU(g)^2] = 0.425 with one. Memory+'s silu gate multiplies the pooled value by
    silu(W_1 x), E[silu(z)^2] = 0.356. The values are divided by sqrt of that second moment, so the output's
    variance at init is the same with and without a gate (checked by sampling in the tests). The paper's own
    rule (App. A, Eq. 22 = Eq. 25) matches the memory's output variance to a SwiGLU FFN's with sigma_P = sigma_V,
    which gives sigma_V^4 = 0.2 kinner D / (k H (1 + sigma_s^2) Dp Dv L) (the paper prints sigma_V^2); this
    project keeps its own target (the GeLU MLP's 1/(2L)) and unit-variance gates instead (docs/design.md).

    Multi-core scoring (both inits): chunk i of a selected value is weighted by core i's score
    s_i = a^T C^(i) b (a, b the slot's row and column scores), not by the summed score S = sum_i s_i that
    selected it. With C^(i) = C / h + D_i, where D_i is independent of the sum C for Gaussian cores,
    s_i = S / h + a^T D_i b and, per output dimension,
        E[mean_i s_i^2] = E[S^2] / h^2 + (1 - 1/h) / h * E[||a||^2 ||b||^2] / r^2        (E||C||_F^2 = 1)
    The first term alone makes the output of h cores 1/h that of one core; the second depends on how the
    top-m selects large ||a|| ||b||, which has no closed form for product scores. `mcs_output_gain`
    estimates sqrt(E[S^2] / E[mean_i s_i^2]) once by sampling (as the paper does for the top-m mean) and
    the values are scaled by it, so the output's scale at init does not depend on h.
    """

    value_std: float
    projector_std: float
    query_gain: float
    key_gain: float
    pre_value_std: float = 0.0
    gate_input_std: float = 0.0

    @classmethod
    def from_config(cls, config: UltraMemConfig) -> "MemoryInitScales":
        core_scale = mcs_output_gain(config.memory_num_keys, config.memory_topk, config.tucker_rank, config.mcs_cores)
        gate_moment = GATE_SECOND_MOMENTS[config.value_gate]
        core_scale /= math.sqrt(gate_moment)
        gates = {
            "pre_value_std": config.pre_value_dim**-0.5 if config.pre_value_dim else 0.0,
            "gate_input_std": config.hidden_size**-0.5,
        }
        if not config.improved_init:
            return cls(core_scale * config.memory_value_dim**-0.5, config.initializer_range, 1.0, 1.0, **gates)
        num_groups = config.num_pooled_groups
        activated = config.memory_topk * config.memory_heads
        top_mean = expected_top_m_mean(config.memory_num_keys**2, config.memory_topk)
        if config.retrieval_mode == TUCKER:
            query_gain = top_mean**-0.5  # Var(S_row^T C S_col) = g^4 ||C||_F^2 = 1 / top_mean^2
        else:
            query_gain = 1.0 / (math.sqrt(2.0) * top_mean)  # Var(s_row + s_col) = 2 g^2
        target = 1.0 / (2 * config.num_hidden_layers)  # the output variance, per dimension
        if config.value_gate in (PEER, PEER_GELU) and config.retrieval_mode == TUCKER:
            # UltraMemV2's rule: the selected scores' spread counted, sampled, not taken as 1 (see the docstring)
            second_moment = query_gain**4 * core_score_second_moment(
                config.memory_num_keys,
                config.memory_topk,
                config.tucker_rank,
                config.mcs_cores,
                config.tdqkr_signed_candidates,
            )
            value_std = math.sqrt(num_groups * target / (activated * second_moment * gate_moment))
        else:
            value_std = core_scale * math.sqrt(num_groups * target / activated)
        return cls(
            value_std=value_std,
            projector_std=(num_groups * config.memory_value_dim) ** -0.5,
            query_gain=query_gain,
            key_gain=(config.memory_key_dim // config.tucker_rank) ** -0.5,
            **gates,
        )


class ScaledLayerNorm(nn.LayerNorm):
    """LayerNorm whose gain starts at `init_gain` instead of 1 (query/key norms of the memory layers)."""

    def __init__(self, normalized_shape: int, eps: float, init_gain: float):
        super().__init__(normalized_shape, eps=eps)
        self.init_gain = init_gain

    def init_ultramem(self) -> None:
        init.constant_(self.weight, self.init_gain)
        init.zeros_(self.bias)


class ValueProjector(nn.Linear):
    """The E IVE projectors W_p (Dv -> D) stacked as one (E * Dv -> D) matrix, so they run as one GEMM."""

    def __init__(self, in_features: int, out_features: int, init_std: float):
        super().__init__(in_features, out_features, bias=False)
        self.init_std = init_std

    def init_ultramem(self) -> None:
        init.normal_(self.weight, std=self.init_std)
