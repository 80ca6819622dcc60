"""`Trainer` with the UltraMem recipe: a value-table parameter group, split loss logging, memory diagnostics.

Checkpoints are atomic (`ultramem.training.checkpointing`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from ultramem.training.checkpointing import AtomicCheckpointTrainer
from ultramem.training.deepspeed_tables import TablesBesideEngine, hide_tables
from ultramem.training.fsdp import FSDPTrainer
from ultramem.training.schedule import VALUE_GROUP, value_lr_multiplier, with_value_multiplier


def value_table_names(model: nn.Module) -> set[str]:
    """Parameter names of the memory value tables; empty for models without memory layers."""
    getter = getattr(model, "get_value_table_names", None)
    return set(getter()) if getter is not None else set()


class UltraMemTrainer(AtomicCheckpointTrainer, FSDPTrainer):
    """Trains any causal LM; for UltraMem it adds the value-LR group, aux/LM loss logs and memory diagnostics.

    `diagnostics_input_ids` is a fixed batch of validation tokens on which `retrieval_diagnostics` runs at
    every training log, so the numbers are comparable across steps.
    """

    def __init__(self, *args: Any, diagnostics_input_ids: torch.Tensor | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.diagnostics_input_ids = diagnostics_input_ids
        self._loss_sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=self.args.device))
        self._steps_since_log = 0
        self._last_value_lr: float | None = None
        self._tables_beside: TablesBesideEngine | None = None  # sharded tables under DeepSpeed (kept out of it)

    # ---- optimizer and schedule -------------------------------------------------------------------------------
    def _value_lr_settings(self) -> tuple[float, bool]:
        config = self.model.config
        return float(getattr(config, "value_lr_multiplier", 1.0)), bool(getattr(config, "value_lr_decay", False))

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
        """The base schedule for every group, times the 10x -> 1x multiplier for the value group."""
        if self.lr_scheduler is None:
            optimizer = self.optimizer if optimizer is None else optimizer
            base = super().create_scheduler(num_training_steps, optimizer)
            start, decay = self._value_lr_settings()
            self.lr_scheduler = with_value_multiplier(base, optimizer, num_training_steps, start, decay)
            if self._tables_beside is not None:
                tables = self._tables_beside
                tables.scheduler = with_value_multiplier(base, tables.optimizer, num_training_steps, start, decay)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _get_learning_rate(self) -> float:
        """The Trainer reads the LR of the step just taken here; remember the value group's LR of that step too."""
        if self._tables_beside is not None:
            self._last_value_lr = self._tables_beside.last_lr
        else:
            groups = self.optimizer.param_groups
            self._last_value_lr = next((float(g["lr"]) for g in groups if g.get("ultramem_group") == VALUE_GROUP), None)
        return super()._get_learning_rate()

    def _tables_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer that steps the value tables: the Trainer's, or their own beside a DeepSpeed engine."""
        return self.optimizer if self._tables_beside is None else self._tables_beside.optimizer

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        """Once DeepSpeed's engine exists, the tables kept out of it join its gradient norm and follow its steps."""
        prepared = super()._prepare_for_training(*args, **kwargs)
        if self._tables_beside is not None:
            self._tables_beside.attach(self.model_wrapped)
        return prepared

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

    def _training_log_extras(self) -> dict[str, float]:
        """LM and aux loss per step since the last log (over ranks), the value-LR multiplier, diagnostics."""
        extras: dict[str, float] = {}
        if self._loss_sums and self._steps_since_log > 0:
            for name, total in self._loss_sums.items():
                extras[name] = self.accelerator.reduce(total / self._steps_since_log, reduction="mean").item()
            self._loss_sums.clear()
        if self._last_value_lr is not None:
            start, decay = self._value_lr_settings()
            step_taken = self.state.global_step - 1
            extras["value_lr_multiplier"] = value_lr_multiplier(step_taken, self.state.max_steps, start, decay)
            extras["value_learning_rate"] = self._last_value_lr
        if value_table_names(self.model):
            extras.update(self._memory_diagnostics())
        return extras

    def _memory_diagnostics(self) -> dict[str, float]:
        """`retrieval_diagnostics` on the fixed batch. `log` runs on every rank, as the diagnostics must under ZeRO-3
        and FSDP2 (their forward and gathers are collective); every rank gets the same numbers, rank 0 writes them."""
        if self.diagnostics_input_ids is None or self.args.diagnostics_batch_size <= 0:
            return {}
        from ultramem.diagnostics import retrieval_diagnostics

        stats = retrieval_diagnostics(self.model, self.diagnostics_input_ids.to(self.args.device))  # eval, no_grad
        return {f"memory/{name}": float(value) for name, value in stats.items()}

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        self._steps_since_log = self.state.global_step - self._globalstep_last_logged
        super()._maybe_log_save_evaluate(*args, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.model.training:
            logs.update(self._training_log_extras())
        super().log(logs, start_time)

    # Sharded value tables (--memory_parallel): their shards and optimizer state live in DCP checkpoints.
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """With sharded value tables, `save_pretrained` writes the rest (`state_dict` when the engine gathered it)
        and every rank streams its shards in."""
        from ultramem.parallel.checkpoint import save_value_tables, sharded_tables

        tables = sharded_tables(self.model)
        if not tables:
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = self.model.state_dict() if state_dict is None else state_dict
        dense = {name: tensor for name, tensor in state.items() if name not in tables}
        super()._save(output_dir, state_dict=dense)
        save_value_tables(self.model, output_dir, self.args.should_save)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """With sharded value tables, their weights and optimizer state go to a DCP checkpoint of their own."""
        from ultramem.parallel.checkpoint import sharded_tables
        from ultramem.parallel.resume import save_table_states, tables_left_out_of

        if not sharded_tables(self.model):
            return super()._save_optimizer_and_scheduler(output_dir)
        with tables_left_out_of(self.optimizer, self.model):
            super()._save_optimizer_and_scheduler(output_dir)
        save_table_states(self.model, self._tables_optimizer(), output_dir)
        if self._tables_beside is not None and self.args.should_save:
            self._tables_beside.save_schedule(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        from ultramem.parallel.checkpoint import sharded_tables
        from ultramem.parallel.resume import has_table_states, load_dense_weights
        from ultramem.training.errors import UsageError

        if not sharded_tables(self.model):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        if not has_table_states(resume_from_checkpoint):
            raise UsageError(
                f"--resume_from_checkpoint {resume_from_checkpoint} was written without --memory_parallel (no "
                "value_tables/); resume it with --memory_parallel none"
            )
        load_dense_weights(self.model, resume_from_checkpoint)  # the tables come with their optimizer state

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        from ultramem.parallel.resume import has_table_states, load_table_states

        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and has_table_states(checkpoint):
            load_table_states(self.model, self._tables_optimizer(), checkpoint)
            if self._tables_beside is not None:  # under DeepSpeed, which loaded the rest of the model above
                self._tables_beside.load_schedule(checkpoint)
