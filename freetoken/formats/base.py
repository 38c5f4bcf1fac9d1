"""Expert weight formats: the bank layout every kernel (CUDA decode/prefill, Numba) reads.

A weight matrix has N rows (output features) and K columns (input features). A format stores the matrices of
E experts as a few *banks*: NumPy arrays whose leading dimension is the expert (or, on the device, the slot).
Row ``n`` of expert ``e`` is always contiguous in every bank, so an expert record can be copied and read in
place. K must be a multiple of the format's ``k_multiple``: 32 (each kernel lane decodes 32 consecutive K elements,
with 16-byte loads), 256 for the k-quants (their super-blocks); N is free.

Bank layouts (per expert; ``w`` values, ``s`` block scales, ``g`` per-matrix global):

=========  ===========================================  ========================================================
format     banks                                        decode of element (n, k)
=========  ===========================================  ========================================================
bf16       w u16 [N, K]  (bf16 bits)                    bf16(w[n, k])
fp8_block  w u8 [N, K]   (e4m3fn bits)                  e4m3(w[n, k]) * s[n // 128, k // 128]
           s f32 [ceil(N/128), ceil(K/128)]             (a multiply, despite DeepSeek's name ``weight_scale_inv``)
nvfp4      w u8 [N, K/2] (e2m1 pairs, low nibble even)  e2m1(nib(n, k)) * e4m3(s[n, k // 16]) * g
           s u8 [N, K/16] (e4m3fn bits), g f32 []
mxfp4      w u8 [N, K/2] (e2m1 pairs, low nibble even)  e2m1(nib(n, k)) * 2^(s[n, k // 32] - 127)
           s u8 [N, K/32] (e8m0 bits)
ds_fp4     identical to mxfp4 (DeepSeek-V4's FP4 experts are OCP MXFP4 in row-major packing)
q4_0       w u8 [N, K/2]: the 16 ``qs`` bytes of each    (q - 8) * f16(s[n, k // 32]) where q is the low nibble
           GGUF block, blocks in order                  of byte 16b + j for k = 32b + j (j < 16) and the high
           s u16 [N, K/32] (fp16 bits of ``d``)          nibble of byte 16b + j - 16 for j >= 16
q8_0       w u8 [N, K] (the int8 ``qs`` of each block)  int8(w[n, k]) * f16(s[n, k // 32])
           s u16 [N, K/32] (fp16 bits of ``d``)
q4_k       w u8 [N, K/256 * 128] (``qs``)               GGUF Q4_K: d * sc_j * q - dmin * m_j for sub-block j of
           s u8 [N, K/256 * 16] (d, dmin, scales[12])   32 (6-bit scales and mins packed in ``scales``)
q5_k       w u8 [N, K/256 * 160] (``qh[32]``, ``qs``)    GGUF Q5_K: as q4_k with a fifth bit from ``qh``
           s u8 [N, K/256 * 16] (d, dmin, scales[12])
q6_k       w u8 [N, K/256 * 192] (``ql[128]``, ``qh``)   GGUF Q6_K: d * scales[j] * (q - 32), 16 sub-blocks of
           s u8 [N, K/256 * 18] (``scales[16]``, d)      16 (int8 scales)
iq4_xs     w u8 [N, K/256 * 128] (``qs``)               GGUF IQ4_XS: d * (ls_j - 32) * kvalues_iq4nl[q], 8
           s u8 [N, K/256 * 8] (d, scales_h, scales_l)  sub-blocks of 32 (6-bit scales)
=========  ===========================================  ========================================================

``nib(n, k)`` is ``w[n, k // 2] & 15`` for even k and ``w[n, k // 2] >> 4`` for odd k. The e2m1 table is
``0, .5, 1, 1.5, 2, 3, 4, 6`` with bit 3 the sign; e8m0 255 is NaN (OCP; ggml decodes it as 2^128 but its
quantizer never writes it) and e8m0 0 is the float32 subnormal 2^-127, so no decode path may flush subnormals.
The nvfp4 decode is ``(e2m1 * e4m3) * g``: the inner product is exact, and kernels may (and do) factor the
per-matrix ``g`` out of their dot products. The ``g`` bank is [E]: checkpoint converters reshape [E, 1].
q4_0 is kept as GGUF stores it but with its 2-byte ``d`` split into its own bank, so the quants are 16-byte
aligned (lossless, no dequantization). The other GGUF block formats (q8_0 and the k-quants, super-blocks of 256)
are split the same way: each GGUF block is its header (``s``: the scale bytes, in file order) and its quants (``w``,
in file order), so ``to_gguf(from_gguf(raw)) == raw`` byte for byte and every ``w`` row is 16-byte aligned.

An expert *record* (:class:`RecordLayout`) holds three matrices, each in its format's banks: ``gate`` [I, H],
``up`` [I, H] in ``fmt``, ``down`` [H, I] in ``down_fmt`` (default ``fmt``; GGUF Q4_K_M files keep ``down`` in Q6_K
while gate/up are Q4_K), plus optional float32 biases ``gate.b`` [I], ``up.b`` [I], ``down.b`` [H]
(gpt-oss). Gate and up are separate matrices with their own scales and globals (checkpoints give them different
ones; folding them together would underflow). Bank names in a record are ``"<matrix>.<bank>"``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

#: Byte alignment of every bank row group in host pools and device slots (16-byte vector loads).
ALIGNMENT = 16
MATRICES = ("gate", "up", "down")


@dataclass(frozen=True)
class BankSpec:
    """One bank of one matrix, per expert: ``dtype`` and ``shape`` exclude the leading expert dimension."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class ExpertFormat(ABC):
    """A weight format: reference codec (NumPy) and bank schema. Instances are stateless singletons."""

    name: str
    #: Bits per weight including scales (for bandwidth arithmetic), at large N and K.
    bits_per_weight: float
    #: K must be a multiple of this.
    k_multiple: int = 32

    @abstractmethod
    def bank_specs(self, n: int, k: int) -> list[BankSpec]:
        """The banks of one [n, k] matrix."""

    @abstractmethod
    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """float32 [E, N, K] -> banks (each with leading dimension E)."""

    @abstractmethod
    def dequantize(self, banks: dict[str, np.ndarray]) -> np.ndarray:
        """Banks -> float32 [E, N, K] (exact decode of the stored values)."""

    def check_shape(self, n: int, k: int, what: str = "matrix") -> None:
        if k % self.k_multiple:
            raise ValueError(f"{what}: {self.name} needs K (input features) divisible by {self.k_multiple}, got {k}")
        if n < 1 or k < 1:
            raise ValueError(f"{what}: empty matrix [{n}, {k}]")

    def check_banks(self, banks: dict[str, np.ndarray], n: int, k: int, what: str = "matrix") -> int:
        """Verify names, dtypes and shapes of ``banks`` for [E, n, k] matrices; returns E."""
        self.check_shape(n, k, what)
        specs = self.bank_specs(n, k)
        missing = [s.name for s in specs if s.name not in banks]
        if missing:
            raise ValueError(f"{what}: {self.name} banks missing {missing} (have {sorted(banks)})")
        e = None
        for s in specs:
            a = banks[s.name]
            if a.dtype != np.dtype(s.dtype) or tuple(a.shape[1:]) != s.shape:
                want = f"{np.dtype(s.dtype)} [E, {', '.join(map(str, s.shape))}]"
                raise ValueError(f"{what}.{s.name}: {self.name} wants {want}, got {a.dtype} {list(a.shape)}")
            if e is None:
                e = a.shape[0]
            elif a.shape[0] != e:
                raise ValueError(f"{what}.{s.name}: {a.shape[0]} experts, other banks have {e}")
        return int(e)

    def __repr__(self) -> str:
        return f"<expert format {self.name}>"


@dataclass(frozen=True)
class RecordLayout:
    """The banks of one expert record: gate [I, H], up [I, H], down [H, I] in ``fmt``, optional biases, and the
    activation the records are run with (``act``: "swiglu", or gpt-oss' clamped "gpt_oss"; see
    ``freetoken.device.constants.ACTIVATIONS``): what a runner needs to compute any record of the layout."""

    fmt: ExpertFormat
    hidden: int
    inter: int
    bias: bool = False
    act: str = "swiglu"
    #: The down matrix's format when it differs from gate/up's (None: ``fmt``).
    down_fmt: ExpertFormat | None = None

    def __post_init__(self):
        from freetoken.device.constants import ACTIVATIONS

        if self.act not in ACTIVATIONS:
            raise ValueError(f"unknown expert activation {self.act!r}; choose one of {', '.join(ACTIVATIONS)}")
        if self.down_fmt is not None and self.down_fmt.name == self.fmt.name:
            object.__setattr__(self, "down_fmt", None)  # one spelling of a uniform record: layouts compare equal
        self.fmt.check_shape(self.inter, self.hidden, "gate/up")
        self.format_of("down").check_shape(self.hidden, self.inter, "down")

    def format_of(self, matrix: str) -> ExpertFormat:
        """The format of ``matrix`` ("gate", "up" or "down")."""
        return self.down_fmt if matrix == "down" and self.down_fmt is not None else self.fmt

    @property
    def name(self) -> str:
        """The record's formats: "q4_k", or "q4_k+q6_k" when down differs from gate/up."""
        return self.fmt.name if self.down_fmt is None else f"{self.fmt.name}+{self.down_fmt.name}"

    def matrix_shape(self, matrix: str) -> tuple[int, int]:
        return (self.hidden, self.inter) if matrix == "down" else (self.inter, self.hidden)

    def bank_specs(self) -> list[BankSpec]:
        """Every bank of the record, named ``"<matrix>.<bank>"``, in a fixed order."""
        out = []
        for m in MATRICES:
            n, k = self.matrix_shape(m)
            out += [BankSpec(f"{m}.{s.name}", s.dtype, s.shape) for s in self.format_of(m).bank_specs(n, k)]
        if self.bias:
            out += [BankSpec(f"{m}.b", np.dtype(np.float32), (self.matrix_shape(m)[0],)) for m in MATRICES]
        return out

    @property
    def record_bytes(self) -> int:
        """Bytes of one expert's record, each bank padded to :data:`ALIGNMENT`."""
        return sum(-(-s.nbytes // ALIGNMENT) * ALIGNMENT for s in self.bank_specs())

    def quantize(self, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                 biases: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """float32 gate/up [E, I, H], down [E, H, I] (+ biases {"gate": [E, I], ...}) -> record banks."""
        out = {}
        for m, w in zip(MATRICES, (gate, up, down), strict=True):
            if tuple(w.shape[1:]) != self.matrix_shape(m):
                raise ValueError(f"{m}: expected [E, {', '.join(map(str, self.matrix_shape(m)))}], got {list(w.shape)}")
            out.update({f"{m}.{k}": v for k, v in self.format_of(m).quantize(np.asarray(w, np.float32)).items()})
        if self.bias:
            if biases is None:
                raise ValueError("this record layout has biases; pass biases={'gate':..., 'up':..., 'down':...}")
            out.update({f"{m}.b": np.ascontiguousarray(biases[m], dtype=np.float32) for m in MATRICES})
        return out

    def split(self, banks: dict[str, np.ndarray], matrix: str) -> dict[str, np.ndarray]:
        """The banks of one matrix with the ``"<matrix>."`` prefix removed (bias excluded)."""
        prefix = matrix + "."
        return {k[len(prefix):]: v for k, v in banks.items() if k.startswith(prefix) and k != prefix + "b"}

    def check(self, banks: dict[str, np.ndarray]) -> int:
        """Verify a record bank dict; returns the number of experts (or slots)."""
        e = None
        for m in MATRICES:
            n, k = self.matrix_shape(m)
            em = self.format_of(m).check_banks(self.split(banks, m), n, k, m)
            if e is not None and em != e:
                raise ValueError(f"{m}: {em} experts, other matrices have {e}")
            e = em
        if self.bias:
            for m in MATRICES:
                b = banks.get(f"{m}.b")
                want = (e, self.matrix_shape(m)[0])
                if b is None or b.dtype != np.float32 or tuple(b.shape) != want:
                    raise ValueError(f"{m}.b: wants float32 {list(want)}, got "
                                     f"{None if b is None else (b.dtype, list(b.shape))}")
        return int(e)

    def dequantize(self, banks: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Record banks -> float32 {"gate": [E, I, H], "up": ..., "down": [E, H, I]} (+ "<m>.b" biases)."""
        out = {m: self.format_of(m).dequantize(self.split(banks, m)) for m in MATRICES}
        if self.bias:
            out.update({f"{m}.b": banks[f"{m}.b"] for m in MATRICES})
        return out
