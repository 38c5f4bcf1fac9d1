"""One module per CUDA source: checks shapes and dtypes, picks launch geometry, launches (or runs the Numba
kernel on the cpu device)."""

from freetoken.ops.attention import attention_decode
from freetoken.ops.histogram import histogram
from freetoken.ops.reduce import row_sum
from freetoken.ops.topk import topk
from freetoken.ops.transpose import transpose

__all__ = ["attention_decode", "histogram", "row_sum", "topk", "transpose"]

# INTERIM: see freetoken/ops/_interim.py
from freetoken.ops._interim import attention, rms_norm, rope, route_softmax_topk  # noqa: E402
from freetoken.ops.moe_experts import MoeWorkspace, moe_experts  # noqa: E402

__all__ += ["MoeWorkspace", "attention", "moe_experts", "rms_norm", "rope", "route_softmax_topk"]
