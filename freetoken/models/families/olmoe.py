"""OLMoE: q/k RMSNorms over the whole projection (not per head), softmax top-k routing."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.models.families.base import Family, HFConfig


@dataclass(frozen=True, eq=False)
class Olmoe(Family):
    def hf_qk_norm(self, c: HFConfig) -> str:
        return "full"


FAMILY = Olmoe("olmoe", ("olmoe",), "olmoe", gguf_qk_norm="full")
