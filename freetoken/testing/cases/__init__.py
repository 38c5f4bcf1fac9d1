"""Parity cases of every op, one module per op (each defines ``CASES``): inputs, the NumPy reference
(``freetoken.testing.reference``), tolerance and bytes moved. One registry serves the test suite (small, awkward
shapes on cpu / emu / gpu: tests/test_kernel_parity.py) and ``bench/gpu_check`` (large shapes on the GPU, timed);
``freetoken.ops.OPS`` names each op's case module."""

from __future__ import annotations

from importlib import import_module

from freetoken.testing.cases.base import KernelCase, poisoned

MODULES = ("reduce", "topk", "histogram", "transpose", "dense", "rms_norm", "rope", "routing",
           "moe_experts", "cache", "paged_attention", "latent_attention", "linear_attention")


def _ordered() -> list[KernelCase]:
    """Every module's cases, the ones bench/gpu_check ran before the op registry first and in their old order:
    gpu_check draws every case's inputs from one random stream, so this keeps their data (and timings) comparable
    across runs; the rest follow."""
    mods = {m: import_module(f"freetoken.testing.cases.{m}") for m in MODULES}
    first = (mods["reduce"].CASES + mods["topk"].CASES + mods["histogram"].CASES + mods["transpose"].CASES
             + mods["dense"].DENSE_CASES + mods["dense"].QDENSE_CASES
             + mods["moe_experts"].SWIGLU_CASES + mods["cache"].CACHE_CASES)
    names = {c.name for c in first}
    return first + [c for m in MODULES for c in mods[m].CASES if c.name not in names]


CASES: list[KernelCase] = _ordered()

__all__ = ["CASES", "MODULES", "KernelCase", "poisoned"]
