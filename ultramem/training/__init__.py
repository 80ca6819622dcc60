"""Training UltraMem with the Transformers Trainer: the paper's recipe, DeepSpeed configs, the main job."""

from ultramem.training.arguments import DataArguments, ModelArguments, UltraMemTrainingArguments
from ultramem.training.errors import UsageError
from ultramem.training.trainer import UltraMemTrainer

__all__ = ["DataArguments", "ModelArguments", "UltraMemTrainingArguments", "UltraMemTrainer", "UsageError"]
