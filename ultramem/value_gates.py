"""The value gates of UltraMemV2 and Memory+ (`config.value_gate`): what multiplies a memory layer's scores or pooled
values besides the retrieval. PEER's pre-value gate (`PreValueGate`, "peer" / "peer_gelu") scales each selected
slot's score; Memory+'s silu gate (`SiluGate`, "swilu") scales the pooled values before the projector. Their effect
on the output's scale at init is counted in `init_scales.MemoryInitScales`.

This file is copied beside `modeling_ultramem.py` into checkpoints (remote code), so it imports only relatively.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_ultramem import PEER_GELU, UltraMemConfig
from .init_scales import MemoryInitScales, ValueProjector
from .memory_implementations import MemoryOps


class SiluGate(nn.Module):
    """Memory+'s gate (Berges et al. 2024, Eq. 2): the pooled values times silu(W_1 x) before the projector."""

    def __init__(self, hidden_size: int, width: int, init_std: float):
        super().__init__()
        self.proj = ValueProjector(hidden_size, width, init_std)

    def forward(self, pooled: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return pooled * F.silu(self.proj(x))


class PreValueGate(nn.Module):
    """PEER-style value processing (UltraMemV2 Eq. 15): slot k's score times g_k = <W_p x, P[row_k]>.

    P is the pre-value table (one Dp-wide row per value row), held by a value store like the values, which
    computes the dots (`lookup_dot`) where its rows live. "peer_gelu" applies GELU to g (PEER, Eq. 13).
    """

    def __init__(self, config: UltraMemConfig, scales: MemoryInitScales):
        super().__init__()
        self.proj = ValueProjector(config.hidden_size, config.pre_value_dim, scales.gate_input_std)
        self.activation = F.gelu if config.value_gate == PEER_GELU else None

    def forward(
        self, scores: torch.Tensor, rows: torch.Tensor, x: torch.Tensor, pre_values: nn.Module, ops: MemoryOps
    ) -> torch.Tensor:
        """scores (T, K, h), rows (T, K), x (T, D) -> gated scores (T, K, h)."""
        gate = pre_values.lookup_dot(rows, self.proj(x), ops)  # (T, K)
        if self.activation is not None:
            gate = self.activation(gate)
        return scores * gate.unsqueeze(-1).to(scores.dtype)
