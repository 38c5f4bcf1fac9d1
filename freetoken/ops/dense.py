"""Dense decode GEMV with the weights in their checkpoint storage (``cuda/dense.cu``, ``cpu_kernels/gemv.py``).

``y[T, N] = x[T, K] @ W[N, K].T (+ bias)`` for a few tokens (decode: bound by reading the weights, each read once
per call). ``W`` is held as bf16 (uint16 bits: the high halves of the float32 values), float16 or float32 and
widened in registers; or as GGUF blocks, the file's bytes verbatim (uint8 [N, K / block weights * block bytes]:
:data:`GGUF_BLOCKS`; Q8_0 / Q4_0 blocks of 32 weights, Q4_K / Q5_K / Q6_K / IQ4_XS super-blocks of 256, see
:mod:`freetoken.models.qmatrix` and ``cuda/kquant.cuh``), decoded per 32 weights in registers; or as block-FP8
rows ("fp8_block": uint8 [N, K + 4 * ceil(K/128)], each row its ceil(K/128) little-endian float32 scales, then its
K e4m3fn codes; weight ``j`` is ``e4m3(code j) * scale[j // 128]``), the non-expert matrices of DeepSeek-V3-style
checkpoints kept at 1.03 bytes per weight. Accumulation is float32.

:func:`dense` is the op :class:`freetoken.models.linear.Linear` calls, for any T and on every device (the per-device
dispatch lives there); :func:`dense_gemv` is the decode kernel (T <= :data:`MAX_TOKENS`).
"""

from __future__ import annotations

import numpy as np

from freetoken.device.constants import DENSE_MAX_TOKENS, DENSE_WARPS
from freetoken.formats.table import DENSE_BLOCKS
from freetoken.ops._common import as_input, check_int32, cpu_module, cuda_kernel, into_out, prepare_out, resolve

#: The most tokens one call takes (FT_DENSE_MAX_T in dense.cu).
MAX_TOKENS = DENSE_MAX_TOKENS
_WARPS_PER_BLOCK = DENSE_WARPS  # FT_DENSE_WARPS in dense.cu: one warp per output row
#: The GGUF block storages: (weights, bytes) per block (a row of K weights is K / weights blocks).
GGUF_BLOCKS = DENSE_BLOCKS
#: The weight dtype of each storage.
STORAGE_DTYPES = {"bf16": np.dtype(np.uint16), "f16": np.dtype(np.float16), "f32": np.dtype(np.float32),
                  **{g: np.dtype(np.uint8) for g in GGUF_BLOCKS}, "fp8_block": np.dtype(np.uint8)}
#: The block-FP8 storage: weights per scale along a row, and the multiple of K its kernels take (16-byte chunks).
FP8_BLOCK, FP8_K_MULTIPLE = 128, 16
#: The storages held as uint8 rows of blocks (decoded in registers; :func:`dense_dequant` widens them).
BLOCK_STORAGES = (*GGUF_BLOCKS, "fp8_block")
_STORAGE_NAMES = f"bf16, f16, f32, {', '.join(GGUF_BLOCKS)} or fp8_block"
#: gpu/emu, more tokens than the GEMV kernel takes: weights widened to float32 per chunk of the product (a chunk is
#: at least one row). Bounds the temporary float32 copy (32 MiB).
CHUNK_ELEMENTS = 1 << 23


def k_multiple(storage: str) -> int:
    """The multiple of K a block storage's rows take (1 for the float storages)."""
    if storage in GGUF_BLOCKS:
        return GGUF_BLOCKS[storage][0]
    return FP8_K_MULTIPLE if storage == "fp8_block" else 1


def _row_shape(storage: str) -> str:
    if storage == "fp8_block":
        return "K + 4 * ceil(K/128)"
    weights, nbytes = GGUF_BLOCKS[storage]
    return f"K/{weights} * {nbytes}"


def row_bytes(storage: str, k: int) -> int:
    """Bytes of one stored row of K weights in a block storage (K a multiple of :func:`k_multiple`)."""
    if storage == "fp8_block":
        return k + 4 * (-(-k // FP8_BLOCK))
    weights, nbytes = GGUF_BLOCKS[storage]
    return k // weights * nbytes


def _checked(dev, x, w, storage: str, bias):
    """Inputs as device arrays, checked: (x [T, K], w, bias or None, N, K)."""
    if storage not in STORAGE_DTYPES:
        raise ValueError(f"unknown storage {storage!r}; choose {_STORAGE_NAMES}")
    x = as_input(dev, x, "x", np.float32, 2)
    want = STORAGE_DTYPES[storage]
    w = dev.as_array(w, copy_host=True)
    if w.dtype != want:
        what = "uint16 (bf16 bits)" if storage == "bf16" else str(want)
        raise TypeError(f"w must be {what} for storage {storage!r}, got {w.dtype}")
    w = as_input(dev, w, "w", want, 2)
    k = x.shape[1]
    n, wk = w.shape
    if storage in BLOCK_STORAGES:
        mult = k_multiple(storage)
        if k % mult or wk != row_bytes(storage, k):
            raise ValueError(f"{storage} w has {wk} bytes per row but x has {k} columns (w must be "
                             f"[N, {_row_shape(storage)}] for x [T, K], K a multiple of {mult})")
    elif wk != k:
        raise ValueError(f"w has {wk} columns but x has {k} (w must be [N, K] for x [T, K])")
    b = None
    if bias is not None:
        b = as_input(dev, bias, "bias", np.float32, 1)
        if b.shape[0] != n:
            raise ValueError(f"bias must have {n} elements (one per row of w), got shape {tuple(b.shape)}")
    return x, w, b, n, k


def _cpu_product(x, w, storage: str, b, y) -> None:
    """The cpu device's product: the Numba GEMV (few tokens) or register-tiled kernel, then the bias."""
    if x.shape[0]:
        if storage in BLOCK_STORAGES:
            cpu_module("qgemv").qmatmul_into(x, w, storage, y)
        else:
            gemv = cpu_module("gemv")
            gemv.matmul_into(x, gemv.storage_view(w), y)
    if b is not None:
        y += b


def dense_gemv(x, w, storage: str, bias=None, out=None, device=None):
    """``x @ widen(w).T (+ bias)`` for T <= 8 tokens; every weight read once per call.

    Parameters
    ----------
    x : float32 array [T, K], 1 <= T <= 8 (T = 0 returns the empty output)
    w : array [N, K]: uint16 bf16 bits (storage "bf16"), float16 ("f16") or float32 ("f32"); or uint8 GGUF blocks
        [N, K/32 * 34] ("q8_0") / [N, K/32 * 18] ("q4_0"), K a multiple of 32, or [N, K/256 * 144] ("q4_k"),
        [N, K/256 * 176] ("q5_k"), [N, K/256 * 210] ("q6_k"), [N, K/256 * 136] ("iq4_xs"), K a multiple of 256; or
        uint8 block-FP8 rows [N, K + 4 * ceil(K/128)] ("fp8_block"), K a multiple of 16
    storage : "bf16", "f16", "f32", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "iq4_xs" or "fp8_block"
    bias : float32 array [N], optional (added after the dot product)
    out : float32 array [T, N], optional
    device : Device or name, optional (default: auto)

    Returns
    -------
    float32 array [T, N] on the device (``out`` when given).
    """
    dev = resolve(device)
    x, w, b, n, k = _checked(dev, x, w, storage, bias)
    t = x.shape[0]
    if t > MAX_TOKENS:
        raise ValueError(f"T={t} tokens exceed dense_gemv's {MAX_TOKENS} (decode); larger batches take a chunked "
                         "matrix product (freetoken.ops.dense)")
    y = prepare_out(dev, out, (t, n), np.float32)
    if t == 0 or n == 0:
        return y
    if dev.kind == "cpu":
        _cpu_product(x, w, storage, b, y)
        return y
    _launch_gemv(dev, x, w, storage, b, y)
    return y


def _launch_gemv(dev, x, w, storage, b, y) -> None:
    t, k = x.shape
    n = w.shape[0]
    fn = cuda_kernel(dev, "dense.cu", f"dense_gemv_{storage}")
    grid = -(-n // _WARPS_PER_BLOCK)
    fn((grid,), (32 * _WARPS_PER_BLOCK,),
       (w, x, x if b is None else b, np.int32(b is not None), y, np.int32(t), check_int32("N", n),
        check_int32("K", k)))


def dense(x, w, storage: str, bias=None, *, out=None, device=None, checked: bool = False):
    """``x @ widen(w).T (+ bias)`` for any number of tokens: the dense projection op.

    Same arguments as :func:`dense_gemv`, with T unbounded. Dispatch: the cpu device runs the Numba kernels
    (:mod:`freetoken.cpu_kernels.gemv`: a GEMV up to a few tokens, a register-tiled product beyond;
    :mod:`freetoken.cpu_kernels.qgemv` for GGUF blocks and FP8 rows); gpu/emu run :func:`dense_gemv` up to
    :data:`MAX_TOKENS` tokens and a chunked product on the device's array module beyond (cuBLAS on gpu, NumPy on
    emu): row chunks of at most :data:`CHUNK_ELEMENTS` weights widened to float32 into one reused buffer (block
    storages decoded by :func:`dense_dequant`) and multiplied; float32 matrices are multiplied whole.

    ``checked``: the caller vouches for the arguments (``device`` a Device, ``x`` float32 [T, K] C-contiguous, ``w``
    and ``bias`` on the device in ``storage`` for K columns, ``out`` None): a decode step's small projections then
    cost their kernel and little else.

    Returns
    -------
    float32 array [T, N] on the device (``out`` when given).
    """
    if checked and out is None and device.kind == "cpu":
        y = np.empty((x.shape[0], w.shape[0]), np.float32)
        _cpu_product(x, w, storage, bias, y)
        return y
    dev = resolve(device)
    x, w, b, n, k = _checked(dev, x, w, storage, bias)
    t = x.shape[0]
    if dev.kind == "cpu":
        y = prepare_out(dev, out, (t, n), np.float32)
        _cpu_product(x, w, storage, b, y)
        return y
    if t <= MAX_TOKENS:
        y = prepare_out(dev, out, (t, n), np.float32)
        if t and n:
            _launch_gemv(dev, x, w, storage, b, y)
        return y
    xp = dev.xp
    if storage == "f32":
        y = x @ w.T
    else:
        y = xp.empty((t, n), np.float32)
        rows = max(1, CHUNK_ELEMENTS // max(1, k))
        buf = xp.empty((min(rows, n), k), np.float32)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            wc = _widen_into(dev, w[r0:r1], storage, k, buf[:r1 - r0])
            y[:, r0:r1] = x @ wc.T
    if b is not None:
        y += b
    return into_out(dev, out, y)


def widen(w, storage: str, k: int, device=None):
    """The float32 matrix [N, K] of stored weights ``w`` on the device (a new array unless storage "f32")."""
    dev = resolve(device)
    if dev.kind == "cpu":
        if storage in BLOCK_STORAGES:
            dequantize_rows = cpu_module("qgemv").dequantize_rows

            return dequantize_rows(w, storage, k)
        widen_cpu = cpu_module("gemv").widen

        return widen_cpu(w)
    if storage == "f32":
        return w
    return _widen_into(dev, w, storage, k, dev.xp.empty((w.shape[0], k), np.float32))


def _widen_into(dev, w16, storage: str, k: int, out):
    """Stored 16-bit (or quantized block) rows ``w16`` as float32 in ``out`` (same rows, C-contiguous) on gpu/emu."""
    xp = dev.xp
    if storage in BLOCK_STORAGES:
        return dense_dequant(w16, storage, k, out=out, device=dev)
    if storage == "f16":
        xp.copyto(out, w16)
        return out
    bits = out.view(np.uint32)  # bf16: the stored high halves of the float32 values
    xp.copyto(bits, w16)
    xp.left_shift(bits, np.uint32(16), out=bits)
    return out


def dense_dequant(w, storage: str, k: int, out=None, device=None):
    """Block rows ``w`` (uint8 [N, row_bytes(storage, K)], a storage of :data:`BLOCK_STORAGES`) -> float32 [N, K]:
    GGUF blocks exactly (as ``gguf.quants.dequantize``), FP8 rows as ``e4m3 * scale`` rounded once to float32.

    ``out``: float32 [N, K] C-contiguous, optional (the chunked product passes a reused buffer)."""
    dev = resolve(device)
    if storage not in BLOCK_STORAGES:
        raise ValueError(f"unknown quantized storage {storage!r}; choose {', '.join(BLOCK_STORAGES)}")
    w = as_input(dev, w, "w", np.uint8, 2)
    n, wk = w.shape
    if k % k_multiple(storage) or wk != row_bytes(storage, k):
        raise ValueError(f"{storage} w has {wk} bytes per row, not {_row_shape(storage)} for K={k} (K a multiple "
                         f"of {k_multiple(storage)})")
    y = prepare_out(dev, out, (n, k), np.float32)
    if n == 0 or k == 0:
        return y
    if dev.kind == "cpu":
        dequantize_rows = cpu_module("qgemv").dequantize_rows

        return dequantize_rows(w, storage, k, out=y)
    threads = n * k // (FP8_K_MULTIPLE if storage == "fp8_block" else 32)  # per 16 FP8 codes / 32 GGUF weights
    fn = cuda_kernel(dev, "dense.cu", f"dense_dequant_{storage}")
    fn((-(-threads // 256),), (256,), (w, y, check_int32("N", n), check_int32("K", k)))
    return y


def dense_grouped(x, w, storage: str, *, out=None, device=None):
    """Per-group products ``y[t, g] = x[t, g] @ widen(w[g*N:(g+1)*N]).T``: G matrices [N, K] stacked in ``w``, each
    applied to its own slice of x, in one call (latent attention's absorbed ``kv_b_proj``: one matrix per head).

    Parameters
    ----------
    x : float32 array [T, G, K]
    w : uint8 block-FP8 rows [G*N, K + 4 * ceil(K/128)] (storage "fp8_block"; K a multiple of 16)
    storage : "fp8_block" (the one storage with a grouped kernel; float matrices go through the array module's
        batched matmul)
    out : float32 array [T, G, N], optional
    device : Device or name, optional (default: auto)

    Dispatch: cpu, :func:`freetoken.cpu_kernels.fp8_dense.fp8_grouped_into`; gpu/emu, ``dense_grouped_fp8_block``
    (one warp per row, every group in one launch) up to :data:`MAX_TOKENS` tokens, beyond that each chunk of
    groups widened by :func:`dense_dequant` and multiplied as a batched matmul.

    Returns
    -------
    float32 array [T, G, N] on the device (``out`` when given).
    """
    dev = resolve(device)
    if storage != "fp8_block":
        raise ValueError(f"dense_grouped takes fp8_block rows, not {storage!r}")
    x = as_input(dev, x, "x", np.float32, 3)
    t, groups, k = x.shape
    w = as_input(dev, w, "w", np.uint8, 2)
    rows, wk = w.shape
    if k % FP8_K_MULTIPLE or wk != row_bytes(storage, k):
        raise ValueError(f"fp8_block w has {wk} bytes per row but x has K={k} (w must be [G*N, "
                         f"{_row_shape(storage)}], K a multiple of {FP8_K_MULTIPLE})")
    if groups == 0 or rows % groups:
        raise ValueError(f"w's {rows} rows are not {groups} groups of equal size (x has G={groups})")
    n = rows // groups
    y = prepare_out(dev, out, (t, groups, n), np.float32)
    if t == 0 or n == 0:
        return y
    if dev.kind == "cpu":
        fp8_grouped_into = cpu_module("fp8_dense").fp8_grouped_into

        fp8_grouped_into(x, w, y)
        return y
    if t <= MAX_TOKENS:
        fn = cuda_kernel(dev, "dense.cu", "dense_grouped_fp8_block")
        fn((-(-rows // _WARPS_PER_BLOCK),), (32 * _WARPS_PER_BLOCK,),
           (w, x, y, np.int32(t), check_int32("N", rows), check_int32("K", k), np.int32(n)))
        return y
    xp = dev.xp
    per = max(1, CHUNK_ELEMENTS // max(1, n * k))  # groups per chunk: bounds the widened copy
    buf = xp.empty((min(per, groups) * n, k), np.float32)
    for g0 in range(0, groups, per):
        g1 = min(groups, g0 + per)
        wc = dense_dequant(w[g0 * n:g1 * n], storage, k, out=buf[:(g1 - g0) * n], device=dev)
        y[:, g0:g1] = xp.matmul(x[:, g0:g1].transpose(1, 0, 2), wc.reshape(g1 - g0, n, k).transpose(0, 2, 1)
                                ).transpose(1, 0, 2)
    return y
