"""Parity cases of ``ops.dense_gemv`` and ``ops.dense`` (``cuda/dense.cu``), and the test matrices they use."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from freetoken import ops
from freetoken.ops.dense import GGUF_BLOCKS, k_multiple
from freetoken.testing.cases.base import KernelCase, poisoned
from freetoken.testing.reference.dense import blocks_dequantized, dense_grouped_reference, dense_reference

# ---- dense.cu ---------------------------------------------------------------------------------------------
# (N, K, bias) per shape: "sq" a square projection with a bias (qkv-like), "lm" an lm_head. The small shapes have
# odd N; small "sq" K takes the vector path of every storage, small "lm" K (not a multiple of 4) the scalar path.
_DENSE_SHAPES = {"small": {"sq": (37, 104, True), "lm": (301, 66, False)},
                 "large": {"sq": (4096, 4096, True), "lm": (151936, 2048, False)}}


def dense_weights(storage: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(stored weights, their exact float32 values): Gaussian [N, K] rounded to ``storage`` (bf16 as uint16 bits)."""
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32)
    if storage == "bf16":
        bits = (w.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
        return bits, (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if storage == "f16":
        h = w.astype(np.float16)
        return h, h.astype(np.float32)
    return w, w


@lru_cache(maxsize=2)
def _dense_matrix(storage: str, n: int, k: int):
    return dense_weights(storage, n, k, seed=("bf16", "f16", "f32").index(storage))


def _make_dense(storage: str, shape: str, t: int, op: str = "dense_gemv"):
    """dense_gemv (or the dense op: any T) over one storage: bf16/f16/f32 matrices, or GGUF blocks and block-FP8
    rows (their own shapes: K a multiple of 256 for the super-block storages)."""
    quantized = storage in QUANT_KINDS
    shapes, matrix = (_QDENSE_SHAPES, _qdense_matrix) if quantized else (_DENSE_SHAPES, _dense_matrix)
    if k_multiple(storage) == QK_K:
        shapes = _KQDENSE_SHAPES

    def make(rng, size):
        n, k, with_bias = shapes[size][shape]
        w, w32 = matrix(storage, n, k)
        return {"w": w, "w32": w32, "storage": storage, "x": rng.standard_normal((t, k), dtype=np.float32),
                "bias": rng.standard_normal(n, dtype=np.float32) if with_bias else None}

    def setup(dev, inp):
        return {"w": dev.asarray(inp["w"]), "x": dev.asarray(inp["x"]), "storage": inp["storage"],
                "bias": None if inp["bias"] is None else dev.asarray(inp["bias"]),
                "out_y": poisoned(dev, (t, inp["w"].shape[0]), np.float32)}

    fn = ops.dense_gemv if op == "dense_gemv" else ops.dense

    def launch(dev, st):
        fn(st["x"], st["w"], st["storage"], bias=st["bias"], out=st["out_y"], device=dev)

    return KernelCase(f"{op}_{storage}_{shape}_t{t}", "dense.cu", make, setup, launch,
                      lambda inp: {"y": dense_reference(inp["x"], inp["w32"], inp["bias"])}, rel_atol=1e-5,
                      bytes_moved=lambda inp: inp["w"].nbytes, flops=lambda inp: 2 * inp["x"].size * inp["w"].shape[0],
                      op=op)



# GGUF Q8_0 / Q4_0 weights (dense_gemv_q8_0 / dense_gemv_q4_0): K a multiple of 32; small N odd. Block-FP8 rows
# (dense_gemv_fp8_block) take the same shapes: small "lm" K (96) is one partial 128-block, "sq" K (128) one whole
# block (the 4-byte word path on a GPU), the large K (a multiple of 512) the 16-byte path. The GGUF super-block
# storages (Q4_K, Q5_K, Q6_K, IQ4_XS: K a multiple of 256) take their own small shapes: "lm" one super-block per row
# (8 chunks: lanes 8..31 idle), "sq" two (a warp's 1024-weight step only partly filled), N odd.
_QDENSE_SHAPES = {"small": {"sq": (37, 128, True), "lm": (301, 96, False)},
                  "large": {"sq": (4096, 4096, True), "lm": (151936, 2048, False)}}
_KQDENSE_SHAPES = {"small": {"sq": (37, 512, True), "lm": (301, 256, False)}, "large": _QDENSE_SHAPES["large"]}
QUANT_KINDS = ("q8_0", "q4_0", "fp8_block", "q4_k", "q5_k", "q6_k", "iq4_xs")
#: Weights per GGUF super-block.
QK_K = 256
#: Byte offsets of the float16 fields of each GGUF block (d; Q4_K / Q5_K's dmin), which random blocks keep finite.
_F16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_xs": (0,)}


def quantized_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random block rows of an [N, K] matrix in storage ``kind``. GGUF (uint8 [N, row_bytes(kind, K)]): every byte
    random but the float16 fields (d, dmin), of magnitude 0.005 .. 0.02 with random signs. ``fp8_block`` (uint8
    [N, K + 4 * ceil(K/128)]): every e4m3 code random but the two NaN codes, float32 scales of magnitude 0.002 .. 0.01
    with random signs."""
    rng = np.random.default_rng(seed)
    if kind == "fp8_block":
        nkb = -(-k // 128)
        codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] ^= np.uint8(1)  # 0x7F / 0xFF (NaN) -> 0x7E / 0xFE (+-448)
        s = (rng.uniform(0.002, 0.01, (n, nkb)) * rng.choice(np.array([-1.0, 1.0]), (n, nkb))).astype("<f4")
        return np.concatenate([s.view(np.uint8), codes], axis=1)
    weights, bb = GGUF_BLOCKS[kind]
    nb = k // weights
    blocks = rng.integers(0, 256, (n, nb, bb), dtype=np.uint8)
    for off in _F16_FIELDS[kind]:
        d = rng.uniform(0.005, 0.02, (n, nb)) * rng.choice(np.array([-1.0, 1.0]), (n, nb))
        blocks[..., off:off + 2] = d.astype("<f2")[..., None].view(np.uint8)
    return blocks.reshape(n, nb * bb)


@lru_cache(maxsize=2)
def _qdense_matrix(kind: str, n: int, k: int):
    w = quantized_blocks(kind, n, k, seed=QUANT_KINDS.index(kind))
    return w, blocks_dequantized(w, kind, k)


DENSE_CASES = [_make_dense(s, shape, t) for s in ("bf16", "f16", "f32") for shape in ("sq", "lm") for t in (1, 4)]
QDENSE_CASES = [_make_dense(q, shape, t) for q in QUANT_KINDS for shape in ("sq", "lm") for t in (1, 4)]
#: The dense op beyond the GEMV's 8 tokens (gpu/emu: the chunked product; cpu: the register-tiled kernel).
DENSE_OP_CASES = [_make_dense(s, "sq", 13, op="dense") for s in ("bf16", "f16", "f32", *QUANT_KINDS)]
# ---- dense_grouped (dense_grouped_fp8_block) ------------------------------------------------------------------
# (G, N, K) per size: G groups (heads) of N rows over K values each. Small: K 160 (a partial 128-block: the word
# path on a GPU), N odd; large: DeepSeek-V3's absorbed kv_b_proj halves (W_UK^T: 128 heads of [512, 128]).
_GROUPED_SHAPES = {"small": {"k160": (3, 37, 160), "k512": (2, 24, 512)}, "large": {"k160": (128, 512, 128),
                                                                                    "k512": (128, 128, 512)}}


def _make_grouped(shape: str, t: int):
    def make(rng, size):
        g, n, k = _GROUPED_SHAPES[size][shape]
        w, w32 = _qdense_matrix("fp8_block", g * n, k)
        return {"w": w, "w32": w32, "x": rng.standard_normal((t, g, k), dtype=np.float32)}

    def setup(dev, inp):
        g, n = inp["x"].shape[1], inp["w"].shape[0] // inp["x"].shape[1]
        return {"w": dev.asarray(inp["w"]), "x": dev.asarray(inp["x"]),
                "out_y": poisoned(dev, (t, g, n), np.float32)}

    def launch(dev, st):
        ops.dense_grouped(st["x"], st["w"], "fp8_block", out=st["out_y"], device=dev)

    return KernelCase(f"dense_grouped_fp8_block_{shape}_t{t}", "dense.cu", make, setup, launch,
                      lambda inp: {"y": dense_grouped_reference(inp["x"], inp["w32"])}, rel_atol=1e-5,
                      bytes_moved=lambda inp: inp["w"].nbytes,
                      flops=lambda inp: 2 * inp["x"].shape[0] * inp["w32"].size, op="dense_grouped")


GROUPED_CASES = [_make_grouped(shape, t) for shape in ("k160", "k512") for t in (1, 4, 13)]
CASES = DENSE_CASES + QDENSE_CASES + DENSE_OP_CASES + GROUPED_CASES
