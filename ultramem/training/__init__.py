"""Training UltraMem with the Transformers Trainer: the paper's recipe, DeepSpeed configs, the main job.

`train(model_args, data_args, training_args, callbacks=None) -> TrainResult` runs what `ultramem-train` runs, from the
three dataclasses its flags are parsed into (`ultramem.training.pipeline` has an example).
"""

from ultramem.training.arguments import DataArguments, ModelArguments, UltraMemTrainingArguments
from ultramem.training.errors import UsageError
from ultramem.training.pipeline import TrainResult, train
from ultramem.training.trainer import UltraMemTrainer

__all__ = [
    "DataArguments",
    "ModelArguments",
    "TrainResult",
    "UltraMemTrainer",
    "UltraMemTrainingArguments",
    "UsageError",
    "train",
]
