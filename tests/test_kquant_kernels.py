"""The GGUF block decoders of cuda/kquant.cuh (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_XS) through the dense storages,
on every device, beyond the registry cases (``freetoken.testing.cases``: dense and expert parity): bit-exact decoding
against gguf-py at every load width, every token count, special scales, the chunked product, misuse errors. The expert
kernels' use of the same decoders (and records whose down matrix has its own format) are registry cases."""

from importlib import import_module

import numpy as np
import pytest
from test_kernel_parity import check_dense, gemv_every_token_count

from freetoken import formats, ops
from freetoken.ops.dense import GGUF_BLOCKS, MAX_TOKENS, dense_dequant, dense_gemv, k_multiple, row_bytes
from freetoken.testing.cases.dense import quantized_blocks
from freetoken.testing.reference.dense import blocks_dequantized

KQUANTS = ("q4_k", "q5_k", "q6_k", "iq4_xs")
#: Byte offset of each storage's float16 ``d`` in its block.
D_OFFSET = {"q8_0": 0, "q4_0": 0, "q4_k": 0, "q5_k": 0, "q6_k": 208, "iq4_xs": 0}


def _offset_view(device, w, offset):
    """``w`` on the device at ``offset`` bytes past an allocation's (aligned) start."""
    flat = device.asarray(np.concatenate([np.zeros(offset, np.uint8), w.reshape(-1)]))
    return flat[offset:].reshape(w.shape)


@pytest.mark.parametrize("storage", list(GGUF_BLOCKS))
def test_dequant_is_bit_exact_at_every_alignment(device, storage):
    """dense_dequant equals gguf-py bit for bit (every quant byte random: every chunk, nibble, bit and table entry of
    every block), whatever W's base alignment: 16-byte / 8-byte / 16-bit loads where the blocks allow, bytes where an
    offset view breaks that."""
    n, k = 9, 3 * 256
    w = quantized_blocks(storage, n, k, seed=7)
    want = blocks_dequantized(w, storage, k).view(np.uint32)
    for offset in (0, 1, 2, 8):
        got = device.to_host(dense_dequant(_offset_view(device, w, offset), storage, k, device=device))
        np.testing.assert_array_equal(got.view(np.uint32), want, err_msg=f"{storage} at offset {offset}")


@pytest.mark.parametrize("storage", KQUANTS)
def test_gemv_every_token_count(device, storage):
    """T = 1..8 (each a code path of the kernel), with and without bias, into poisoned outputs; K of 1, 3 and 5
    super-blocks (a warp's 1024-weight step partly filled, once and twice)."""
    rng = np.random.default_rng(11)
    for n, k in ((5, 256), (13, 768), (3, 1280)):
        w = quantized_blocks(storage, n, k, seed=n + k)
        gemv_every_token_count(device, w, blocks_dequantized(w, storage, k), storage, rng)


@pytest.mark.parametrize("storage", KQUANTS)
def test_gemv_offset_views_and_special_scales(device, storage):
    """A base that is not 16-byte aligned (offset views: narrower loads) gives the same products; an inf / NaN d
    makes its row non-finite / NaN and leaves the others finite."""
    rng = np.random.default_rng(5)
    n, k = 5, 512
    w = quantized_blocks(storage, n, k, seed=3)
    w32 = blocks_dequantized(w, storage, k)
    x = rng.standard_normal((3, k), dtype=np.float32)
    for offset in (1, 2, 8):
        got = dense_gemv(device.asarray(x), _offset_view(device, w, offset), storage, device=device)
        check_dense(device.to_host(got), x, w32)
    ws = w.copy()
    d = D_OFFSET[storage] + GGUF_BLOCKS[storage][1]  # the second block's d
    ws[1, d:d + 2] = np.array([np.inf], "<f2").view(np.uint8)
    ws[2, d:d + 2] = np.array([np.nan], "<f2").view(np.uint8)
    got = device.to_host(dense_gemv(device.asarray(np.ones((2, k), np.float32)), device.asarray(ws), storage,
                                    device=device))
    assert np.isnan(got[:, 2]).all() and not np.isfinite(got[:, 1]).any() and np.isfinite(got[:, [0, 3, 4]]).all()


@pytest.mark.parametrize("storage", KQUANTS)
def test_chunked_product_covers_every_row(device, storage, monkeypatch):
    """ops.dense beyond 8 tokens: every row exactly once whatever the chunk size (gpu/emu: rows widened by
    dense_dequant into a reused buffer)."""
    dense_module = import_module("freetoken.ops.dense")  # freetoken.ops.dense is the op function
    n, k = 7, 512
    w = quantized_blocks(storage, n, k, seed=10)
    w32 = blocks_dequantized(w, storage, k)
    x = np.random.default_rng(9).standard_normal((MAX_TOKENS + 3, k), dtype=np.float32)
    for chunk in (1, k * 3, 1 << 23):
        monkeypatch.setattr(dense_module, "CHUNK_ELEMENTS", chunk)
        check_dense(device.to_host(ops.dense(device.asarray(x), device.asarray(w), storage, device=device)), x, w32)


def test_storage_tables():
    """The row geometry of the GGUF storages matches the expert formats' (same blocks, header and quants split)."""
    for storage, (weights, nbytes) in GGUF_BLOCKS.items():
        fmt = formats.get(storage)
        assert k_multiple(storage) == weights == fmt.k_multiple
        specs = fmt.bank_specs(1, 4 * weights)
        assert row_bytes(storage, 4 * weights) == 4 * nbytes == sum(s.nbytes for s in specs)


def test_misuse_errors(device):
    x = device.asarray(np.ones((2, 512), np.float32))
    with pytest.raises(ValueError, match=r"q4_k w has 288 bytes per row but x has 320 columns \(w must be "
                                         r"\[N, K/256 \* 144\] for x \[T, K\], K a multiple of 256\)"):
        dense_gemv(device.asarray(np.ones((2, 320), np.float32)), device.asarray(np.zeros((3, 288), np.uint8)),
                   "q4_k", device=device)
    with pytest.raises(ValueError, match=r"q6_k w has 421 bytes per row but x has 512 columns"):
        ops.dense(x, device.asarray(np.zeros((3, 421), np.uint8)), "q6_k", device=device)
    with pytest.raises(ValueError, match=r"iq4_xs w has 136 bytes per row, not K/256 \* 136 for K=512"):
        dense_dequant(device.asarray(np.zeros((3, 136), np.uint8)), "iq4_xs", 512, device=device)
    with pytest.raises(TypeError, match="w must be uint8 for storage 'q5_k'"):
        dense_gemv(x, device.asarray(np.zeros((3, 176), np.uint16)), "q5_k", device=device)
    with pytest.raises(ValueError, match="unknown storage 'q3_k'; choose bf16, .* iq4_xs or fp8_block"):
        dense_gemv(x, device.asarray(np.zeros((3, 176), np.uint8)), "q3_k", device=device)
