"""The decoder's dense projections (attention, router, shared expert, dense MLP, lm_head): ``y = x @ W.T (+ b)``.

Every device holds each matrix once, in the narrowest storage that is exact (:func:`exact_storage`): bf16 when every
weight round-trips through bf16 (bf16 checkpoints), else float16 when every weight round-trips through float16 (f16
GGUF tensors), else float32. The weights are never rounded: results differ from the float32 matrix product only by
float32 summation order. 16-bit storage halves the device memory and the bytes a decode step reads.

On the cpu device NumPy's BLAS runs on one thread next to the Numba kernels (see :mod:`freetoken.device.blas`), so
:class:`Linear` runs the multithreaded kernels of :mod:`freetoken.cpu_kernels.gemv` instead: a GEMV for a few tokens
(decode: bound by reading the weights) and a register-tiled product for prompts (about 3x one BLAS thread on 2
cores).

On gpu/emu up to :data:`freetoken.ops.dense.MAX_TOKENS` tokens run the GEMV kernel of ``cuda/dense.cu``
(:func:`freetoken.ops.dense.dense_gemv`: each weight read once, widened in registers). More tokens run a chunked
product on the device's array module (cuBLAS on gpu, NumPy on emu): row chunks of at most :data:`CHUNK_ELEMENTS`
weights are widened to float32 into one reused buffer and multiplied, so the extra memory stays bounded (float32
matrices are multiplied whole, as they are).

Matrices applied to the same input (q/k/v; a shared expert's gate/up/sigmoid) can be concatenated into one Linear
(:meth:`Linear.concat`): one call, and every output element is the same dot product as with the separate matrices.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: Elements per chunk of the load-time exactness checks (bounds their temporary memory).
_CHECK_ELEMENTS = 1 << 22
#: gpu/emu, more tokens than the GEMV kernel takes: weights widened to float32 per chunk of the product (a chunk
#: is at least one row). Bounds the temporary float32 copy (32 MiB).
CHUNK_ELEMENTS = 1 << 23


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

    ``weight`` float32 [N, K] on the host, ``bias`` float32 [N] or None. ``storage`` is how the matrix is held on
    the device and read by the kernels ("bf16", "f16" or "f32", see :func:`exact_storage`); None only on a device
    that runs no kernels (an array module alone, which multiplies the float32 matrix).
    """

    def __init__(self, weight: np.ndarray, device, bias: np.ndarray | None = None):
        w = np.ascontiguousarray(weight, dtype=np.float32)
        if w.ndim != 2:
            raise ValueError(f"weight must be a matrix [N, K], got shape {list(w.shape)}")
        self.dev, self.xp = device, device.xp
        self.out_features, self.in_features = w.shape
        self.sizes: tuple[int, ...] = (self.out_features,)
        self._cpu = device.kind == "cpu"
        if self._cpu:
            from freetoken.cpu_kernels.gemv import matmul_into, storage_view

            self.storage = exact_storage(w)
            self._w = storage_view(to_storage(w, self.storage))  # float32: ``w`` itself (a tied lm_head: embed)
            self._matmul = matmul_into
        else:
            self.storage = exact_storage(w)
            self._w = device.asarray(to_storage(w, self.storage))
        self.bias = None
        if bias is not None:
            b = np.ascontiguousarray(bias, dtype=np.float32).reshape(-1)
            if b.shape != (self.out_features,):
                raise ValueError(f"bias must have {self.out_features} elements, got shape {list(bias.shape)}")
            self.bias = b if self._cpu else device.asarray(b)

    @classmethod
    def concat(cls, weights: Sequence[np.ndarray], device, biases: Sequence[np.ndarray] | None = None) -> Linear:
        """One Linear of the matrices ``weights`` (same K) stacked along N; :meth:`split` cuts its output back.
        ``biases``: one per matrix, or None."""
        ws = [np.asarray(w, dtype=np.float32) for w in weights]
        bias = None if biases is None else np.concatenate([np.asarray(b, np.float32).reshape(-1) for b in biases])
        lin = cls(np.concatenate(ws, axis=0) if len(ws) > 1 else ws[0], device, bias)
        lin.sizes = tuple(w.shape[0] for w in ws)
        return lin

    def split(self, y) -> tuple:
        """The output ``y [T, N]`` of a concatenated Linear cut into its matrices' outputs (views)."""
        out, start = [], 0
        for n in self.sizes:
            out.append(y[:, start:start + n])
            start += n
        return tuple(out)

    def __call__(self, x):
        """``x [T, K]`` float32 -> ``y [T, N]`` float32 (a new array)."""
        if self._cpu:
            if x.dtype != np.float32 or not x.flags.c_contiguous:
                x = np.ascontiguousarray(x, dtype=np.float32)
            if x.ndim != 2 or x.shape[1] != self.in_features:
                raise ValueError(f"x must be [T, {self.in_features}], got shape {list(x.shape)}")
            y = np.empty((x.shape[0], self.out_features), np.float32)
            if x.shape[0]:
                self._matmul(x, self._w, y)  # the kernels read unchecked: shapes checked here
        else:
            return self._device_call(x)
        if self.bias is not None:
            y += self.bias
        return y

    def _device_call(self, x):
        """gpu/emu: the GEMV kernel for a few tokens, else the chunked product (bias included)."""
        from freetoken.ops.dense import MAX_TOKENS, dense_gemv

        xp = self.xp
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = xp.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must be [T, {self.in_features}], got shape {list(x.shape)}")
        t, n = x.shape[0], self.out_features
        if t <= MAX_TOKENS:
            return dense_gemv(x, self._w, self.storage, bias=self.bias, device=self.dev)
        if self.storage == "f32":
            y = x @ self._w.T
        else:
            y = xp.empty((t, n), np.float32)
            rows = max(1, CHUNK_ELEMENTS // max(1, self.in_features))
            buf = xp.empty((min(rows, n), self.in_features), np.float32)
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                wc = self._widen_into(self._w[r0:r1], buf[:r1 - r0])
                y[:, r0:r1] = x @ wc.T
        if self.bias is not None:
            y += self.bias
        return y

    def _widen_into(self, w16, out):
        """The stored 16-bit rows ``w16`` as float32 in ``out`` (same shape, C-contiguous) on the device."""
        xp = self.xp
        if self.storage == "f16":
            xp.copyto(out, w16)
            return out
        bits = out.view(np.uint32)  # bf16: the stored high halves of the float32 values
        xp.copyto(bits, w16)
        xp.left_shift(bits, np.uint32(16), out=bits)
        return out

    @property
    def weight(self):
        """The float32 matrix [N, K] on the device (a widened copy when stored in 16 bits)."""
        if self.storage == "f32":
            return self._w
        if self._cpu:
            from freetoken.cpu_kernels.gemv import widen

            return widen(self._w)
        return self._widen_into(self._w, self.xp.empty(self._w.shape, np.float32))

    @property
    def nbytes(self) -> int:
        """Bytes held on the device (matrix and bias)."""
        return int(self._w.nbytes) + (int(self.bias.nbytes) if self.bias is not None else 0)
