"""Raw-memory intrinsics of the CPU expert kernels (:mod:`freetoken.cpu_kernels.moe_experts`): addresses, not arrays.

The hot path passes raw addresses (``uint64`` from :func:`addr`) instead of arrays. Numba reference-counts every array
passed to a function, inlined ones included, with atomic updates on the array's shared header; with two threads that
cost ~18 ns per row call, more than decoding a 768-wide fp4 row (measured on a 2-core Zen 5, AVX-512).
:func:`freetoken.cpu_kernels.moe_experts.forward` validates every shape first and keeps the arrays alive: nothing in
the kernels checks bounds.
"""

from __future__ import annotations

from llvmlite import ir
from llvmlite.binding import llvm_version_info
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: Software prefetch distance of the row loops, in value bytes.
PREFETCH_BYTES = 8192
#: ``llvm.prefetch``'s locality of the expert row loops' prefetches: 2, ``prefetcht1`` (into L2, not L1). Measured on
#: a 2-core AMD EPYC (AVX-512 + BF16), bench/bench_experts.py at Qwen3-30B-A3B's shape, T = 1, per call, 3
#: (``prefetcht0``) against 2: fp8_block with bf16 tokens 2.4-2.8 against 1.8 ms on one thread, 1.6-1.9 against
#: 1.0-1.2 ms on two; bf16 4.7 against 3.4 ms on one thread; q4_0 (int8 dots) 1.0-1.3 against 0.75-0.82 ms on two.
#: The float paths, bound by their decode, do not change. A prefetch into L1 holds one of its few miss buffers until
#: the line arrives, beside the demand loads; L2's deeper queue takes them without stalling the loop.
PREFETCH_LOCALITY = 2

_I32 = ir.IntType(32)
# the prefetch intrinsic is mangled by its pointer type: opaque pointers since LLVM 15
_PREFETCH_NAME = "llvm.prefetch.p0" if llvm_version_info >= (15,) else "llvm.prefetch.p0i8"


@intrinsic
def addr(typingctx, arr):
    """Address of an array's first element as uint64 (the caller keeps the array alive)."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, ir.IntType(64))
    return types.uint64(arr), codegen


def typed_ptr(builder, address, lltype):
    """The integer ``address`` as an LLVM pointer to ``lltype``."""
    return builder.inttoptr(address, lltype.as_pointer())


def declare_prefetch(module):
    """``llvm.prefetch(ptr, rw, locality, cache type)`` declared in ``module``."""
    return cgutils.get_or_insert_function(
        module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), _I32, _I32, _I32]), _PREFETCH_NAME)


def _make_load(nbtype, lltype):
    def load(typingctx, address, index):
        if not (isinstance(address, types.Integer) and isinstance(index, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            a = context.cast(builder, args[0], signature.args[0], types.uint64)
            i = context.cast(builder, args[1], signature.args[1], types.intp)
            return builder.load(builder.gep(typed_ptr(builder, a, lltype), [i]))
        return nbtype(address, index), codegen
    load.__name__ = load.__qualname__ = f"load_{nbtype}"
    return intrinsic(load)


@intrinsic
def prefetch(typingctx, address):
    """Software prefetch of the cache line at ``address`` (a hint: never faults)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        a = context.cast(builder, args[0], signature.args[0], types.uint64)
        builder.call(declare_prefetch(builder.module), [typed_ptr(builder, a, ir.IntType(8)), ir.Constant(_I32, 0),
                                                        ir.Constant(_I32, PREFETCH_LOCALITY), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.void(address), codegen


#: ``load_<t>(address, i)``: element ``i`` of the ``<t>`` array at ``address``.
load_u8 = _make_load(types.uint8, ir.IntType(8))
load_u16 = _make_load(types.uint16, ir.IntType(16))
load_i64 = _make_load(types.int64, ir.IntType(64))
load_f32 = _make_load(types.float32, ir.FloatType())


@intrinsic
def store_f32(typingctx, address, index, value):
    """``((float32 *) address)[index] = value``."""
    if not (isinstance(address, types.Integer) and isinstance(index, types.Integer) and value == types.float32):
        return None

    def codegen(context, builder, signature, args):
        a = context.cast(builder, args[0], signature.args[0], types.uint64)
        i = context.cast(builder, args[1], signature.args[1], types.intp)
        builder.store(args[2], builder.gep(typed_ptr(builder, a, ir.FloatType()), [i]))
        return context.get_dummy_value()
    return types.void(address, index, value), codegen

