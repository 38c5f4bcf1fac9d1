"""One module per CUDA source: checks shapes and dtypes, picks launch geometry, launches (or runs the Numba
kernel on the cpu device)."""

from freetoken.ops.attention import attention_decode
from freetoken.ops.histogram import histogram
from freetoken.ops.reduce import row_sum
from freetoken.ops.topk import topk
from freetoken.ops.transpose import transpose

__all__ = ["attention_decode", "histogram", "row_sum", "topk", "transpose"]
