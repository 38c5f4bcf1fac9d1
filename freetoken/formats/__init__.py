"""Expert weight formats, looked up by name: ``freetoken.formats.get("q4_0")``.

See :mod:`freetoken.formats.base` for the bank layout every kernel reads, and :mod:`freetoken.formats.table` for the
one row per format every per-format table is derived from.
"""

from __future__ import annotations

import importlib

from freetoken.formats.base import ALIGNMENT, MATRICES, BankSpec, ExpertFormat, RecordLayout
from freetoken.formats.table import GGUF_NAMES, NAMES


def get(name: str) -> ExpertFormat:
    """The format called ``name`` (one of :data:`NAMES`)."""
    if name not in NAMES:
        raise ValueError(f"unknown expert format {name!r}; known formats: {', '.join(NAMES)}")
    return importlib.import_module(f"freetoken.formats.{name}").FORMAT


__all__ = ["ALIGNMENT", "GGUF_NAMES", "MATRICES", "NAMES", "BankSpec", "ExpertFormat", "RecordLayout", "get"]
