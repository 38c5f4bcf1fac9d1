"""16-lane float32 IR shared by the CPU kernels that read stored rows in place (the decode attention of
:mod:`~freetoken.cpu_kernels.paged_decode`, the few-token GEMV of :mod:`~freetoken.cpu_kernels.gemv`): 16 stored
values (float32, bf16 bits, IEEE half) loaded as float32 lanes, the FMA, a broadcast, and one fixed order in which
the 16 lanes of a sum are added up (the same on every machine: AVX2 splits a 16-lane vector in two, lane for lane;
:func:`lane_tree` is that order for one vector, which the expert row dots use too).

Written as IR rather than left to Numba's loop vectoriser, whose code for these loops (a horizontal sum per row,
loop guards, scalar remainders) ran several times slower than this, and not the same in every process (see
:mod:`~freetoken.cpu_kernels.gemv`).
"""

from __future__ import annotations

from freetoken.cpu_kernels.moe_memory import typed_ptr
from llvmlite import ir
from numba import types
from numba.core import cgutils

F32, I32, I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
V16F = ir.VectorType(F32, 16)
#: Numba type of a stored value -> its kind.
KINDS = {types.float32: "f32", types.uint16: "bf16", types.int16: "f16"}


def load_widened(builder, kind, ptr, c):
    """IR: the ``c``-th 16 stored values at ``ptr`` (a pointer to 16-value vectors) as float32 lanes."""
    v = builder.load(builder.gep(ptr, [c]), align=2 if kind != "f32" else 4)
    if kind == "f16":
        return builder.fpext(v, V16F)
    if kind == "bf16":
        v32 = ir.VectorType(I32, 16)
        return builder.bitcast(builder.shl(builder.zext(v, v32), ir.Constant(v32, [16] * 16)), V16F)
    return v


def row_ptr(builder, kind, address):
    """IR: the integer ``address`` as a pointer to vectors of 16 stored values of ``kind``."""
    elem = {"f32": F32, "bf16": ir.IntType(16), "f16": ir.HalfType()}[kind]
    return typed_ptr(builder, address, ir.VectorType(elem, 16))


def fmuladd(builder):
    """The 16-lane ``llvm.fmuladd`` (one FMA where the CPU has it) declared in the builder's module."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F] * 3),
                                          "llvm.fmuladd.v16f32")


def broadcast(builder, x):
    """IR: the float32 ``x`` in all 16 lanes."""
    undef1 = ir.Constant(ir.VectorType(F32, 1), ir.Undefined)
    return builder.shuffle_vector(builder.insert_element(undef1, x, ir.Constant(I32, 0)), undef1,
                                  ir.Constant(ir.VectorType(I32, 16), [0] * 16))


def lane_tree(builder, v, combine=None):
    """IR: the 16 lanes of the vector ``v`` combined in one fixed tree (lane i with i + 8, then i + 4, i + 2, i + 1),
    by ``combine(builder, a, b)`` (default: ``fadd``); the result as a scalar. The order every 16-lane row sum of
    the CPU kernels uses."""
    combine = combine or (lambda b, x, y: b.fadd(x, y))
    undef = ir.Constant(v.type, ir.Undefined)
    for width in (8, 4, 2, 1):
        pick = [width + i for i in range(width)] + [0] * (16 - width)
        v = combine(builder, v, builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(I32, 16), pick)))
    return builder.extract_element(v, ir.Constant(I32, 0))


def lane_sums4(builder, vs):
    """IR: the 16 lanes of each of 4 vectors added up in one fixed order (halves, pairwise: lane i
    with i + 8, then i + 4, i + 2, i + 1), the 4 sums in one 4-lane vector; the 4 vectors reduced together (10
    shuffles and 5 additions instead of 32 and 16)."""
    def pick(a, b, idx):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, len(idx)), idx))

    # 16 lanes per row -> 8: [a lanes (i + i + 8), b lanes (i + i + 8)]
    ab = builder.fadd(pick(vs[0], vs[1], list(range(8)) + list(range(16, 24))),
                      pick(vs[0], vs[1], list(range(8, 16)) + list(range(24, 32))))
    cd = builder.fadd(pick(vs[2], vs[3], list(range(8)) + list(range(16, 24))),
                      pick(vs[2], vs[3], list(range(8, 16)) + list(range(24, 32))))
    # 8 per row -> 4: lane i with i + 4 within each row's 8
    lo = [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27]
    q = builder.fadd(pick(ab, cd, lo), pick(ab, cd, [i + 4 for i in lo]))
    # 4 per row -> 2: lane i with i + 2
    lo = [0, 1, 4, 5, 8, 9, 12, 13]
    h = builder.fadd(pick(q, q, lo), pick(q, q, [i + 2 for i in lo]))
    # 2 per row -> 1
    return builder.fadd(pick(h, h, [0, 2, 4, 6]), pick(h, h, [1, 3, 5, 7]))
