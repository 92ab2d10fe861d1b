"""DualAR text-to-speech models: config, checkpoint loading, tokenizers, the transformer."""

from shoal.models.checkpoint import CheckpointError, load_model
from shoal.models.config import ModelConfig
from shoal.models.dual_ar import DualARTransformer

__all__ = ["CheckpointError", "DualARTransformer", "ModelConfig", "load_model"]
