"""One row per model family: the names it goes by in HF config.json files and GGUF files, and the family-wide facts
the readers and writers share. The name maps of the config readers (:mod:`freetoken.models.config`) and the GGUF
writer (:mod:`freetoken.convert.gguf_export`) are derived from :data:`ROWS`, so each name is written once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    #: HF ``config.json`` ``model_type`` values read as this family
    model_types: tuple[str, ...]
    #: GGUF ``general.architecture`` written for it (llama.cpp's name; ``llama`` with experts is Mixtral's layout)
    gguf_arch: str
    #: a GGUF file of ``gguf_arch`` is read as this family (deepseek2 files are read as deepseek_v3, whose reader
    #: covers DeepSeek-V2's layout as well)
    reads_gguf: bool = True
    #: Gated DeltaNet linear-attention layers beside gated full attention (``layer_types``)
    hybrid: bool = False
    #: llama.cpp renormalises the top-k router weights when ``{arch}.expert_weights_norm`` is absent (it hard-codes
    #: this per architecture; glm4moe reads the key, default false)
    gguf_norm_topk: bool = False


ROWS = (
    Family("qwen3_moe", ("qwen3_moe",), "qwen3moe", gguf_norm_topk=True),
    Family("qwen2_moe", ("qwen2_moe",), "qwen2moe"),
    Family("mixtral", ("mixtral",), "llama", gguf_norm_topk=True),
    Family("olmoe", ("olmoe",), "olmoe"),
    Family("glm4_moe", ("glm4_moe",), "glm4moe"),
    Family("gpt_oss", ("gpt_oss",), "gpt-oss", gguf_norm_topk=True),
    Family("deepseek_v3", ("deepseek_v3", "kimi_k2"), "deepseek2"),
    Family("deepseek_v2", ("deepseek_v2",), "deepseek2", reads_gguf=False),
    Family("qwen3_next", ("qwen3_next",), "qwen3next", hybrid=True, gguf_norm_topk=True),
    Family("qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"), "qwen35moe", hybrid=True, gguf_norm_topk=True),
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
