"""The format table (freetoken/formats/table.py) is the one source of every per-format table: the Numba and CUDA
kernel codes agree, every kernel family has its CUDA specialization, the GGUF block sizes are the gguf package's,
the FTW codes never move, and the tables derived elsewhere hold exactly the table's rows."""

import re
from pathlib import Path

import pytest
from freetoken.cpu_kernels import moe_kquant, moe_rows, qgemv
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from freetoken import formats
from freetoken.device.constants import CUDA_DEFINES, FORMAT_CODES
from freetoken.formats.table import BY_NAME, DENSE_BLOCKS, FTW_CODES, ROWS
from freetoken.loaders import ftw_file, gguf_file
from freetoken.models.weights import GGUFWeights
from freetoken.ops.dense import GGUF_BLOCKS, STORAGE_DTYPES
from freetoken.ops.moe_experts import KERNEL_FAMILY

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_row_names_its_format_module(row):
    assert formats.get(row.name).name == row.name
    assert row.kernel in FORMAT_CODES


def test_numba_and_cuda_codes_agree():
    header = (ROOT / "cuda" / "moe_common.cuh").read_text()
    for row in ROWS:
        define = f"FT_FMT_{row.kernel.upper()}"
        assert moe_rows.FORMAT_CODES[row.name] == int(CUDA_DEFINES[define]) == row.code, row.name
        assert re.search(rf"struct Fmt<{define}>", header), f"no CUDA specialization for {row.kernel}"
        assert re.search(rf"FT_MOE_KERNELS\(MODE, {row.kernel}, {define}\)", header), row.kernel
    assert len(set(FORMAT_CODES.values())) == len(FORMAT_CODES)
    # the Numba kernels' named codes are the table's
    named = {"bf16": moe_rows.FMT_BF16, "fp8_block": moe_rows.FMT_FP8_BLOCK, "nvfp4": moe_rows.FMT_NVFP4,
             "mxfp4": moe_rows.FMT_MXFP4, "q4_0": moe_rows.FMT_Q4_0, **moe_kquant.KQUANT_CODES}
    assert named == {k: FORMAT_CODES[k] for k in named}
    # every k-quant code >= FMT_Q8_0 is one of moe_kquant's formats (moe_rows dispatches on that)
    assert {c for c in FORMAT_CODES.values() if c >= moe_kquant.FMT_Q8_0} == set(moe_kquant.KQUANT_CODES.values())


def test_gguf_blocks_are_ggml_sizes():
    for row in ROWS:
        if row.ggml is None:
            assert row.block_weights == row.block_bytes == 0 and not row.dense, row.name
            continue
        assert GGML_QUANT_SIZES[GGMLQuantizationType[row.ggml]] == (row.block_weights, row.block_bytes), row.name
    for code, (weights, head, quants) in moe_kquant.GEOMETRY.items():
        row = next(r for r in ROWS if r.code == code)
        assert (weights, head + quants) == (row.block_weights, row.block_bytes), row.name


def test_ftw_codes_never_move():
    assert FTW_CODES == {"bf16": 1, "fp8_block": 2, "nvfp4": 3, "mxfp4": 4, "ds_fp4": 5, "q4_0": 6, "q8_0": 7,
                         "q4_k": 8, "q5_k": 9, "q6_k": 10, "iq4_xs": 11}
    assert ftw_file.FORMAT_CODES == FTW_CODES and set(ftw_file.FORMAT_NAMES) == set(FTW_CODES.values())


def test_derived_tables_hold_the_rows():
    assert formats.NAMES == tuple(BY_NAME)
    assert set(formats.GGUF_NAMES) == {r.name for r in ROWS if r.ggml}
    assert KERNEL_FAMILY == {r.name: r.kernel for r in ROWS}
    assert GGUF_BLOCKS == DENSE_BLOCKS and set(DENSE_BLOCKS) <= set(STORAGE_DTYPES)
    assert {t.name: f for t, f in gguf_file.EXPERT_FORMATS.items()} == {r.ggml: r.name for r in ROWS if r.ggml}
    assert GGUFWeights.QUANTIZED == {r.ggml: r.name for r in ROWS if r.dense}
    assert qgemv.KQUANT_BLOCK_BYTES == {"q4_k": 144, "q5_k": 176, "q6_k": 210, "iq4_xs": 136}
