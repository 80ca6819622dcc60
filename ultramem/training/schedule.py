"""The value tables' learning-rate multiplier, applied on top of the base schedule of every other parameter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ultramem.training.errors import UsageError

VALUE_GROUP = "values"
# The paper's recipe: the value tables start at 10x the base learning rate and fall linearly to 1x
DEFAULT_VALUE_LR_MULTIPLIER = 10.0
DEFAULT_VALUE_LR_DECAY = True


@dataclass
class ValueLearningRate(TrainerCallback, ExportableState):
    """The value tables' learning-rate settings of a run: `value_lr_multiplier` at the first step, falling to 1 by
    the last when `value_lr_decay`. A callback only to be saved: trainer_state.json keeps it among its
    `stateful_callbacks`, so what a checkpoint was trained with is read back without unpickling training_args.bin."""

    value_lr_multiplier: float = DEFAULT_VALUE_LR_MULTIPLIER
    value_lr_decay: bool = DEFAULT_VALUE_LR_DECAY

    @classmethod
    def resolve(cls, args: Any, config: Any) -> ValueLearningRate:
        """Each setting from the training arguments when given, else from the model config (where ultramem < 0.2
        kept it: deprecated, still honoured), else the paper's default."""
        settings = {}
        for name, default in (
            ("value_lr_multiplier", DEFAULT_VALUE_LR_MULTIPLIER),
            ("value_lr_decay", DEFAULT_VALUE_LR_DECAY),
        ):
            given = getattr(args, name, None)
            settings[name] = given if given is not None else getattr(config, name, None)
            settings[name] = default if settings[name] is None else settings[name]
        return cls(float(settings["value_lr_multiplier"]), bool(settings["value_lr_decay"]))

    def factor(self, step: int, total_steps: int) -> float:
        return value_lr_multiplier(step, total_steps, self.value_lr_multiplier, self.value_lr_decay)

    def state(self) -> dict[str, Any]:
        settings = {"value_lr_multiplier": self.value_lr_multiplier, "value_lr_decay": self.value_lr_decay}
        return {"args": settings, "attributes": {}}


def value_lr_multiplier(step: int, total_steps: int, start: float, decay: bool) -> float:
    """Factor for optimizer step `step` (0-based): `start` at the first step, falling linearly to 1 at the last one
    (step `total_steps - 1`) when `decay` (paper: 10x -> 1x), else constant."""
    if not decay or total_steps <= 1:
        return start
    progress = min(max(step / (total_steps - 1), 0.0), 1.0)
    return start + (1.0 - start) * progress


def with_value_multiplier(
    base: LRScheduler, optimizer: Optimizer, total_steps: int, value_lr: ValueLearningRate
) -> LambdaLR:
    """A `LambdaLR` that follows `base` for every group and multiplies the value group's factor by the multiplier."""
    if not isinstance(base, LambdaLR):
        raise UsageError(
            f"--lr_scheduler_type gives {type(base).__name__}, which cannot carry the value-table LR multiplier; "
            "use a LambdaLR schedule (cosine_with_min_lr, cosine, linear, constant_with_warmup, ...)"
        )
    base_lambda = base.lr_lambdas[0]

    def scaled(step: int) -> float:
        return base_lambda(step) * value_lr.factor(step, total_steps)

    lambdas: list[Callable[[int], float]] = [
        scaled if group.get("ultramem_group") == VALUE_GROUP else base_lambda for group in optimizer.param_groups
    ]
    return LambdaLR(optimizer, lambdas)
