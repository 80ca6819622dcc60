"""FSDP2 on any device: Accelerate enables FSDP only for accelerator-backed process groups, so on CPU (gloo) an
FSDP launch (`accelerate launch --config_file ultramem/configs/accelerate/fsdp2.yaml`, or torchrun with `--fsdp`)
silently trains as plain DDP. `FSDPTrainer` turns that case into real FSDP2 sharding (PyTorch's `fully_shard`
runs on gloo) and refuses FSDP1 there in one line; on GPUs Accelerate's own setup is left alone.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import Trainer, TrainerCallback
from transformers.trainer import TRAINING_ARGS_NAME

from ultramem.training.errors import UsageError

FSDP2_CONFIG = "ultramem/configs/accelerate/fsdp2.yaml"


def _requested_version(trainer: Trainer) -> int | None:
    """The FSDP version the launch asked for: the Trainer's `--fsdp` flags, else the `accelerate launch` config."""
    if trainer.args.fsdp_plugin_args is not None:
        return int(trainer.args.fsdp_plugin_args.get("fsdp_version", 1))
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return int(os.environ.get("FSDP_VERSION", "1"))
    return None


def _plain_aux_loss(module: torch.nn.Module, args: Any, output: Any) -> Any:
    """Forward hook: the model computes its aux loss from the Tucker cores outside their layers' forward, where FSDP2
    leaves them sharded, so it comes out as a DTensor and would make the LM loss's backward mix tensor kinds."""
    aux = getattr(output, "aux_loss", None)
    if isinstance(aux, DTensor):
        output.aux_loss = aux.full_tensor()
        if output.lm_loss is not None:
            output.loss = output.lm_loss + output.aux_loss.to(output.lm_loss.dtype)
    return output


class FSDPTrainer(Trainer):
    """A `Trainer` that shards with FSDP2 on CPU process groups too, instead of silently running DDP."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.is_fsdp_enabled and hasattr(self.model, "get_value_table_names"):
            self.model.register_forward_hook(_plain_aux_loss)

    def create_accelerator_and_postprocess(self) -> None:
        version = None if torch.cuda.is_available() else _requested_version(self)
        if version is not None and version != 2:
            raise UsageError(
                f"--fsdp: FSDP{version} does not shard on CPU process groups (it would run as DDP); allowed: "
                f"fsdp_version 2 (the default of --fsdp, or accelerate launch --config_file {FSDP2_CONFIG})"
            )
        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        if version is None or state.distributed_type != DistributedType.MULTI_CPU:
            return
        plugin = (
            FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            if self.args.fsdp_plugin_args is not None
            else FullyShardedDataParallelPlugin()  # reads the FSDP_* variables `accelerate launch` sets
        )
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = plugin
        self.is_fsdp_enabled = self._fsdp_on_cpu = True

    _fsdp_on_cpu = False

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """On CPU Accelerate's FSDP save hands sharded DTensors to safetensors and copies FSDP's own source files as
        "model code": gather the full state dict and save it as the plain model class would."""
        if not self._fsdp_on_cpu:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # collective: every rank gathers
        full = get_model_state_dict(self.model, options=options)
        if not self.args.should_save:
            return None
        model = self.accelerator.unwrap_model(self.model)
        model_cls = next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))
        with torch.device("meta"):
            plain = model_cls(model.config)  # the same model unsharded, its tensors those gathered above
        plain.load_state_dict(full, assign=True)
        plain.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        return None


class ShardingReport(TrainerCallback):
    """Logs, when training starts, how many parameters are sharded DTensors: what the launch really does."""

    def on_train_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None, **_: Any) -> None:
        if model is None or not state.is_world_process_zero:
            return
        params = list(model.parameters())
        sharded = [p for p in params if isinstance(p, DTensor)]
        if sharded:
            placements = sorted({str(p.placements) for p in sharded})
            mode = getattr(args, "memory_parallel", "none")
            sharder = "FSDP2" if mode == "none" else f"memory_parallel={mode}"
            print(
                f"ultramem-train: {sharder} shards {len(sharded)} of {len(params)} parameter tensors over "
                f"{args.world_size} processes ({', '.join(placements)})",
                flush=True,
            )
