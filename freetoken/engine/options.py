"""Typed options between ``freetoken.load`` and the model: how routed experts run, and how a model is loaded.

Checked when made, so a bad value is reported with its option's name before anything is loaded."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from freetoken.device.simd import ACTIVATIONS as CPU_ACTIVATIONS  # experts on the CPU: auto, q8, f32
from freetoken.models.kv import KV_KINDS  # how the paged KV cache stores keys and values
from freetoken.policy.runtime import CACHE_POLICIES  # how the expert cache picks victims: auto, next_use, lru
from freetoken.policy.runtime import MODES as MOE_MODES  # how misses of the expert cache are served

#: Future-value estimators measured while running (see freetoken.policy.estimators), besides a fixed value.
FUTURE_VALUE_ESTIMATORS = ("auto", "global")


def _positive(name: str, value, integer: bool = False, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise ValueError(f"{name} must be a {'whole ' if integer else ''}number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class ExpertOptions:
    """How the routed experts run: on a gpu/emu device through its expert cache (the cpu device reads them in
    place and ignores all but ``cpu_activations``).

    ``cache_slots``: device slots of the expert cache (None: room for every expert). ``mode``: see
    :data:`MOE_MODES`. ``pcie_gbps`` / ``cpu_gbps``: pin the bandwidth estimates (GB/s) instead of measuring.
    ``future_value``: what a fetched expert is worth beyond its step, in seconds (q*'s tunable term), or an
    estimate made while running (``auto``: per expert, from its re-use gaps; ``global``: hits per residency); 0,
    the default, is the greedy per-call split, which ``bench/qstar_sweep.py`` found best on the bundled model.
    ``prefetch``: copy the next MoE layer's predicted experts while a layer computes. ``max_decode_tokens``: the
    most tokens one decode admission carries (a longer prompt streams whole layers through the prefill buffers).
    ``cpu_activations``: experts computed on the CPU (the cpu device, and misses computed by the CPU) in a format
    with an int8 path (the 4-bit formats, q8_0, the k-quants) take
    their token vectors as 8-bit blocks with int8 dot products ("q8", llama.cpp's q8_0 rounding) or as float32
    ("f32", the reference path); "auto" is q8 where the CPU has AVX2 or AVX-512 VNNI. ``host_memory``: bytes of
    host memory for the routed experts' records (None: all of them); below what they take, an FTW file's records
    are read from the file as steps need them into a host tier of that size (:class:`freetoken.cache.HostTier`).
    ``cache_policy``: how the expert cache picks victims, one of :data:`CACHE_POLICIES`
    (:func:`freetoken.policy.runtime.resolve_cache_policy`; ``auto``, the default, is ``next_use`` with ``--moe-mode
    gpu`` when the slots cannot hold every expert, else ``lru``)."""

    mode: str = "gpu"
    cache_slots: int | None = None
    pcie_gbps: float | None = None
    cpu_gbps: float | None = None
    future_value: float | str = 0.0
    prefetch: bool = False
    max_decode_tokens: int = 16
    cpu_activations: str = "auto"
    host_memory: int | None = None
    cache_policy: str = "auto"

    def __post_init__(self):
        if self.cache_policy not in CACHE_POLICIES:
            raise ValueError(f"cache policy {self.cache_policy!r}: choose one of {', '.join(CACHE_POLICIES)}")
        if self.cpu_activations not in CPU_ACTIVATIONS:
            raise ValueError(f"cpu activations {self.cpu_activations!r}: choose one of {', '.join(CPU_ACTIVATIONS)}")
        if self.mode not in MOE_MODES:
            raise ValueError(f"moe mode {self.mode!r}: choose one of {', '.join(MOE_MODES)}")
        _positive("cache_slots", self.cache_slots, integer=True)
        _positive("host_memory", self.host_memory, integer=True)
        _positive("pcie_gbps", self.pcie_gbps)
        _positive("cpu_gbps", self.cpu_gbps)
        fv = self.future_value
        if fv not in FUTURE_VALUE_ESTIMATORS and (isinstance(fv, bool) or not isinstance(fv, (int, float))
                                                  or not (math.isfinite(fv) and fv >= 0)):
            raise ValueError(f"future_value must be a number of seconds >= 0 or one of "
                             f"{', '.join(FUTURE_VALUE_ESTIMATORS)}, got {fv!r}")
        _positive("max_decode_tokens", self.max_decode_tokens, integer=True, optional=False)


@dataclass(frozen=True)
class LoadOptions:
    """``expert_format``: the :mod:`freetoken.formats` name the routed experts run in (None: as stored).
    ``kv_dtype``: how the paged KV cache stores keys and values (:data:`KV_KINDS`: bf16, the default; f16; f32;
    fp8 e4m3 with a float32 scale per token and kv head). ``kv_memory``: bytes of the KV pool (None: sized by
    :func:`freetoken.engine.loading.context.plan_context`). ``ctx``: the longest sequence (prompt and generated tokens)
    the model runs (None: the model's ``max_position_embeddings``, capped by the pool). ``prefill_chunk``: prompt
    tokens per forward pass (None: sized from the model's activations). ``progress``: progress lines on stderr while
    loading and preparing kernels. ``allow_widen``: a GGUF file's non-expert matrices in a block type no dense storage
    keeps are widened to float32 instead of refused. ``verify``: an FTW file's checksums, checked as its data is
    read: "full" (every tensor and record, the default: xxh3 hashes faster than a disk reads), "sample" (every
    tensor, one record in 16) or "none". ``kv_sequences``: sequences the default pool makes room for, each up to the
    whole context (a batching server's ``--max-seqs``), as far as the memory budget allows (one at least)."""

    expert_format: str | None = None
    kv_dtype: str = "bf16"
    kv_memory: int | None = None
    ctx: int | None = None
    kv_sequences: int = 1
    prefill_chunk: int | None = None
    progress: bool = False
    allow_widen: bool = False
    verify: str = "full"
    experts: ExpertOptions = field(default_factory=ExpertOptions)

    def __post_init__(self):
        if self.verify not in ("full", "sample", "none"):
            raise ValueError(f"verify {self.verify!r}: choose one of full, sample, none")
        if self.kv_dtype not in KV_KINDS:
            raise ValueError(f"kv dtype {self.kv_dtype!r}: choose one of {', '.join(KV_KINDS)}")
        _positive("kv_memory", self.kv_memory, integer=True)
        _positive("ctx", self.ctx, integer=True)
        _positive("kv_sequences", self.kv_sequences, integer=True, optional=False)
        _positive("prefill_chunk", self.prefill_chunk, integer=True)
        if self.expert_format is not None:
            from freetoken import formats

            if self.expert_format not in formats.NAMES:
                raise ValueError(f"expert format {self.expert_format!r}: choose one of {', '.join(formats.NAMES)}")
