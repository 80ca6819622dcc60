"""FSDP2 on any device: Accelerate enables FSDP only for accelerator-backed process groups, so on CPU (gloo) an
FSDP launch (`accelerate launch --config_file ultramem/configs/accelerate/fsdp2.yaml`, or torchrun with `--fsdp`)
silently trains as plain DDP. `ultramem.training.trainer.FSDPTrainer` turns that case into real FSDP2 sharding (PyTorch's `fully_shard`
runs on gloo) and refuses FSDP1 there in one line; on GPUs Accelerate's own setup is left alone. Its private
Trainer overrides are in `ultramem.training.trainer_overrides`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback, TrainingArguments

FSDP2_CONFIG = "ultramem/configs/accelerate/fsdp2.yaml"


def requested_fsdp_version(args: TrainingArguments) -> int | None:
    """The FSDP version the launch asked for: the Trainer's `--fsdp` flags, else the `accelerate launch` config."""
    if args.fsdp_plugin_args is not None:
        return int(args.fsdp_plugin_args.get("fsdp_version", 1))
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return int(os.environ.get("FSDP_VERSION", "1"))
    return None


def _grads_placed_like_params(module: torch.nn.Module) -> None:
    """Once per model: the aux loss's gradient reaches each sharded core as a Replicate DTensor of the whole core
    (the loss sums the cores over their sharded head dimension), and FSDP2 adds its reduce-scattered shard to that
    tensor's local data as is; a hook turns such a gradient into the parameter's own placements first."""
    if getattr(module, "_ultramem_grad_placement_hooks", False):
        return
    for param in module.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_hook(
                lambda grad, param=param: (
                    grad
                    if grad.placements == param.placements
                    else grad.redistribute(param.device_mesh, param.placements)
                )
            )
    module._ultramem_grad_placement_hooks = True


def plain_aux_loss(module: torch.nn.Module, args: Any, output: Any) -> Any:
    """Forward hook: the model computes its aux loss from the Tucker cores outside their layers' forward, where FSDP2
    leaves them sharded, so it comes out as a DTensor and would make the LM loss's backward mix tensor kinds."""
    aux = getattr(output, "aux_loss", None)
    if isinstance(aux, DTensor):
        _grads_placed_like_params(module)
        # a copy: `full_tensor()` returns a view, on which FSDP2 warns that an in-place op would skip its hooks
        output.aux_loss = aux.full_tensor().clone()
        if output.lm_loss is not None:
            output.loss = output.lm_loss + output.aux_loss.to(output.lm_loss.dtype)
    return output


def leave_presharded_to_their_owners(model: torch.nn.Module, plugin: FullyShardedDataParallelPlugin) -> frozenset[str]:
    """Parameters that are DTensors before FSDP (the value tables of `--memory_parallel`) are sharded on a mesh of
    their own and reduce their own gradients: `fully_shard` ignores them (Accelerate passes its plugin's
    `ignored_modules` to every `fully_shard` call as `ignored_params`), and `save_model` leaves them to `_save`.
    Returns their names."""
    owners = [m for m in model.modules() if any(isinstance(p, DTensor) for p in m.parameters(recurse=False))]
    if not owners:
        return frozenset()
    plugin.ignored_modules = [*(plugin.ignored_modules or []), *owners]
    return frozenset(n for n, p in model.named_parameters() if isinstance(p, DTensor))


class ShardingReport(TrainerCallback):
    """Logs, when training starts, how many parameters are sharded DTensors: what the launch really does."""

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None, **_: Any
    ) -> None:
        if model is None or not state.is_world_process_zero:
            return
        params = dict(model.named_parameters())
        sharded = {name: p for name, p in params.items() if isinstance(p, DTensor)}
        if sharded:
            placements = sorted({str(p.placements) for p in sharded.values()})
            mode = getattr(args, "memory_parallel", "none")
            tables = sharded.keys() & set(getattr(model, "get_value_table_names", list)()) if mode != "none" else set()
            parts = (("FSDP2", sharded.keys() - tables), (f"memory_parallel={mode}", tables))
            sharders = [name for name, shards in parts if shards]
            verb = "shard" if len(sharders) > 1 else "shards"
            print(
                f"ultramem-train: {' and '.join(sharders)} {verb} {len(sharded)} of {len(params)} parameter tensors over "
                f"{args.world_size} processes ({', '.join(placements)})",
                flush=True,
            )
