"""The decoder's dense projections (attention, router, shared expert, dense MLP, lm_head): ``y = x @ W.T (+ b)``.

Every device holds each matrix once, in the narrowest storage that is exact (:func:`exact_storage`): bf16 when every
weight round-trips through bf16 (bf16 checkpoints), else float16 when every weight round-trips through float16 (f16
GGUF tensors), else float32. The weights are never rounded: results differ from the float32 matrix product only by
float32 summation order. 16-bit storage halves the device memory and the bytes a decode step reads.

The product runs in :func:`freetoken.ops.dense` (which owns the per-device dispatch: the Numba kernels of
:mod:`freetoken.cpu_kernels.gemv` on the cpu device, where NumPy's BLAS runs on one thread next to them; the GEMV
kernel of ``cuda/dense.cu`` for a few tokens on gpu/emu and a chunked product beyond); :class:`Linear` keeps only the
matrix bookkeeping: the storage choice, concatenation and splitting.

GGUF Q8_0 / Q4_0 matrices (:class:`freetoken.models.qmatrix.QuantizedMatrix`) stay in their file blocks (storage
"q8_0" / "q4_0": 34 / 18 bytes per 32 weights instead of 128 as float32): the kernels decode each block in registers
(cpu: :mod:`freetoken.cpu_kernels.qgemv`; gpu/emu: ``dense_gemv_q8_0`` / ``dense_gemv_q4_0``), and the chunked
product decodes its row chunks to float32 (exact: every quantized weight is a float32 value).

Matrices applied to the same input (q/k/v; a shared expert's gate/up/sigmoid) can be concatenated into one Linear
(:meth:`Linear.concat`): one call, and every output element is the same dot product as with the separate matrices.
Quantized matrices of one kind are stacked as block rows; a concatenation that mixes storages (a quantized shared
expert with its float32 sigmoid gate, say) keeps one Linear per run of equally stored matrices and concatenates
their outputs (storage e.g. "q8_0+bf16"), so nothing is dequantized.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from freetoken import ops
from freetoken.models.qmatrix import QuantizedMatrix
from freetoken.models.qmatrix import stack as _stack_quantized
from freetoken.ops.dense import widen

#: Elements per chunk of the load-time exactness checks (bounds their temporary memory).
_CHECK_ELEMENTS = 1 << 22


def exact_storage(w: np.ndarray) -> str:
    """The narrowest storage that holds every value of the float32 matrix ``w`` exactly: "bf16", "f16" or "f32"
    (bit-exact round trip: signed zeros, infinities and subnormals included; NaN payloads may fail f16)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    flat = w.reshape(-1)
    bits = flat.view(np.uint32)
    step = _CHECK_ELEMENTS
    if not any((bits[i:i + step] & np.uint32(0xFFFF)).any() for i in range(0, flat.size, step)):
        return "bf16"
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(0, flat.size, step):
            chunk = flat[i:i + step]
            if not np.array_equal(chunk.astype(np.float16).astype(np.float32).view(np.uint32), bits[i:i + step]):
                return "f32"
    return "f16"


def to_storage(w: np.ndarray, storage: str) -> np.ndarray:
    """``w`` (float32) in ``storage``: bf16 as uint16 bits (the high halves: exact when :func:`exact_storage` says
    bf16), float16, or float32 (as is)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if storage == "bf16":
        return (w.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    if storage == "f16":
        return w.astype(np.float16)
    if storage == "f32":
        return w
    raise ValueError(f"unknown storage {storage!r}; choose bf16, f16 or f32")


class Linear:
    """``y = x @ W.T (+ b)`` for float32 activations ``x [T, K]`` on one device.

    ``weight`` float32 [N, K] on the host or a :class:`QuantizedMatrix` (kept in its blocks), ``bias`` float32 [N]
    or None. ``storage`` is how the matrix is held on the device and read by the kernels ("bf16", "f16" or "f32",
    see :func:`exact_storage`; "q8_0" / "q4_0" for a quantized matrix).
    """

    _parts: tuple[Linear, ...] | None = None  # a concatenation of differently stored matrices (see concat)

    def __init__(self, weight: np.ndarray | QuantizedMatrix, device, bias: np.ndarray | None = None):
        if isinstance(weight, QuantizedMatrix):
            self._init_quantized(weight, device, bias)
            return
        self._kind = None
        w = np.ascontiguousarray(weight, dtype=np.float32)
        if w.ndim != 2:
            raise ValueError(f"weight must be a matrix [N, K], got shape {list(w.shape)}")
        self.dev, self.xp = device, device.xp
        self.out_features, self.in_features = w.shape
        self.sizes: tuple[int, ...] = (self.out_features,)
        self.storage = exact_storage(w)
        # float32 on cpu: ``w`` itself when NumPy gave it huge pages (a tied lm_head: the embedding), else a copy
        self._w = device.weights(to_storage(w, self.storage))
        self._set_bias(bias)

    def _init_quantized(self, q: QuantizedMatrix, device, bias) -> None:
        self.dev, self.xp = device, device.xp
        self.out_features, self.in_features = q.shape
        self.sizes = (self.out_features,)
        self.storage = self._kind = q.kind
        self._w = device.weights(np.ascontiguousarray(q.blocks))
        self._set_bias(bias)

    def _set_bias(self, bias) -> None:
        self.bias = None
        if bias is not None:
            b = np.ascontiguousarray(bias, dtype=np.float32).reshape(-1)
            if b.shape != (self.out_features,):
                raise ValueError(f"bias must have {self.out_features} elements, got shape {list(bias.shape)}")
            self.bias = self.dev.asarray(b)

    @classmethod
    def concat(cls, weights: Sequence[np.ndarray | QuantizedMatrix], device,
               biases: Sequence[np.ndarray] | None = None) -> Linear:
        """One Linear of the matrices ``weights`` (same K) stacked along N; :meth:`split` cuts its output back.
        ``biases``: one per matrix, or None.

        Float matrices are concatenated (and stored as :func:`exact_storage` says for the whole); quantized ones of
        one kind are stacked as block rows. Mixed storages (quantized kinds, or quantized and float): one Linear
        per run of consecutive matrices of the same storage class, their outputs concatenated per call (no
        matrix is dequantized; each output element is the dot product its own matrix's Linear computes)."""
        ws = [w if isinstance(w, QuantizedMatrix) else np.asarray(w, dtype=np.float32) for w in weights]
        bs = None if biases is None else [np.asarray(b, np.float32).reshape(-1) for b in biases]
        sizes = tuple(w.shape[0] for w in ws)
        runs: list[list[int]] = []
        for i, w in enumerate(ws):
            key = w.kind if isinstance(w, QuantizedMatrix) else None
            prev = ws[runs[-1][0]] if runs else None
            if runs and (prev.kind if isinstance(prev, QuantizedMatrix) else None) == key:
                runs[-1].append(i)
            else:
                runs.append([i])
        if len(runs) == 1:
            lin = cls._one(ws, device, None if bs is None else np.concatenate(bs))
        else:
            parts = tuple(cls._one([ws[i] for i in r], device,
                                   None if bs is None else np.concatenate([bs[i] for i in r])) for r in runs)
            lin = cls.__new__(cls)
            lin.dev, lin.xp, lin._kind = device, device.xp, None
            lin.in_features, lin.out_features = parts[0].in_features, sum(p.out_features for p in parts)
            if any(p.in_features != lin.in_features for p in parts):
                raise ValueError("concatenated matrices must have the same number of columns")
            lin._parts, lin.bias, lin._w = parts, None, None
            lin.storage = "+".join(p.storage for p in parts)
        lin.sizes = sizes
        return lin

    @classmethod
    def _one(cls, ws, device, bias) -> Linear:
        if isinstance(ws[0], QuantizedMatrix):
            return cls(_stack_quantized(ws), device, bias)
        return cls(np.concatenate(ws, axis=0) if len(ws) > 1 else ws[0], device, bias)

    def split(self, y) -> tuple:
        """The output ``y [T, N]`` of a concatenated Linear cut into its matrices' outputs (views)."""
        out, start = [], 0
        for n in self.sizes:
            out.append(y[:, start:start + n])
            start += n
        return tuple(out)

    def __call__(self, x):
        """``x [T, K]`` float32 -> ``y [T, N]`` float32 (a new array)."""
        if self._parts is not None:
            return self.xp.concatenate([p(x) for p in self._parts], axis=1)
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = self.xp.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must be [T, {self.in_features}], got shape {list(x.shape)}")
        # the matrix and bias were checked when the Linear was made, x just now
        return ops.dense(x, self._w, self.storage, bias=self.bias, device=self.dev, checked=True)

    @property
    def weight(self):
        """The float32 matrix [N, K] on the device (a widened copy when stored in 16 bits or quantized)."""
        if self._parts is not None:
            return self.xp.concatenate([p.weight for p in self._parts], axis=0)
        return widen(self._w, self.storage, self.in_features, device=self.dev)

    @property
    def parts(self) -> tuple[Linear, ...]:
        """The single-storage matrices this Linear runs: itself, or the runs of a mixed concatenation."""
        return (self,) if self._parts is None else self._parts

    @property
    def matrix_nbytes(self) -> int:
        """Bytes of the stored matrix alone (of a single-storage Linear; :attr:`nbytes` adds the bias)."""
        if self._parts is not None:
            raise ValueError("a mixed concatenation has one matrix per part (Linear.parts)")
        return int(self._w.nbytes)

    def holds(self, a) -> bool:
        """Whether the matrix is stored in host array ``a``'s memory (a tied float32 lm_head on the cpu device: the
        embedding table itself, not a copy)."""
        return (self._parts is None and isinstance(a, np.ndarray) and isinstance(self._w, np.ndarray)
                and np.may_share_memory(self._w, a))

    @property
    def nbytes(self) -> int:
        """Bytes held on the device (matrix and bias; a quantized matrix: its file blocks)."""
        if self._parts is not None:
            return sum(p.nbytes for p in self._parts)
        return int(self._w.nbytes) + (int(self.bias.nbytes) if self.bias is not None else 0)
