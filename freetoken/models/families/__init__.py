"""The model families, one module each, and the one registry of them.

Each module (``qwen3_moe.py``, ``deepseek_v3.py``, ...) defines ``FAMILY``: a :class:`~.base.Family` with the names
the family goes by (HF ``model_type`` values, its GGUF architecture, tensor names that differ from the common ones)
and what it reads from HF and GGUF configs and writes into GGUF files (:mod:`freetoken.models.families.base`).
Adding a family is one new module plus a line in :data:`ROWS`; every name map the config readers
(:mod:`freetoken.models.config`), the tensor readers (:mod:`freetoken.models.weights`) and the GGUF writer
(:mod:`freetoken.convert.gguf_export`) use is derived here, so each name is written once.
"""

from __future__ import annotations

from freetoken.models.families import (
    deepseek_v2,
    deepseek_v3,
    glm4_moe,
    gpt_oss,
    minimax_m2,
    mixtral,
    olmoe,
    qwen2_moe,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from freetoken.models.families.base import Family

ROWS: tuple[Family, ...] = (
    qwen3_moe.FAMILY,
    qwen2_moe.FAMILY,
    mixtral.FAMILY,
    olmoe.FAMILY,
    glm4_moe.FAMILY,
    gpt_oss.FAMILY,
    deepseek_v3.FAMILY,
    deepseek_v2.FAMILY,
    qwen3_next.FAMILY,
    qwen3_5_moe.FAMILY,
    minimax_m2.FAMILY,
)
BY_NAME = {f.name: f for f in ROWS}

#: HF ``model_type`` -> family.
MODEL_TYPES = {mt: f.name for f in ROWS for mt in f.model_types}
#: GGUF ``general.architecture`` -> the family a file of it is read as.
GGUF_READS = {f.gguf_arch: f.name for f in ROWS if f.reads_gguf}
#: family -> the GGUF architecture written for it.
GGUF_WRITES = {f.name: f.gguf_arch for f in ROWS}
#: Families whose layers mix Gated DeltaNet linear attention with gated full attention.
HYBRID = tuple(f.name for f in ROWS if f.hybrid)
