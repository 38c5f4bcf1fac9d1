"""Model families: configuration (``config.from_hf``) and the MoE decoder on any device."""

from freetoken.models.config import ConfigError, ModelConfig, from_hf
from freetoken.models.decoder import MoeDecoder

__all__ = ["ConfigError", "ModelConfig", "MoeDecoder", "from_hf"]
