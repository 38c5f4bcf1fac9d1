"""Block-quantized matrices kept in their file encoding for :class:`freetoken.models.linear.Linear`: GGUF Q8_0 / Q4_0
and the k-quants Q4_K / Q5_K / Q6_K / IQ4_XS (super-blocks of 256 weights, decoded as :mod:`freetoken.formats`'
``q4_k`` ... ``iq4_xs`` define them), and block-FP8 (the non-expert matrices of DeepSeek-V3 / Kimi-K2 / GLM-4.5-FP8 /
Qwen3-FP8 checkpoints).

GGUF: a row of K weights is K/32 blocks, each a little-endian float16 scale ``d`` followed by the quants:

- ``q8_0`` (34 bytes): 32 int8 ``q``; weight ``j`` is ``d * q[j]``.
- ``q4_0`` (18 bytes): 16 bytes of nibbles; weight ``j < 16`` is the low nibble of byte ``j``, weight ``j + 16`` its
  high nibble; the value is ``d * (nibble - 8)`` (gguf-py's / llama.cpp's order, as :mod:`freetoken.formats.q4_0`).

Every GGUF value is exact in float32 (an 11-bit significand times an integer of at most 8 bits), so
:meth:`dequantize` equals ``gguf.quants.dequantize`` bit for bit.

``fp8_block``: a row is its ceil(K/128) little-endian float32 scales, then its K e4m3fn codes; weight ``j`` is
``e4m3(code j) * scale[j // 128]`` (rounded once to float32, as :mod:`freetoken.formats.fp8_block` decodes). An HF
checkpoint has one scale per 128 x 128 tile (``weight_scale_inv``); :func:`from_hf_fp8` copies a tile's scales into
each of its 128 rows (4 bytes per 128 weights, 3%), so that every row carries its own scales, as GGUF rows do.

Whole rows are independent: stacking or permuting rows of the block array is exact (fused q/k/v, llama.cpp's Q/K row
permutation, DeepSeek's rope row order).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freetoken.ops.dense import FP8_BLOCK, GGUF_BLOCKS, k_multiple, row_bytes

#: Weights per GGUF block of Q8_0 / Q4_0.
BLOCK = 32
#: Bytes per GGUF block of each kind (Q8_0 / Q4_0: a 2-byte scale + the quants, 32 weights; the k-quants: 256).
BLOCK_BYTES = {kind: nbytes for kind, (_, nbytes) in GGUF_BLOCKS.items()}
KINDS = (*BLOCK_BYTES, "fp8_block")


@dataclass(frozen=True)
class QuantizedMatrix:
    """A matrix [N, K] as block rows: ``blocks`` uint8 [N, row_bytes(kind, K)] (C-contiguous on the host): GGUF
    blocks (``kind`` one of :data:`BLOCK_BYTES`, [N, K / block weights * BLOCK_BYTES[kind]]) or FP8 rows ("fp8_block",
    [N, K + 4 * ceil(K/128)])."""

    kind: str
    blocks: np.ndarray
    shape: tuple[int, int]

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown quantized kind {self.kind!r}; choose {', '.join(KINDS)}")
        n, k = (int(d) for d in self.shape)
        if k % k_multiple(self.kind):
            raise ValueError(f"{self.kind} rows must be whole blocks of {k_multiple(self.kind)}, got K={k}")
        b = self.blocks
        want = (n, row_bytes(self.kind, k))
        if b.dtype != np.uint8 or b.shape != want:
            raise ValueError(f"{self.kind} blocks of a [{n}, {k}] matrix must be uint8 {list(want)}, got "
                             f"{b.dtype} {list(b.shape)}")
        object.__setattr__(self, "shape", (n, k))

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    def rows(self, index) -> QuantizedMatrix:
        """The rows ``index`` (an index array or a slice) as a new matrix (block rows copied)."""
        b = np.ascontiguousarray(self.blocks[index])
        return QuantizedMatrix(self.kind, b, (b.shape[0], self.shape[1]))

    def dequantize(self) -> np.ndarray:
        """float32 [N, K] (bit-identical to ``gguf.quants.dequantize``)."""
        return dequantize_blocks(self.blocks, self.kind, self.shape[1])


def _fp8_split(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``fp8_block`` rows [N, K + 4 * ceil(K/128)] -> (their scales float32 [N, ceil(K/128)], their codes uint8
    [N, K], a view)."""
    nkb = -(-k // FP8_BLOCK)
    rows = np.ascontiguousarray(rows)
    return rows[:, :4 * nkb].copy().view("<f4").astype(np.float32), rows[:, 4 * nkb:]


def dequantize_blocks(blocks: np.ndarray, kind: str, k: int) -> np.ndarray:
    """uint8 block rows [N, row_bytes(kind, K)] of ``kind`` -> float32 [N, K]."""
    n = blocks.shape[0]
    if kind == "fp8_block":
        from freetoken.formats.fp8_block import E4M3_VALUES

        scales, codes = _fp8_split(blocks, k)
        with np.errstate(over="ignore", invalid="ignore"):
            return E4M3_VALUES[codes] * np.repeat(scales, FP8_BLOCK, axis=1)[:, :k]
    if kind not in ("q8_0", "q4_0"):  # the k-quants: their expert format's codec (bank split = a byte move)
        from freetoken import formats

        fmt = formats.get(kind)
        rows = np.ascontiguousarray(blocks).reshape(1, n, -1)
        return fmt.dequantize(fmt.from_gguf(rows, (1, n, k)))[0]
    blk = np.ascontiguousarray(blocks).reshape(n, k // BLOCK, BLOCK_BYTES[kind])
    d = np.ascontiguousarray(blk[..., :2]).view("<f2")[..., 0].astype(np.float32)[..., None]  # [N, K/32, 1]
    qs = blk[..., 2:]
    if kind == "q8_0":
        q = qs.view(np.int8).astype(np.float32)
    else:
        q = np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1).astype(np.float32) - np.float32(8)
    with np.errstate(over="ignore", invalid="ignore"):
        return (d * q).reshape(n, k)


def stack(mats: list[QuantizedMatrix]) -> QuantizedMatrix:
    """Matrices of one kind and one K stacked along N (block rows concatenated)."""
    kind, k = mats[0].kind, mats[0].shape[1]
    if any(m.kind != kind or m.shape[1] != k for m in mats):
        raise ValueError("stacking needs one kind and one K")
    b = np.concatenate([m.blocks for m in mats], axis=0) if len(mats) > 1 else np.ascontiguousarray(mats[0].blocks)
    return QuantizedMatrix(kind, b, (b.shape[0], k))


def from_hf_fp8(weight: np.ndarray, scale_inv: np.ndarray) -> QuantizedMatrix:
    """An HF block-FP8 matrix (``weight`` [N, K] e4m3fn codes as uint8, ``scale_inv`` float32 [ceil(N/128),
    ceil(K/128)]) as an ``fp8_block`` matrix: each row its tile row's scales, then its codes (no value changes)."""
    w = np.ascontiguousarray(weight).view(np.uint8)
    n, k = w.shape
    nkb = -(-k // FP8_BLOCK)
    s = np.ascontiguousarray(scale_inv, dtype="<f4")
    if s.shape != (-(-n // FP8_BLOCK), nkb):
        raise ValueError(f"scale_inv of a [{n}, {k}] matrix must be [{-(-n // FP8_BLOCK)}, {nkb}], got "
                         f"{list(s.shape)}")
    rows = np.empty((n, row_bytes("fp8_block", k)), np.uint8)
    rows[:, :4 * nkb] = np.repeat(s, FP8_BLOCK, axis=0)[:n].view(np.uint8)
    rows[:, 4 * nkb:] = w
    return QuantizedMatrix("fp8_block", rows, (n, k))


def fp8_transposed(q: QuantizedMatrix, row0: int, rows: int) -> QuantizedMatrix | None:
    """Rows ``row0 .. row0 + rows`` of an ``fp8_block`` matrix [N, K], transposed, as an ``fp8_block`` matrix
    [K, rows] with the same codes and scales (no value changes), or None when that is not exact: a new row's
    128-block of old rows must share one scale, as an HF 128 x 128 tile's rows do when ``row0`` and the block starts
    are on tile boundaries (DeepSeek's ``kv_b_proj``: each head's rows start at a multiple of 128)."""
    if q.kind != "fp8_block":
        raise ValueError(f"fp8_transposed takes fp8_block matrices, got {q.kind}")
    if rows % 16:
        return None  # the new rows' K must be a multiple of 16 (the fp8 row kernels' chunk)
    k = q.shape[1]
    scales, codes = _fp8_split(q.blocks[row0:row0 + rows], k)  # [rows, nkb]: old row i's scale of its column block
    nb = -(-rows // FP8_BLOCK)
    first = scales[::FP8_BLOCK]  # [nb, nkb]: each new 128-block's scale, if uniform
    if not np.array_equal(np.repeat(first, FP8_BLOCK, axis=0)[:rows].view(np.uint32), scales.view(np.uint32)):
        return None
    new_scales = np.repeat(first.T, FP8_BLOCK, axis=0)[:k]  # [K, nb]: new row j = old column j, block b
    out = np.empty((k, row_bytes("fp8_block", rows)), np.uint8)
    out[:, :4 * nb] = np.ascontiguousarray(new_scales, dtype="<f4").view(np.uint8)
    out[:, 4 * nb:] = codes.T
    return QuantizedMatrix("fp8_block", out, (k, rows))
