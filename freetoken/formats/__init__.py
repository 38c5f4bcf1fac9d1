"""Expert weight formats, looked up by name: ``freetoken.formats.get("q4_0")``.

See :mod:`freetoken.formats.base` for the bank layout every kernel reads.
"""

from __future__ import annotations

import importlib

from freetoken.formats.base import ALIGNMENT, MATRICES, BankSpec, ExpertFormat, RecordLayout

NAMES = ("bf16", "fp8_block", "nvfp4", "mxfp4", "ds_fp4", "q4_0", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_xs")
#: The GGUF block formats kept as the file stores them (lossless byte moves: ``from_gguf`` / ``to_gguf``).
GGUF_NAMES = ("q4_0", "mxfp4", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_xs")


def get(name: str) -> ExpertFormat:
    """The format called ``name`` (one of :data:`NAMES`)."""
    if name not in NAMES:
        raise ValueError(f"unknown expert format {name!r}; known formats: {', '.join(NAMES)}")
    return importlib.import_module(f"freetoken.formats.{name}").FORMAT


__all__ = ["ALIGNMENT", "GGUF_NAMES", "MATRICES", "NAMES", "BankSpec", "ExpertFormat", "RecordLayout", "get"]
