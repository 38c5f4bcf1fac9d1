#!/usr/bin/env python
"""Logits of the cpu reduced expert path (``--cpu-activations q8``) against the float path (``f32``) on the same
experts: the numerical cost of 8-bit expert inputs (the int8 formats) and of bf16 ones (bf16, fp8_block), one table.

    python bench/q8_logits.py                    # the bundled model exported to q4_0 GGUF, and as mxfp4 / nvfp4 /
                                                 # bf16 (as stored) / fp8_block
    python bench/q8_logits.py --model m.gguf     # any model freetoken loads (a Q4_K_M file, a block-FP8 checkpoint)

Columns: ``NMSE`` of the q8 logits against the f32 ones over a random prompt (sum of squared differences over sum
of squares), ``argmax`` the share of positions whose greedy token agrees, ``max|d|`` the largest logit change.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np


def compare(path, fmt: str | None, tokens: np.ndarray) -> tuple[float, float, float]:
    from freetoken.engine.loading.load import load

    f32 = load(path, device="cpu", expert_format=fmt, cpu_activations="f32").logits(tokens)
    q8 = load(path, device="cpu", expert_format=fmt, cpu_activations="q8").logits(tokens)
    nmse = float(((q8 - f32) ** 2).sum() / (f32**2).sum())
    return nmse, float((q8.argmax(-1) == f32.argmax(-1)).mean()), float(np.abs(q8 - f32).max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None,
                    help="a model to compare (default: the bundled one in several expert formats)")
    ap.add_argument("--tokens", type=int, default=128, help="prompt length (default 128)")
    args = ap.parse_args(argv)
    from freetoken.convert import export_gguf
    from freetoken.device.simd import bf16_dots, simd_level
    from freetoken.engine.loading.load import DEFAULT_MODEL

    rng = np.random.default_rng(0)
    tokens = rng.integers(2, 4000, args.tokens)
    if args.model is not None:
        rows = [(str(args.model), args.model, None)]
    else:
        gguf = Path(tempfile.mkdtemp(prefix="ft-q8-")) / "default-q4_0.gguf"
        export_gguf(DEFAULT_MODEL, gguf)
        rows = [("bundled, GGUF q4_0", gguf, None), ("bundled, mxfp4", DEFAULT_MODEL, "mxfp4"),
                ("bundled, nvfp4", DEFAULT_MODEL, "nvfp4"), ("bundled, bf16 (bf16 tokens)", DEFAULT_MODEL, None),
                ("bundled, fp8_block (bf16 tokens)", DEFAULT_MODEL, "fp8_block")]
    print(f"# cpu reduced path (SIMD level {simd_level()}, bf16 dots: {bf16_dots()}) vs float path, "
          f"{args.tokens}-token random prompt")
    print(f"{'model':<33} {'NMSE':>9} {'argmax':>7} {'max|d|':>8}")
    for name, path, fmt in rows:
        nmse, agree, dmax = compare(path, fmt, tokens)
        print(f"{name:<33} {nmse:9.2e} {agree:7.1%} {dmax:8.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
