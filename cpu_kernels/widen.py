"""Stored weights (float32, bf16 bits, IEEE half bits) to float32 inside Numba kernels, and the products' fast-math
flags: shared by the dense kernels (:mod:`~freetoken.cpu_kernels.gemv`, :mod:`~freetoken.cpu_kernels.gemm_panel`,
:mod:`~freetoken.cpu_kernels.qgemv`) and the expert row dots (:mod:`~freetoken.cpu_kernels.moe_rows`)."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

#: LLVM fast-math flags of the products: reassociation (vectorised reductions) and contraction (FMA); NaN and inf
#: propagate.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


@intrinsic
def _widen(typingctx, v):
    """One stored weight -> float32: float32 as is, uint16 as bf16 bits, int16 as IEEE half bits."""
    if v not in (types.float32, types.uint16, types.int16):
        return None

    def codegen(context, builder, signature, args):
        (a,) = args
        if signature.args[0] == types.float32:
            return a
        if signature.args[0] == types.int16:  # fpext half: vcvtph2ps once vectorised
            return builder.fpext(builder.bitcast(a, ir.HalfType()), ir.FloatType())
        bits = builder.shl(builder.zext(a, ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(bits, ir.FloatType())
    return types.float32(v), codegen
