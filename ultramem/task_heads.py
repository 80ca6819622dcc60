"""The task heads' shared part: Transformers' generic heads (sequence and token classification, question answering)
on the UltraMem backbone, with the TDQKR aux loss in their loss. The heads themselves are in `modeling_ultramem`.

This file is copied beside `modeling_ultramem.py` into checkpoints (remote code), so it imports only relatively.
"""

from collections.abc import Callable

import torch
from transformers import AutoModel
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_utils import PreTrainedModel


class TaskHeadWithAuxLoss:
    """A Transformers task head on UltraMemModel whose loss also holds the TDQKR aux loss, as the causal LM's does.

    Without it fine-tuning would leave the Tucker cores free to drift from the rank-1 approximation retrieval uses.
    The generic heads compute their loss with `self.loss_function` when given labels; the aux loss is added there.
    Those losses are means over the micro-batch (they take no `num_items_in_batch`), so the Trainer must average
    them over gradient-accumulation steps itself: `accepts_loss_kwargs = False` (a `**kwargs` forward says otherwise).
    """

    accepts_loss_kwargs = False
    backbone_class: type[PreTrainedModel]  # what `AutoModel` builds for the head's config (the model file's base model)

    def __init__(self, config: PreTrainedConfig):
        # The generic heads build their backbone with `AutoModel.from_config(config)`, which finds remote code only
        # through the Auto mapping: a checkpoint's code (its own copy of the config class) is registered first, so a
        # head loads with `trust_remote_code=True` alone instead of asking again, and failing, for the backbone.
        if type(config) not in AutoModel._model_mapping:
            AutoModel.register(type(config), self.backbone_class, exist_ok=True)
        super().__init__(config)

    @property
    def loss_function(self) -> Callable[..., torch.Tensor]:
        task_loss = super().loss_function

        def task_and_aux_loss(*args, **kwargs) -> torch.Tensor:
            loss = task_loss(*args, **kwargs)
            return loss + self.model.aux_loss().to(loss.device, loss.dtype)

        return task_and_aux_loss
