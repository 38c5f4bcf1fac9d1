"""The SIMD level the CPU kernels are compiled for, read from Numba's code-generation target.

The int8 row dots (:mod:`freetoken.cpu_kernels.moe_int8`) emit different instructions per level, at compile time:

* ``avx512_vnni``: 512-bit ``vpdpbusd`` and ``vpshufb`` (AVX-512 F/BW/VL + VNNI: Ice Lake, Sapphire Rapids, Zen 4/5);
* ``avx2``: 256-bit ``vpmaddubsw`` + ``vpmaddwd`` and ``vpshufb`` (Haswell and later, Zen 1-3, and every recent
  Intel desktop CPU, which ships without AVX-512);
* ``none``: portable vector IR (correct on any target, not fast).

Besides the level, :func:`bf16_dots`: whether the bf16 and fp8_block expert rows take AVX512-BF16 ``vdpbf16ps``
against bf16 token rows (:mod:`freetoken.cpu_kernels.moe_bf16act`; portable code for the same arithmetic otherwise).

The level is that of the features Numba compiles for, not of the hardware alone: ``NUMBA_CPU_NAME`` and
``NUMBA_CPU_FEATURES`` change both together, and Numba's on-disk cache is keyed by the same features, so a cached
kernel is never loaded for a level it was not compiled for. Note that ``NUMBA_CPU_NAME`` alone keeps the host's
features (Numba's behaviour): to compile for an AVX2-only machine on an AVX-512 one, set both
(:func:`avx2_only_features` gives the feature string).
"""

from __future__ import annotations

import functools

LEVELS = ("none", "avx2", "avx512_vnni")
#: How the CPU expert kernels take the token vectors: reduced ("q8": 8-bit blocks with int8 dots for the formats with
#: an int8 path (4-bit, q8_0, k-quants), bf16 with bf16 dots for bf16 and fp8_block), float32 ("f32", the reference
#: path), or "auto": reduced where it is the fast path (freetoken.cpu_kernels.moe_experts.uses_q8).
ACTIVATIONS = ("auto", "q8", "f32")
_AVX512_VNNI = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx2", "fma", "f16c"})
_AVX2 = frozenset({"avx2", "fma", "f16c"})


def _feature_string() -> str:
    from numba.core import config

    if config.CPU_FEATURES is not None:
        return config.CPU_FEATURES
    from llvmlite import binding as ll

    return ll.get_host_cpu_features().flatten()


@functools.cache
def target_features() -> frozenset[str]:
    """The CPU features enabled in Numba's code-generation target."""
    return frozenset(f[1:] for f in _feature_string().split(",") if f.startswith("+"))


def level_of(features: frozenset[str] | set[str]) -> str:
    if _AVX512_VNNI <= features:
        return "avx512_vnni"
    if _AVX2 <= features:
        return "avx2"
    return "none"


@functools.cache
def simd_level() -> str:
    """``avx512_vnni``, ``avx2`` or ``none``: the instructions the int8 kernels compile to here."""
    return level_of(target_features())


#: What the bf16 dot products of :mod:`freetoken.cpu_kernels.moe_bf16act` need: ``vdpbf16ps`` (AVX512-BF16) and, for
#: fp8_block's table decode, ``vpermi2b``/``vpermt2b`` (AVX512-VBMI): Zen 4/5, Sapphire Rapids and later Xeons.
_BF16_DOTS = frozenset({"avx512f", "avx512bw", "avx512bf16", "avx512vbmi"})


@functools.cache
def bf16_dots() -> bool:
    """Whether the compile target has the bf16 dot products (else the bf16-token path runs portable code)."""
    return _BF16_DOTS <= target_features()


def avx2_only_features() -> str:
    """This host's feature string with every AVX-512, AVX-VNNI and AMX feature turned off: with
    ``NUMBA_CPU_NAME=haswell`` it makes Numba compile as for an AVX2-only CPU (the tests run the avx2 kernels so)."""
    from llvmlite import binding as ll

    def keep(name: str) -> bool:
        return not (name.startswith(("avx512", "amx", "avx10", "avxvnni", "avxifma", "avxneconvert"))
                    or name in ("evex512", "gfni", "vaes", "vpclmulqdq"))
    feats = ll.get_host_cpu_features()
    return ",".join(("+" if on and keep(name) else "-") + name for name, on in sorted(feats.items()))
