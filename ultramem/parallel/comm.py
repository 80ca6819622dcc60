"""The collectives of the sharded value stores: PyTorch's autograd collectives, each recording what it sends.

Every call adds the bytes this rank sends to other ranks (its own block excluded) to the active `CommLog`,
in the forward and, mirrored, in the backward, so tests and the benchmark compare measured traffic with the
paper's formulas (`ultramem.parallel.volume`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

_active_logs: list[defaultdict[str, int]] = []


@contextmanager
def count_bytes() -> Iterator[defaultdict[str, int]]:
    """Bytes sent by this rank per collective label ("indices", "values", ...) while the context is open."""
    log: defaultdict[str, int] = defaultdict(int)
    _active_logs.append(log)
    try:
        yield log
    finally:
        _active_logs.remove(log)


def _record(label: str, num_bytes: int) -> None:
    for log in _active_logs:
        log[label] += num_bytes


class _RecordBackward(torch.autograd.Function):
    """Identity whose backward records the bytes the collective's backward sends."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, label: str, num_bytes: int) -> torch.Tensor:
        ctx.label, ctx.num_bytes = label, num_bytes
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        _record(ctx.label + ".grad", ctx.num_bytes)
        return grad, None, None


def all_to_all(
    tensor: torch.Tensor, receive: list[int], send: list[int], group: dist.ProcessGroup, label: str
) -> torch.Tensor:
    """Rows `send[q]` of `tensor` (in rank order) go to rank q; returns the `receive[q]` rows from each q."""
    rank, row = dist.get_rank(group), tensor.shape[1:].numel() * tensor.element_size()
    _record(label, (sum(send) - send[rank]) * row)
    output = funcol.all_to_all_single_autograd(tensor.contiguous(), receive, send, group)
    output = funcol.wait_tensor(output)
    if output.requires_grad:
        output = _RecordBackward.apply(output, label, (sum(receive) - receive[rank]) * row)
    return output


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup, label: str) -> torch.Tensor:
    """Concatenation along dim 0 of every rank's `tensor` (same shape on every rank), in rank order."""
    size = dist.get_world_size(group)
    num_bytes = tensor.numel() * tensor.element_size() * (size - 1)
    _record(label, num_bytes)
    output = funcol.wait_tensor(funcol.all_gather_single_autograd(tensor.contiguous(), 0, group))
    if output.requires_grad:
        output = _RecordBackward.apply(output, label, num_bytes)
    return output


def exchange_counts(send: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Each rank's `send[q]` (how many items it sends to q) becomes q's receive count from it."""
    receive = torch.empty_like(send)
    _record("counts", (send.shape[0] - 1) * send.shape[1:].numel() * send.element_size())
    dist.all_to_all_single(receive, send.contiguous(), group=group)
    return receive


class _DataParallelMean(torch.autograd.Function):
    """Identity whose backward turns a shard's gradient into the data-parallel mean.

    The shard's gradient sums every rank's loss gradient (the lookups of all ranks reach it); DDP averages the
    replicated parameters over the W data-parallel ranks, so the shard's gradient is divided by W, and summed
    over the ranks that hold the same shard (the mesh's "replicate" dimension).
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ctx.mesh = mesh
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad / ctx.mesh.size()
        if ctx.mesh.size(0) > 1:
            _record("grad_all_reduce", grad.numel() * grad.element_size())
            dist.all_reduce(grad, group=ctx.mesh.get_group(0))
        return grad, None


def data_parallel_mean_grad(shard: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """`shard` itself; its gradient becomes the data-parallel mean (see `_DataParallelMean`)."""
    return _DataParallelMean.apply(shard, mesh)
