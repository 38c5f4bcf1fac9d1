"""Parity cases of every op, one module per op (each defines ``CASES``): inputs, the NumPy reference
(``freetoken.testing.reference``), tolerance and bytes moved. One registry serves the test suite (small, awkward
shapes on cpu / emu / gpu: tests/test_kernel_parity.py) and ``bench/gpu_check`` (large shapes on the GPU, timed);
``freetoken.ops.OPS`` names each op's case module."""

from __future__ import annotations

from importlib import import_module

from freetoken.testing.cases.base import KernelCase, poisoned

MODULES = ("reduce", "topk", "histogram", "transpose", "attention", "dense", "rms_norm", "rope", "routing",
           "moe_experts", "cache")

CASES: list[KernelCase] = [c for m in MODULES for c in import_module(f"freetoken.testing.cases.{m}").CASES]

__all__ = ["CASES", "MODULES", "KernelCase", "poisoned"]
