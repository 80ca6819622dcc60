"""Sharded value tables (`--memory_parallel`) beside a DeepSpeed engine: kept out of it, stepped by an optimizer of
their own, clipped by the one global gradient norm.

DeepSpeed has no ignore list: ZeRO flattens every parameter of the optimizer it wraps, ZeRO-3 partitions every
parameter of the module (and gathers it whole for its forward), and the engine broadcasts rank 0's parameters.
So the tables stop being module parameters (the store keeps its DTensor as a plain attribute and its lookups are
unchanged); their AdamW follows the value-LR schedule (10x -> 1x) and steps right after the engine's step, and
the engine's gradient norm takes the tables' shards in, so both sides clip by the same global norm. A Trainer
checkpoint holds their shards and AdamW state (`ultramem.parallel.resume`) and their schedule (`SCHEDULE_FILE`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import get_total_norm
from torch.optim.lr_scheduler import LRScheduler

from ultramem.parallel.checkpoint import sharded_tables
from ultramem.training.errors import UsageError

SCHEDULE_FILE = "value_tables_scheduler.pt"  # in a Trainer checkpoint, beside DeepSpeed's own files


def hide_tables(model: nn.Module) -> list[nn.Parameter]:
    """Make each sharded table's weight a plain attribute of its store (no longer in `model.parameters()`)."""
    tables = []
    for store in sharded_tables(model).values():
        weight = store._parameters.pop("weight", None)
        if weight is not None:
            object.__setattr__(store, "weight", weight)  # nn.Module.__setattr__ would register it again
            tables.append(weight)
    return tables


class TablesBesideEngine:
    """The tables' optimizer and value-LR schedule, driven by the DeepSpeed engine's step (see the module docstring)."""

    def __init__(self, tables: list[nn.Parameter], optimizer: torch.optim.Optimizer, max_norm: float):
        self.tables, self.optimizer, self.max_norm = tables, optimizer, max_norm
        self.scheduler: LRScheduler | None = None  # the value-LR schedule, built with the Trainer's
        self.last_lr: float | None = None  # of the last step: the scheduler has moved on when the Trainer logs

    def tables_norm(self) -> torch.Tensor:
        """2-norm of the tables' (loss-scaled) gradients over all their shards; collective on the tables' mesh."""
        norm = get_total_norm([p.grad for p in self.tables if p.grad is not None])
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def attach(self, engine: Any) -> None:
        """Add the tables' norm to the engine's gradient norm, and step the tables after each engine step."""
        from deepspeed.runtime.utils import combine_grad_norm_groups

        zero, engine_step = engine.optimizer, engine.step
        if hasattr(zero, "_get_norm_groups"):  # ZeRO-3: a norm per group, combined by its caller
            norm_groups = zero._get_norm_groups
            zero._get_norm_groups = lambda: [*norm_groups(), self.tables_norm()]
        else:  # ZeRO-1/2
            global_norm = zero.scaled_global_norm
            zero.scaled_global_norm = lambda norm_type=2: combine_grad_norm_groups(
                [global_norm(norm_type), self.tables_norm()]
            )

        def step(*args: Any, **kwargs: Any) -> Any:
            loss_scale = float(getattr(zero, "loss_scale", 1.0))  # the scale the gradients carry (the step updates it)
            result = engine_step(*args, **kwargs)
            self.step(engine.get_global_grad_norm(), loss_scale, skipped=bool(getattr(zero, "overflow", False)))
            return result

        engine.step = step

    def save_schedule(self, checkpoint: str) -> None:
        """The value-LR schedule's position (the tables' weights and AdamW state go to `value_tables/` with DCP)."""
        torch.save(self.scheduler.state_dict(), os.path.join(checkpoint, SCHEDULE_FILE))

    def load_schedule(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, SCHEDULE_FILE)
        if not os.path.isfile(path):
            raise UsageError(
                f"--resume_from_checkpoint {checkpoint} has no {SCHEDULE_FILE}: it was not written by a DeepSpeed run "
                "with --memory_parallel; resume it with the launcher that wrote it (torchrun or accelerate launch "
                "without DeepSpeed)"
            )
        self.scheduler.load_state_dict(torch.load(path, weights_only=True))
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr  # the optimizer's own state (DCP) holds no param groups

    @torch.no_grad()
    def step(self, total_norm: float | None, loss_scale: float, skipped: bool) -> None:
        """Unscale and clip the tables' gradients as DeepSpeed did its own, then step; nothing when it skipped.

        `total_norm` is None when DeepSpeed computes no norm (`compute_grad_norm: false`, which forbids clipping)."""
        if not skipped:
            clip = 1.0
            if total_norm is not None and self.max_norm > 0:
                clip = max(1.0, (float(total_norm) + 1e-6) / self.max_norm)
            for table in self.tables:
                if table.grad is not None:
                    table.grad.div_(loss_scale * clip)
            self.optimizer.step()
            self.last_lr = float(self.optimizer.param_groups[0]["lr"])
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
