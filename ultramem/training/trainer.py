"""`Trainer` with the UltraMem recipe: a value-table parameter group, split loss logging, memory diagnostics.

Built on the Trainer's public methods (`create_optimizer`, `create_scheduler`, `compute_loss`, `log`) and
`TrainerCallback` events; the private methods it still overrides (atomic checkpoints, FSDP2 on CPU, sharded value
tables) are all in `ultramem.training.trainer_overrides`, each with the test that pins it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

from ultramem.query_normalization import normalises_by_batch_statistics, recalibrate_query_statistics
from ultramem.training.deepspeed_tables import TablesBesideEngine, hide_tables
from ultramem.training.fsdp import plain_aux_loss
from ultramem.training.schedule import VALUE_GROUP, ValueLearningRate, with_value_multiplier
from ultramem.training.trainer_overrides import AtomicCheckpointTrainer, CPUFSDPOverrides, ShardedTableOverrides


def value_table_names(model: nn.Module) -> set[str]:
    """Parameter names of the memory value tables; empty for models without memory layers."""
    getter = getattr(model, "get_value_table_names", None)
    return set(getter()) if getter is not None else set()


class _RecipeEvents(TrainerCallback):
    """The Trainer events the recipe follows: the value group's LR of each optimizer step (read before the scheduler
    moves on, as the Trainer reads its own), the steps since the last log, the DeepSpeed engine (once it exists)
    that the value tables kept out of it must follow, and the query statistics recomputed before a step's
    checkpoint, evaluation or memory logs read them."""

    def __init__(self, trainer: UltraMemTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._steps_since_log = 0
        if self.trainer._tables_beside is not None:
            self.trainer._tables_beside.attach(self.trainer.model_wrapped)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        if trainer._tables_beside is not None:
            trainer._last_value_lr = trainer._tables_beside.last_lr
        else:
            groups = trainer.optimizer.param_groups
            trainer._last_value_lr = next(
                (float(g["lr"]) for g in groups if g.get("ultramem_group") == VALUE_GROUP), None
            )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._steps_since_log += 1
        # after the Trainer's own callback has decided what this step does, before it does it
        logs_memory = control.should_log and self.trainer.diagnoses_memory()
        if control.should_save or control.should_evaluate or logs_memory:
            self.trainer.recalibrate_query_statistics()


class FSDPTrainer(CPUFSDPOverrides):
    """A `Trainer` that shards with FSDP2 on CPU process groups too, instead of silently running DDP (its private
    overrides: `ultramem.training.trainer_overrides.CPUFSDPOverrides`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.is_fsdp_enabled and hasattr(self.model, "get_value_table_names"):
            self.model.register_forward_hook(plain_aux_loss)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Gather what FSDP sharded (collective: every rank gathers, one tensor at a time to host memory) and `_save`
        it; the presharded tables are left to `_save` (streamed shard by shard, `ultramem.parallel.checkpoint`)."""
        if not self._saves_itself():
            return super().save_model(output_dir, _internal_call)
        full = {
            name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).cpu()
            for name, tensor in self.model.state_dict().items()
            if name not in self._presharded
        }
        self._save(output_dir or self.args.output_dir, state_dict=full)
        return None


class UltraMemTrainer(ShardedTableOverrides, AtomicCheckpointTrainer, FSDPTrainer):
    """Trains any causal LM; for UltraMem it adds the value-LR group, aux/LM loss logs and memory diagnostics.

    `diagnostics_input_ids` is a fixed batch of validation tokens on which `retrieval_diagnostics` runs at
    every training log, so the numbers are comparable across steps. `query_statistics_inputs` (this rank's input ids,
    a few batches) recompute the query statistics of a model normalised by batch statistics before every checkpoint,
    evaluation and memory log, so each reads what a model saved at that step reads (`recalibrate_query_statistics`).
    The recomputed statistics are kept, as BatchNorm's "precise statistics" are between epochs (pycls), so a run
    resumed from a checkpoint continues exactly.
    """

    def __init__(
        self,
        *args: Any,
        diagnostics_input_ids: torch.Tensor | None = None,
        query_statistics_inputs: list[torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.diagnostics_input_ids = diagnostics_input_ids
        self.query_statistics_inputs = query_statistics_inputs or []
        self._loss_sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=self.args.device))
        self._steps_since_log = 0
        self._last_value_lr: float | None = None
        self._tables_beside: TablesBesideEngine | None = None  # sharded tables under DeepSpeed (kept out of it)
        # `args.value_lr_multiplier` and `args.value_lr_decay`, else the deprecated config fields, else the paper's
        self.value_lr = ValueLearningRate.resolve(self.args, self.model.config)
        self.add_callback(_RecipeEvents(self))
        self.add_callback(self.value_lr)  # saved in trainer_state.json (its stateful callbacks)

    # ---- optimizer and schedule -------------------------------------------------------------------------------

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """AdamW over three groups: decayed weights, undecayed norms/biases, and the value tables (own LR factor)."""
        if self.optimizer is not None:
            return self.optimizer
        opt_model = self.model if model is None else model
        tables = hide_tables(opt_model) if self.is_deepspeed_enabled else []
        decay = set(self.get_decay_parameter_names(opt_model))
        values = value_table_names(opt_model)
        groups: dict[str, dict[str, Any]] = {
            "decay": {"params": [], "weight_decay": self.args.weight_decay},
            "no_decay": {"params": [], "weight_decay": 0.0},
            VALUE_GROUP: {"params": [], "weight_decay": self.args.weight_decay},
        }
        for name, param in opt_model.named_parameters():
            if param.requires_grad:
                key = VALUE_GROUP if name in values else "decay" if name in decay else "no_decay"
                groups[key]["params"].append(param)
        param_groups = [{**group, "ultramem_group": key} for key, group in groups.items() if group["params"]]
        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        self.optimizer = optimizer_cls(param_groups, **optimizer_kwargs)
        if tables:
            group = {**groups[VALUE_GROUP], "params": tables, "ultramem_group": VALUE_GROUP}
            table_optimizer = optimizer_cls([group], **optimizer_kwargs)
            self._tables_beside = TablesBesideEngine(tables, table_optimizer, self.args.max_grad_norm)
        return self.optimizer

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.optim.lr_scheduler.LRScheduler:
        """The base schedule for every group, times the value-LR multiplier (`self.value_lr`) for the value group."""
        if self.lr_scheduler is None:
            optimizer = self.optimizer if optimizer is None else optimizer
            base = super().create_scheduler(num_training_steps, optimizer)
            self.lr_scheduler = with_value_multiplier(base, optimizer, num_training_steps, self.value_lr)
            if self._tables_beside is not None:
                tables = self._tables_beside
                tables.scheduler = with_value_multiplier(base, tables.optimizer, num_training_steps, self.value_lr)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    # ---- logging ------------------------------------------------------------------------------------------------
    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if model.training and isinstance(outputs, dict) and outputs.get("aux_loss") is not None:
            lm_scale, aux_scale = self._loss_part_scales(num_items_in_batch)
            aux = outputs["aux_loss"].to(loss.dtype)
            if outputs.get("lm_loss") is not None:  # the model's loss, LM + aux: the Trainer scaled both alike
                lm_part = outputs["lm_loss"] * lm_scale
                loss = loss - aux * lm_scale + aux * aux_scale
            else:  # label smoothing: the Trainer took the labels and computed the LM loss alone from the logits
                lm_part = loss
                loss = loss + aux * aux_scale
            self._loss_sums["lm_loss"] += lm_part.detach().float()
            self._loss_sums["aux_loss"] += aux.detach().float() * aux_scale
        return (loss, outputs) if return_outputs else loss

    def _loss_part_scales(self, num_items_in_batch: torch.Tensor | int | None) -> tuple[float, float]:
        """Factors that turn this micro-batch's LM and aux loss into their share of the optimizer step's loss.

        When the LM loss is normalized by the tokens of the whole accumulated, all-rank batch, the Trainer skips
        the division by the accumulation steps and multiplies by the number of processes (DDP then averages):
        right for the LM term, but the aux loss (a function of the weights only) must count once per step,
        whatever the world size and accumulation.
        """
        accumulation = self.current_gradient_accumulation_steps
        if num_items_in_batch is None or not self.model_accepts_loss_kwargs:
            return 1.0 / accumulation, 1.0 / accumulation
        processes = self.accelerator.num_processes // self.get_tp_size()
        return float(processes if self.args.average_tokens_across_devices else 1), 1.0 / accumulation

    def diagnoses_memory(self) -> bool:
        """Whether training logs carry the memory diagnostics (`memory/*`)."""
        return self.diagnostics_input_ids is not None and self.args.diagnostics_batch_size > 0

    def recalibrate_query_statistics(self) -> None:
        """The running query statistics recomputed with the current weights on `query_statistics_inputs`, for a model
        that trains with batch statistics (the running modes need none). Collective: every rank calls it."""
        if self.query_statistics_inputs and normalises_by_batch_statistics(self.model):
            recalibrate_query_statistics(self.model, self.query_statistics_inputs)

    def _training_log_extras(self) -> dict[str, float]:
        """LM and aux loss per step since the last log (over ranks), the value-LR multiplier, diagnostics."""
        extras: dict[str, float] = {}
        if self._loss_sums and self._steps_since_log > 0:
            for name, total in self._loss_sums.items():
                extras[name] = self.accelerator.reduce(total / self._steps_since_log, reduction="mean").item()
            self._loss_sums.clear()
        self._steps_since_log = 0
        if self._last_value_lr is not None:
            extras["value_lr_multiplier"] = self.value_lr.factor(self.state.global_step - 1, self.state.max_steps)
            extras["value_learning_rate"] = self._last_value_lr
        if value_table_names(self.model) or getattr(getattr(self.model, "config", None), "ngram_layers", None):
            extras.update(self._memory_diagnostics())
        return extras

    def _memory_diagnostics(self) -> dict[str, float]:
        """`retrieval_diagnostics` on the fixed batch. `log` runs on every rank, as the diagnostics must under ZeRO-3
        and FSDP2 (their forward and gathers are collective); every rank gets the same numbers, rank 0 writes them."""
        if not self.diagnoses_memory():
            return {}
        from ultramem.diagnostics import retrieval_diagnostics

        stats = retrieval_diagnostics(self.model, self.diagnostics_input_ids.to(self.args.device))  # eval, no_grad
        return {f"memory/{name}": float(value) for name, value in stats.items()}

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.model.training:
            logs.update(self._training_log_extras())
        super().log(logs, start_time)
