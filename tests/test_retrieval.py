"""Retrieval, init and bookkeeping of the memory layers: continuity, init scales, SVD gradients, counts."""

import pytest
import torch
from conftest import small_config

from ultramem import UltraMemForCausalLM


def _memory_output_std(config, seeds: int = 32) -> float:
    """Std of the first memory layer's output at init for unit-variance inputs, averaged over seeds.

    Each head's summed core is rescaled to ||C||_F = 1, its expected norm at init, so that the chi-square
    spread of a 2x2 core's norm does not swamp the comparison (the split between the h cores stays random).
    """
    stds = []
    for seed in range(seeds):
        torch.manual_seed(seed)
        layer = UltraMemForCausalLM(config).model.memory_layers[0]
        cores = layer.retrieval.cores  # (H, h, r, r)
        with torch.no_grad():
            cores /= cores.sum(1, keepdim=True).norm(dim=(-2, -1), keepdim=True)
        hidden = torch.randn(2, 32, config.hidden_size, generator=torch.Generator().manual_seed(100 + seed))
        with torch.no_grad():
            stds.append(layer(hidden).std().item())
    return sum(stds) / len(stds)


@pytest.mark.parametrize("improved_init", [True, False])
def test_memory_output_scale_at_init_does_not_depend_on_mcs_cores(improved_init):
    """Each value chunk is weighted by one core's score (about S/h): the init compensates (`MemoryInitScales`)."""
    kwargs = dict(improved_init=improved_init, memory_num_keys=32, memory_value_dim=16, memory_layers=[[0, 1]])
    one, two = (_memory_output_std(small_config(mcs_cores=h, **kwargs)) for h in (1, 2))
    assert two / one == pytest.approx(1.0, abs=0.1), two / one
