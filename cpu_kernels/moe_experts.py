"""Routed-expert forward (the MoE FFN) on the CPU: Numba kernels reading expert records in place.

The cpu executor's twin of the routed expert CUDA kernels; reference
:func:`freetoken.testing.reference.moe_experts.moe_forward_reference`:
``y[t] = sum_j weights[t, j] * (down_e @ act(gate_e @ x[t] + gb_e, up_e @ x[t] + ub_e) + db_e)``, ``e = ids[t, j]``.
Public entry points: :func:`prepare` (validate record banks once) and :func:`forward`. Bank layouts:
:mod:`freetoken.formats.base`.

One call groups the (token, expert) pairs by unique expert, runs the gate/up kernel (``prange`` over unique expert x
block of rows, the activation into ``h``) and the down kernel (``prange`` over ranges of output rows, experts outer,
no atomics). Every record byte is read once per call; nothing is dequantized into memory; fp32 accumulation
throughout. Every format has two paths (``activations``, :func:`uses_q8`): the float path, the exact reference, and
a reduced one. For the 4-bit formats, q8_0 and the k-quants the kernels quantize x and h to 8-bit blocks and use int8
dot products, by default where the CPU has AVX2 or AVX-512 VNNI (the float path's table lookups fall to ~5% of the
bandwidth without AVX-512; the k-quants' float decode holds two cores to ~45% of it); for bf16 and fp8_block they
round x and h to bf16 and use bf16 dot products, by default where the CPU has AVX512-BF16 and VBMI (bf16 with AVX2
too: its portable code beats the float path there). The code, one
job per module, bottom up (each module's docstring has the measurements behind its design):

* :mod:`~freetoken.cpu_kernels.moe_memory`: raw-memory intrinsics; the hot path passes addresses, not arrays;
* :mod:`~freetoken.cpu_kernels.moe_nibble`: the nibble formats' (mxfp4/ds_fp4, nvfp4, q4_0) float row dots in LLVM
  vector IR;
* :mod:`~freetoken.cpu_kernels.moe_kquant`: the GGUF block formats' (q8_0, q4_k, q5_k, q6_k, iq4_xs) float row dots
  in LLVM vector IR (float path only: :func:`uses_q8` is False for them);
* :mod:`~freetoken.cpu_kernels.moe_bf16act`: bf16's and fp8_block's row dots against bf16 tokens (``vdpbf16ps``);
* :mod:`~freetoken.cpu_kernels.moe_int8`: the 4-bit formats' and q8_0's int8 row dots (vpdpbusd / vpmaddubsw /
  portable, per :mod:`freetoken.device.simd`), :mod:`~freetoken.cpu_kernels.moe_int8_kquant` the k-quants', with
  :mod:`~freetoken.cpu_kernels.q8_act` (8-bit activations) and
  :mod:`~freetoken.cpu_kernels.moe_rows_q8` (per-row dispatch);
* :mod:`~freetoken.cpu_kernels.moe_rows`: format codes and tables, bf16/fp8_block row dots, the float path's per-row
  dispatch;
* :mod:`~freetoken.cpu_kernels.moe_kernels`: pair grouping, the gate/up and down kernels;
* this module: checks every argument, permutes the tokens, launches the kernels.

The kernels are cached on disk by Numba; the cache directory is keyed by every kernel source
(:mod:`freetoken.device.numba_cache`), so an edit to any of these modules recompiles the kernels that inline it.

K order: for the nibble formats each group of 32 K elements is processed as its 16 low nibbles, then its 16 high
nibbles ("block split"). For q4_0 that is the natural element order; for nvfp4/mxfp4/ds_fp4 (low nibble = even
element) the token vectors are permuted the same way once per call (:func:`block_split_perm`), and the gate/up kernel
writes ``h`` directly in the down matrix's order. bf16, fp8_block, q8_0 and the k-quants use the natural order.

Mixed records (``RecordLayout.down_fmt``, e.g. GGUF Q4_K_M: gate/up q4_k, down q6_k): gate/up and down are separate
kernels, each given its matrix's format code; x is permuted for the gate/up format, ``h`` written in the down
format's order, and each kernel takes the int8 path where its own format has one.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import numba as nb
import numpy as np
from freetoken.cpu_kernels.moe_kernels import down_kernel as _down_kernel  # (tests count their signatures)
from freetoken.cpu_kernels.moe_kernels import down_serial as _down_serial
from freetoken.cpu_kernels.moe_kernels import gate_up_kernel as _gate_up_kernel
from freetoken.cpu_kernels.moe_kernels import gate_up_serial as _gate_up_serial
from freetoken.cpu_kernels.moe_kernels import group_pairs
from freetoken.cpu_kernels.moe_rows import (
    FMT_BF16,
    FMT_FP8_BLOCK,
    FMT_MXFP4,
    FMT_NVFP4,
    FMT_Q4_0,
    FORMAT_CODES,
    SPLIT_FORMATS,
    block_split_perm,
)
from freetoken.cpu_kernels.moe_rows_q8 import BF16_ACT_FORMATS, Q8_OFFSETS
from freetoken.cpu_kernels.q8_act import NO_Q8, q8_buffers

from freetoken.device.constants import ACT_GPT_OSS, ACT_SWIGLU
from freetoken.device.simd import ACTIVATIONS, bf16_dots, simd_level

__all__ = ["ACTIVATIONS", "ACT_GPT_OSS", "ACT_SWIGLU", "FMT_BF16", "FMT_FP8_BLOCK", "FMT_MXFP4", "FMT_NVFP4",
           "FMT_Q4_0", "FORMAT_CODES", "SPLIT_FORMATS", "PreparedBanks", "block_split_perm", "forward", "prepare",
           "run_prepared", "uses_q8"]




#: Below this many multiply-adds per call (pairs x 3 x H x I) the kernels' serial copies run, on the calling thread
#: alone. A region waits at its end for every thread it woke; on a busy machine a descheduled thread turns
#: microseconds into milliseconds (measured on the bundled model, 2 cores shared with two other busy processes:
#: 78 ms per decode step with the tiny expert calls on 2 threads, 3.1 ms with them on 1), and below this size one
#: thread does the work in tens of microseconds anyway.
SERIAL_MACS = 1 << 19


#: Calls of at most this many (token, expert) pairs reuse their work buffers (``h`` and the 8-bit token rows) from a
#: per-thread cache instead of allocating them: a decode step makes one call per MoE layer of a handful of pairs.
REUSE_MAX_PAIRS = 64

_buffers = threading.local()  # a cpu-share worker thread and the main thread each have their own


def _token_buffers(kind: str, rows: int, k: int):
    """The reduced token rows of one matrix's kernel: ``kind`` "q8" (8-bit blocks), "bf16" (bf16 rows of 2 k bytes in
    the first buffer, the others empty: the same Numba types) or "" (the float path)."""
    if kind == "q8":
        return q8_buffers(rows, k)
    if kind == "bf16":
        return (np.empty((rows, 2 * k), np.int8), np.empty((rows, 0), np.int32), np.empty((rows, 0), np.float32),
                np.empty((rows, 0), np.int32))
    return NO_Q8


def _new_work_buffers(pairs: int, t_count: int, hidden: int, inter: int, kind_gu: str, kind_down: str):
    """(h [pairs, inter] float32, x's reduced rows, h's reduced rows), uninitialised (the kernels fill them)."""
    return (np.empty((pairs, inter), np.float32), _token_buffers(kind_gu, t_count, hidden),
            _token_buffers(kind_down, pairs, inter))


def _work_buffers(pairs: int, t_count: int, hidden: int, inter: int, kind_gu: str, kind_down: str):
    """:func:`_new_work_buffers`, reused per thread for calls of up to :data:`REUSE_MAX_PAIRS` pairs."""
    key = (pairs, t_count, hidden, inter, kind_gu, kind_down)
    if pairs > REUSE_MAX_PAIRS:
        return _new_work_buffers(*key)
    cache = _buffers.__dict__.setdefault("by_shape", {})
    bufs = cache.get(key)
    if bufs is None:
        if len(cache) >= 256:  # many models or shapes in one process: start over rather than grow
            cache.clear()
        bufs = cache[key] = _new_work_buffers(*key)
    return bufs


@functools.cache
def _layout(fmt_name: str, down_fmt_name: str, hidden: int, inter: int, bias: bool):
    from freetoken.formats import RecordLayout, get

    layout = RecordLayout(get(fmt_name), hidden, inter, bias, down_fmt=get(down_fmt_name))
    specs = tuple((s.name, np.dtype(s.dtype), tuple(s.shape)) for s in layout.bank_specs())
    return specs


@functools.cache
def _perm(n: int, split: bool) -> np.ndarray:
    return (block_split_perm(n) if split else np.arange(n)).astype(np.int64)


@functools.cache
def _inverse_perm(n: int, split: bool) -> np.ndarray:
    return np.argsort(_perm(n, split)).astype(np.int64)


def _matrix_args(banks: dict, m: str) -> tuple[int, int, int]:
    """Addresses of one matrix's (values, scales, globals) banks, 0 where the format has none. Addresses rather than
    arrays: one kernel signature for every format and for read-only (memory-mapped) banks, which Numba would
    otherwise type and compile separately."""
    return tuple(banks[f"{m}.{b}"].ctypes.data if f"{m}.{b}" in banks else 0 for b in "wsg")


def _check_array(name, a, dtype, shape=None, ndim=None, contiguous=True):
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {np.dtype(dtype)}, got {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {list(a.shape)}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(a.shape)}")
    if contiguous and not a.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")


def uses_q8(fmt_name: str, activations: str = "auto") -> bool:
    """Whether :func:`forward` runs the reduced-activation row dots for ``fmt_name``: ``activations`` "q8" (every
    format: int8 dots against 8-bit blocks for the 4-bit ones, q8_0 and the k-quants, bf16 dots against bf16 tokens
    for bf16 and fp8_block), "f32" (never) or "auto": where they are the fast path, i.e. the int8 formats and bf16
    where the compile target has AVX2 or AVX-512, fp8_block where it has AVX512-BF16 and VBMI
    (:func:`freetoken.device.simd.bf16_dots`; without them fp8_block's float path is faster than the portable
    bf16-token code: 3.1-3.5 against 3.9-4.3 ms per call on one thread compiled for Haswell, bench_experts)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    return _q8_code(FORMAT_CODES.get(fmt_name), activations)


def _q8_code(code: int | None, activations: str) -> bool:
    """:func:`uses_q8` by format code, for a valid ``activations``."""
    if activations == "f32":
        return False
    if code == FMT_FP8_BLOCK:
        return activations == "q8" or bf16_dots()
    if code == FMT_BF16:  # bf16 x bf16 widened exactly is faster than bf16 x float32 with AVX2 too
        return activations == "q8" or bf16_dots() or simd_level() != "none"
    if code not in Q8_OFFSETS:
        return False
    return activations == "q8" or simd_level() != "none"


def _token_kind(code: int, reduced: bool) -> str:
    if not reduced:
        return ""
    return "bf16" if code in BF16_ACT_FORMATS else "q8"


def forward(fmt_name: str, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, banks: dict, hidden: int,
            inter: int, act_code: int, out: np.ndarray, prepared: PreparedBanks | None = None,
            activations: str = "auto", down_fmt_name: str | None = None) -> None:
    """Routed-expert forward on the CPU, reading the record banks in place.

    Parameters
    ----------
    fmt_name : the gate/up format, one of ``bf16, fp8_block, nvfp4, mxfp4, ds_fp4, q4_0, q8_0, q4_k, q5_k, q6_k,
        iq4_xs``
    x : float32 [T, H], C-contiguous activations
    ids : int32 [T, k] indices into the leading dimension of every bank (experts or cache slots); repeats allowed
        (the same expert twice in a row counts twice)
    weights : float32 [T, k] routing weights (any sign, any sum)
    banks : record banks (``RecordLayout(fmt, hidden, inter, bias).quantize(...)``), leading dimension E; biases
        ``gate.b``/``up.b`` [E, I] and ``down.b`` [E, H] (float32) are applied when present
    hidden, inter : H and I (multiples of 32; of 256 for the k-quants)
    act_code : ``ACT_SWIGLU`` (0) or ``ACT_GPT_OSS`` (1)
    out : float32 [T, H], C-contiguous, overwritten with the weighted sum of the experts' outputs
    prepared : :func:`prepare` of these banks (skips re-validating them on every call)
    activations : "auto", "q8" or "f32": the token vectors (x and the intermediate h) of the formats with an int8
        path quantized to 8-bit blocks for the int8 row dots, or float32 (:func:`uses_q8`), per matrix format
    down_fmt_name : the down matrix's format (a mixed record); None: ``fmt_name``. ``prepared`` must have been made
        with the same formats
    """
    if act_code not in (ACT_SWIGLU, ACT_GPT_OSS):
        raise ValueError(f"act_code must be {ACT_SWIGLU} (swiglu) or {ACT_GPT_OSS} (gpt_oss), got {act_code}")
    act_code = int(act_code)  # plain ints and addresses: one compiled signature per kernel
    down_fmt_name = fmt_name if down_fmt_name is None else down_fmt_name
    p = prepared if prepared is not None else prepare(fmt_name, banks, hidden, inter, down_fmt_name)
    if (FORMAT_CODES.get(fmt_name), FORMAT_CODES.get(down_fmt_name)) != (p.fmt, p.down_fmt):
        raise ValueError(f"prepared: made for other formats than {fmt_name!r} / {down_fmt_name!r}")
    hidden, inter = p.hidden, p.inter
    _check_array("x", x, np.float32, ndim=2)
    t_count = x.shape[0]
    if x.shape[1] != hidden or t_count < 1:
        raise ValueError(f"x: expected shape [T >= 1, {hidden}], got {list(x.shape)}")
    _check_array("ids", ids, np.int32, ndim=2, contiguous=False)
    if ids.shape[0] != t_count or ids.shape[1] < 1:
        raise ValueError(f"ids: expected shape [{t_count}, k >= 1], got {list(ids.shape)}")
    _check_array("weights", weights, np.float32, shape=ids.shape, contiguous=False)
    ids, weights = np.ascontiguousarray(ids), np.ascontiguousarray(weights)
    _check_array("out", out, np.float32, shape=(t_count, hidden))

    run_prepared(p, x, ids, weights, act_code, out, activations)


@functools.lru_cache(maxsize=64)
def _plan(fmt: int, down_fmt: int, inter: int, activations: str):
    """What a call's kernels take besides the tokens, per format codes and shape: (x permuted to the block-split
    order, reduced tokens for gate/up, for down, their q8 offsets, h's column order, the two reduced rows' kinds)."""
    q8_gu, q8_down = _q8_code(fmt, activations), _q8_code(down_fmt, activations)
    return (fmt in SPLIT_FORMATS, q8_gu, q8_down, Q8_OFFSETS.get(fmt, 0), Q8_OFFSETS.get(down_fmt, 0),
            _inverse_perm(inter, down_fmt in SPLIT_FORMATS), _token_kind(fmt, q8_gu), _token_kind(down_fmt, q8_down))


def run_prepared(p: PreparedBanks, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, act_code: int,
                 out: np.ndarray, activations: str = "auto") -> None:
    """:func:`forward` without its checks, for a caller that vouches for them: ``x`` float32 [T >= 1, H], ``ids``
    int32 and ``weights`` float32 [T, k >= 1], ``out`` float32 [T, H], all C-contiguous; ``act_code`` a plain int
    of the two; ``activations`` valid. Ids out of range still raise (the kernels index by them)."""
    hidden, inter = p.hidden, p.inter
    uniq, poff, ptok, pw, bad = group_pairs(ids, weights, p.num_experts)
    if bad >= 0:
        t, j = divmod(int(bad), ids.shape[1])
        raise ValueError(f"ids[{t}, {j}] = {int(ids[t, j])} is out of range: the banks hold {p.num_experts} experts")
    split, q8_gu, q8_down, qoff_gu, qoff_down, hperm, kind_gu, kind_down = _plan(p.fmt, p.down_fmt, inter,
                                                                                 activations)
    xs = np.ascontiguousarray(x[:, _perm(hidden, True)]) if split else x
    if not xs.flags.writeable:  # a read-only array is another Numba type: one compiled kernel for both
        xs = xs.copy()
    pairs, t_count = pw.shape[0], x.shape[0]
    nthreads = 1 if pairs * 3 * hidden * inter < SERIAL_MACS else nb.get_num_threads()
    h, xq8, hq8 = _work_buffers(pairs, t_count, hidden, inter, kind_gu, kind_down)
    gate_up, down = (_gate_up_serial, _down_serial) if nthreads == 1 else (_gate_up_kernel, _down_kernel)
    # p.banks, xs and the biases stay referenced here while the kernels read them through their addresses
    gate_up(p.fmt, p.gate, p.up, p.gb, p.ub, p.has_bias, act_code, uniq, poff, ptok, xs, q8_gu, qoff_gu, xq8, hidden,
            inter, hperm, h, nthreads)
    down(p.down_fmt, p.down, p.db, p.has_bias, uniq, poff, ptok, pw, h, q8_down, qoff_down, hq8, hidden, inter, out,
         nthreads)


class PreparedBanks(NamedTuple):
    """Validated record banks with their kernel arguments (addresses), made once by :func:`prepare`."""

    fmt: int  # gate/up's format code
    down_fmt: int
    hidden: int
    inter: int
    has_bias: bool
    num_experts: int
    gate: tuple
    up: tuple
    down: tuple
    gb: int
    ub: int
    db: int
    banks: dict  # keeps the arrays alive while their addresses are used


def prepare(fmt_name: str, banks: dict, hidden: int, inter: int, down_fmt_name: str | None = None) -> PreparedBanks:
    """Check ``banks`` against the record layout of ``hidden`` x ``inter`` with gate/up in ``fmt_name`` and down in
    ``down_fmt_name`` (None: ``fmt_name``) once; the result can be passed to :func:`forward` for every later call on
    the same (unmodified) banks."""
    down_fmt_name = fmt_name if down_fmt_name is None else down_fmt_name
    for name in (fmt_name, down_fmt_name):
        if name not in FORMAT_CODES:
            raise ValueError(f"unknown expert format {name!r}; known: {', '.join(FORMAT_CODES)}")
    hidden, inter = int(hidden), int(inter)
    if hidden < 32 or inter < 32 or hidden % 32 or inter % 32:
        raise ValueError(f"hidden and inter must be positive multiples of 32, got {hidden} and {inter}")
    has_bias = "gate.b" in banks or "up.b" in banks or "down.b" in banks
    num_experts = None
    record = fmt_name if down_fmt_name == fmt_name else f"{fmt_name}+{down_fmt_name}"
    for name, dtype, shape in _layout(fmt_name, down_fmt_name, hidden, inter, has_bias):
        a = banks.get(name)
        if a is None:
            raise ValueError(f"banks: {record} record is missing {name!r} (have {sorted(banks)})")
        if num_experts is None:
            num_experts = a.shape[0] if isinstance(a, np.ndarray) and a.ndim else 0
        _check_array(f"banks[{name!r}]", a, dtype, shape=(num_experts, *shape))
    if num_experts < 1:
        raise ValueError("banks: no experts")
    gate, up, down = (_matrix_args(banks, m) for m in ("gate", "up", "down"))
    gb, ub, db = (banks[f"{m}.b"].ctypes.data if has_bias else 0 for m in ("gate", "up", "down"))
    return PreparedBanks(FORMAT_CODES[fmt_name], FORMAT_CODES[down_fmt_name], hidden, inter, has_bias,
                         int(num_experts), gate, up, down, gb, ub, db, dict(banks))

