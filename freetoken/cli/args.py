"""Flags shared by the commands that run a model (``run``, ``chat``): model, device, sampling, cache slots."""

from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser, max_tokens: int, what: str) -> None:
    """--model, --device, --max-tokens (default ``max_tokens``; ``what`` says per what), sampling, --cache-slots."""
    p.add_argument("--model", default=None, help="HF model directory or GGUF file (default: the bundled model)")
    p.add_argument("--device", default="auto", choices=["auto", "gpu", "cpu", "emu"],
                   help="where to run (auto: gpu when present, else cpu)")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens {what} at most (default {max_tokens})")
    p.add_argument("--temperature", type=float, default=0.7, help="0 is greedy (default 0.7)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="penalise repeats (default 1.0: off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    p.add_argument("--cache-slots", type=int, default=None,
                   help="gpu/emu: device slots of the expert cache (default: room for every expert)")
