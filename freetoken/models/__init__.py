"""Model families as math: the config (``config.from_hf`` / ``from_gguf``), weight sources, dense projections, the
blocks a layer is made of, and the decoder that reads them top to bottom. Routed experts run through the
:class:`~freetoken.models.experts.ExpertRunner` the decoder is given."""

from freetoken.models.config import ConfigError, ModelConfig, from_hf
from freetoken.models.decoder import MoeDecoder
from freetoken.models.experts import ExpertRunner

__all__ = ["ConfigError", "ExpertRunner", "ModelConfig", "MoeDecoder", "from_hf"]
