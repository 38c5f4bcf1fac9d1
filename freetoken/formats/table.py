"""One row per expert weight format: every per-format table of the package is derived from :data:`ROWS`.

A row names the kernel family that reads the format (its code is the kernels' format code, defined once with the
constants shared with CUDA: :data:`freetoken.device.constants.FORMAT_CODES`, the ``FT_FMT_*`` defines and the Numba
kernels' ``FMT_*``), its stable code in FTW record headers, the GGUF tensor type stored as it is (and that block's
weights and bytes), and whether a dense projection may be kept in it. Adding a format is a row here, its module
(``freetoken/formats/<name>.py``) and its kernels; ``tests/test_format_table.py`` checks the derived tables, the CUDA
specializations and the GGUF block sizes against the ``gguf`` package's.
"""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.device.constants import FORMAT_CODES


@dataclass(frozen=True)
class FormatRow:
    name: str
    #: the kernel family that reads it (a key of ``FORMAT_CODES``; ds_fp4 is OCP MXFP4 with row-major packing)
    kernel: str
    #: its code in FTW record headers (never renumbered; a new format takes a new code)
    ftw_code: int
    #: the GGUF tensor type kept as the file stores it (a ``gguf.GGMLQuantizationType`` name), None: none
    ggml: str | None = None
    #: weights and bytes of one GGUF block (0: not a GGUF block format)
    block_weights: int = 0
    block_bytes: int = 0
    #: a dense projection (attention, shared expert, head) may be kept in this storage (``ops.dense``)
    dense: bool = False

    @property
    def code(self) -> int:
        """The kernels' format code (Numba and CUDA)."""
        return FORMAT_CODES[self.kernel]


ROWS = (
    FormatRow("bf16", "bf16", 1),
    FormatRow("fp8_block", "fp8_block", 2),
    FormatRow("nvfp4", "nvfp4", 3),
    FormatRow("mxfp4", "mxfp4", 4, "MXFP4", 32, 17),
    FormatRow("ds_fp4", "mxfp4", 5),
    FormatRow("q4_0", "q4_0", 6, "Q4_0", 32, 18, dense=True),
    FormatRow("q8_0", "q8_0", 7, "Q8_0", 32, 34, dense=True),
    FormatRow("q4_k", "q4_k", 8, "Q4_K", 256, 144, dense=True),
    FormatRow("q5_k", "q5_k", 9, "Q5_K", 256, 176, dense=True),
    FormatRow("q6_k", "q6_k", 10, "Q6_K", 256, 210, dense=True),
    FormatRow("iq4_xs", "iq4_xs", 11, "IQ4_XS", 256, 136, dense=True),
)
BY_NAME = {r.name: r for r in ROWS}

#: The expert formats by name.
NAMES = tuple(BY_NAME)
#: The GGUF block formats kept as the file stores them (lossless byte moves: ``from_gguf`` / ``to_gguf``).
GGUF_NAMES = tuple(r.name for r in ROWS if r.ggml is not None)
#: The kernel family of each format.
KERNEL_FAMILY = {r.name: r.kernel for r in ROWS}
#: The kernels' code of each format (Numba's ``fmt`` argument, CUDA's ``FT_FMT_*``).
KERNEL_CODES = {r.name: r.code for r in ROWS}
#: Stable FTW record-header codes.
FTW_CODES = {r.name: r.ftw_code for r in ROWS}
#: ggml type name -> the format its expert tensors are kept in.
GGML_EXPERT_FORMATS = {r.ggml: r.name for r in ROWS if r.ggml is not None}
#: The GGUF block storages of dense projections: (weights, bytes) per block.
DENSE_BLOCKS = {r.name: (r.block_weights, r.block_bytes) for r in ROWS if r.dense}
