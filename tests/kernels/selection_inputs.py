"""Inputs of TDQKR's selection (`memory_ops.tucker_topk`) for the tests of its fused kernels (Triton's and the C++
one): random ones, and ones whose rank-1 projections have no ties in a 16-bit dtype."""

from __future__ import annotations

import itertools

import torch

from ultramem import memory_ops


def random_inputs(batch, heads, rank, num_keys, num_cores, dtype=torch.float32, seed=0):
    """Axis scores (batch, 2, H, r, n), cores (H, h, r, r) and the leading singular vectors of their sum (2, H, r, 1)."""
    generator = torch.Generator().manual_seed(seed)
    row, col = (torch.randn(batch, heads, rank, num_keys, generator=generator).to(dtype) for _ in range(2))
    cores = torch.randn(heads, num_cores, rank, rank, generator=generator).to(dtype)
    _, u, t = memory_ops.core_svd(cores.sum(1).float())
    return torch.stack((row, col), 1), cores, torch.stack((u, t)).unsqueeze(-1).to(dtype)


def tie_free_inputs(batch, heads, rank, num_keys, num_cores, dtype, seed=0):
    """Inputs whose rank-1 projections have no ties in a 16-bit dtype: u = t = e_1, so the projections are the first
    rank component, there a permutation of k/64 (k < n <= 256, exact in bfloat16 and float16)."""
    axis_scores, cores, _ = random_inputs(batch, heads, rank, num_keys, num_cores, dtype, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for axis in range(2):
        for item, head in itertools.product(range(batch), range(heads)):
            axis_scores[item, axis, head, 0] = torch.randperm(num_keys, generator=generator).to(dtype) / 64
    first = torch.zeros(2, heads, rank, 1, dtype=dtype)
    first[:, :, 0] = 1
    return axis_scores, cores, first
