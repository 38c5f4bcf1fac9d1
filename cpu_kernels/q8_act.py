"""8-bit activations for the int8 row dots (:mod:`freetoken.cpu_kernels.moe_int8`).

Each token row of ``x`` (float32, in the weight format's K order) is cut into 32-value blocks; a block's scale is
``d = max|x| / 127`` and its values ``q = rint(x / d)`` (float32 arithmetic, no fast-math: the NumPy twin
:func:`freetoken.testing.reference.moe_experts.quantize_q8_reference` gives the same bytes). Rows are padded to an
even number of blocks with zero blocks. A block that holds NaN or an infinity gets ``d = NaN`` and ``q = 0``, so
the NaN reaches every dot product that reads it, as in the float path.

Per token the kernels also read ``nc``: for each group of 4 activation bytes, ``-OFFSET * (their sum)``, the int32
value the dot product's accumulator starts from so that the unsigned (offset) weight bytes give exact signed dots;
and ``cs``, the same summed per half block, for the panel micro-kernel (:mod:`freetoken.cpu_kernels.moe_int8_tile`),
whose int32 lanes are weight rows: it adds one such scalar per (sub-)block and token. The halves are the 16-value
sub-blocks in the format's K order: with ``split`` (the e2m1 formats' block-split order) the 4-byte groups 0, 1, 4, 5
and 2, 3, 6, 7 (nvfp4's sub-blocks), otherwise 0-3 and 4-7 (q6_k's); formats with one scale per block add both. The
k-quants with a min (q4_k, q5_k) quantize with offset -1, which makes ``nc`` and ``cs`` plain sums.
"""

from __future__ import annotations

import numba as nb
import numpy as np

_F32 = np.float32


def padded_blocks(k: int) -> int:
    """Blocks per token row: ``k / 32`` rounded up to even."""
    nblk = k // 32
    return nblk + (nblk & 1)


@nb.njit(error_model="numpy", boundscheck=False, nogil=True)
def quantize_row(x, t, offset, split, qa, nc, dx, cs):
    """Row ``t`` of ``x`` float32 [T, K] -> row t of ``qa`` int8 [.., kp], ``nc`` int32 [.., kp / 4], ``dx`` float32
    [.., kp / 32], ``cs`` int32 [.., kp / 16] (half-block sums; ``split``: the block-split halves). Not inlined on
    purpose: compiled without fast-math (the kernels calling it use it), so ``d`` and ``q`` are the reference's
    bytes."""
    k = x.shape[1]
    nblk = k // 32
    for b in range(dx.shape[1]):
        if b >= nblk:
            for j in range(32):
                qa[t, b * 32 + j] = 0
            for j in range(8):
                nc[t, b * 8 + j] = 0
            cs[t, 2 * b] = 0
            cs[t, 2 * b + 1] = 0
            dx[t, b] = _F32(0.0)
            continue
        amax = _F32(0.0)
        finite = True
        for j in range(32):
            a = abs(x[t, b * 32 + j])
            if not a <= _F32(3.4028234663852886e38):  # NaN or inf
                finite = False
            amax = max(amax, a)
        d = amax / _F32(127.0)
        inv = _F32(1.0) / d if d > _F32(0.0) else _F32(0.0)
        if not finite:
            d, inv = _F32(np.nan), _F32(0.0)
        dx[t, b] = d
        for i in range(8):
            s = np.int32(0)
            for j in range(4):
                v = np.rint(x[t, b * 32 + 4 * i + j] * inv) if finite else _F32(0.0)
                q = np.int32(min(max(v, _F32(-127.0)), _F32(127.0)))
                qa[t, b * 32 + 4 * i + j] = q
                s += q
            nc[t, b * 8 + i] = -offset * s
        for sub in range(2):
            if split:  # chunks 0, 1, 4, 5 and 2, 3, 6, 7: nvfp4's two sub-blocks in block-split order
                cs[t, 2 * b + sub] = (nc[t, b * 8 + 2 * sub] + nc[t, b * 8 + 2 * sub + 1]
                                      + nc[t, b * 8 + 2 * sub + 4] + nc[t, b * 8 + 2 * sub + 5])
            else:  # chunks 0-3 and 4-7: values 0-15 and 16-31
                cs[t, 2 * b + sub] = (nc[t, b * 8 + 4 * sub] + nc[t, b * 8 + 4 * sub + 1]
                                      + nc[t, b * 8 + 4 * sub + 2] + nc[t, b * 8 + 4 * sub + 3])


@nb.njit(error_model="numpy", cache=True, boundscheck=False, nogil=True)
def quantize_rows(x, offset, split, qa, nc, dx, cs):
    """Every row of ``x`` float32 [T, K] -> ``qa`` int8 [T, kp], ``nc`` int32 [T, kp / 4], ``dx`` float32
    [T, kp / 32], ``cs`` int32 [T, kp / 16] (the kernels quantize inside their parallel regions with
    :func:`quantize_row`)."""
    for t in range(x.shape[0]):
        quantize_row(x, t, offset, split, qa, nc, dx, cs)


def q8_buffers(rows: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Uninitialised (qa, nc, dx, cs) for ``rows`` token rows of ``k`` values."""
    kp = 32 * padded_blocks(k)
    return (np.empty((rows, kp), np.int8), np.empty((rows, kp // 4), np.int32), np.empty((rows, kp // 32), np.float32),
            np.empty((rows, kp // 16), np.int32))


#: The kernels' q8 buffers when the float path runs.
NO_Q8 = q8_buffers(0, 32)
