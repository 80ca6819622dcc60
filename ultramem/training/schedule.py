"""The value tables' learning-rate multiplier, applied on top of the base schedule of every other parameter."""

from __future__ import annotations

from collections.abc import Callable

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from ultramem.training.errors import UsageError

VALUE_GROUP = "values"


def value_lr_multiplier(step: int, total_steps: int, start: float, decay: bool) -> float:
    """Factor for optimizer step `step` (0-based): `start` at the first step, falling linearly to 1 at the last one
    (step `total_steps - 1`) when `decay` (paper: 10x -> 1x), else constant."""
    if not decay or total_steps <= 1:
        return start
    progress = min(max(step / (total_steps - 1), 0.0), 1.0)
    return start + (1.0 - start) * progress


def with_value_multiplier(
    base: LRScheduler, optimizer: Optimizer, total_steps: int, start: float, decay: bool
) -> LambdaLR:
    """A `LambdaLR` that follows `base` for every group and multiplies the value group's factor by the multiplier."""
    if not isinstance(base, LambdaLR):
        raise UsageError(
            f"--lr_scheduler_type gives {type(base).__name__}, which cannot carry the value-table LR multiplier; "
            "use a LambdaLR schedule (cosine_with_min_lr, cosine, linear, constant_with_warmup, ...)"
        )
    base_lambda = base.lr_lambdas[0]

    def scaled(step: int) -> float:
        return base_lambda(step) * value_lr_multiplier(step, total_steps, start, decay)

    lambdas: list[Callable[[int], float]] = [
        scaled if group.get("ultramem_group") == VALUE_GROUP else base_lambda for group in optimizer.param_groups
    ]
    return LambdaLR(optimizer, lambdas)
