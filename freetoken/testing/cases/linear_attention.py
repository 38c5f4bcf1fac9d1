"""Parity cases of ``ops.short_conv`` and ``ops.gated_delta_rule`` (``cuda/linear_attention.cu``): the output and the
updated state (an "out_state" buffer initialised from the input state) against the float64 reference.

Large shapes are Qwen3.5-35B-A3B's linear-attention layers: Hk = 16, Hv = 32, Dk = Dv = 128, so the convolution runs
over C = 2 * 16 * 128 + 32 * 128 = 8192 channels with K = 4 taps; a decode step (T = 1) and prompts (T = 512, 4096).

On gpu/emu ``gated_delta_rule`` runs its recurrent kernel below ``LINEAR_CHUNKED_MIN_TOKENS`` (64) tokens and the
chunked (WY) form from there on: the ``gated_delta_chunked*`` cases (and ``gated_delta_prefill``'s large shape) take
the chunked form, the others the recurrent one; the cpu device runs its recurrent kernel on all of them.
"""

from __future__ import annotations

import numpy as np

from freetoken import ops
from freetoken.testing.cases.base import KernelCase, poisoned
from freetoken.testing.reference.linear_attention import (
    gated_delta_rule_batch_reference,
    gated_delta_rule_reference,
    short_conv_batch_reference,
    short_conv_reference,
)

QWEN35 = {"hk": 16, "hv": 32, "dk": 128, "dv": 128}
QWEN35_CHANNELS = 2 * 16 * 128 + 32 * 128


# ---- short_conv ---------------------------------------------------------------------------------------------------
def _conv_case(name: str, small: tuple[int, int, int], large: tuple[int, int, int]) -> KernelCase:
    """small / large: (T, C, K)."""

    def make(rng, size):
        t, c, k = small if size == "small" else large
        return {"x": rng.standard_normal((t, c), dtype=np.float32),
                "w": (0.5 * rng.standard_normal((c, k))).astype(np.float32),
                "state": rng.standard_normal((k - 1, c), dtype=np.float32)}

    def setup(dev, inp):
        return {"x": dev.asarray(inp["x"]), "w": dev.asarray(inp["w"]), "out_state": dev.asarray(inp["state"].copy()),
                "out_y": poisoned(dev, inp["x"].shape, np.float32)}

    def launch(dev, st):
        ops.short_conv(st["x"], st["w"], st["out_state"], out=st["out_y"], device=dev)

    def reference(inp):
        y, s = short_conv_reference(inp["x"], inp["w"], inp["state"])
        return {"y": y, "state": s}

    return KernelCase(name, "linear_attention.cu", make, setup, launch, reference, atol=1e-6, rtol=1e-6,
                      bytes_moved=lambda inp: 2 * inp["x"].nbytes + 2 * inp["state"].nbytes + inp["w"].nbytes,
                      flops=lambda inp: 2 * inp["x"].size * inp["w"].shape[1], op="short_conv")


CONV_CASES = [
    _conv_case("short_conv_decode", (1, 150, 4), (1, QWEN35_CHANNELS, 4)),  # fewer tokens than state rows
    _conv_case("short_conv_short", (7, 40, 8), (7, QWEN35_CHANNELS, 4)),  # T = K - 1 (the most taps)
    _conv_case("short_conv_prefill", (33, 70, 2), (512, QWEN35_CHANNELS, 4)),  # the cpu kernel's threaded rows
]


# ---- gated_delta_rule ---------------------------------------------------------------------------------------------
def _rule_case(name: str, small: dict, large: dict, atol: float, rel_atol: float) -> KernelCase:
    """small / large: {"t", "hk", "hv", "dk", "dv"}."""

    def make(rng, size):
        p = small if size == "small" else large
        t, hk, hv, dk, dv = p["t"], p["hk"], p["hv"], p["dk"], p["dv"]
        qkv = rng.standard_normal((t, 2 * hk * dk + hv * dv), dtype=np.float32)
        qkv[0, hk * dk:(hk + 1) * dk] *= np.float32(1e-4)  # a near-zero key (|k|^2 ~ eps): the l2norm's eps matters
        qkv[-1, :dk] *= np.float32(1e-4)  # and a near-zero query
        return {"qkv": qkv, "g": rng.uniform(-3.0, 0.0, (t, hv)).astype(np.float32),
                "beta": rng.uniform(0.02, 0.98, (t, hv)).astype(np.float32),
                "state": (0.5 * rng.standard_normal((hv, dk, dv))).astype(np.float32), "hk": hk}

    def setup(dev, inp):
        t, (hv, _, dv) = inp["qkv"].shape[0], inp["state"].shape
        return {"qkv": dev.asarray(inp["qkv"]), "g": dev.asarray(inp["g"]), "beta": dev.asarray(inp["beta"]),
                "out_state": dev.asarray(inp["state"].copy()), "hk": inp["hk"],
                "out_o": poisoned(dev, (t, hv, dv), np.float32)}

    def launch(dev, st):
        ops.gated_delta_rule(st["qkv"], st["g"], st["beta"], st["out_state"], st["hk"], out=st["out_o"], device=dev)

    def reference(inp):
        o, s = gated_delta_rule_reference(inp["qkv"], inp["g"], inp["beta"], inp["state"], inp["hk"])
        return {"o": o, "state": s}

    def bytes_moved(inp):
        t, (hv, _, dv) = inp["qkv"].shape[0], inp["state"].shape
        return inp["qkv"].nbytes + inp["g"].nbytes + inp["beta"].nbytes + 2 * inp["state"].nbytes + 4 * t * hv * dv

    return KernelCase(name, "linear_attention.cu", make, setup, launch, reference, atol=atol, rel_atol=rel_atol,
                      bytes_moved=bytes_moved, flops=lambda inp: 6 * inp["qkv"].shape[0] * inp["state"].size,
                      op="gated_delta_rule")


RULE_CASES = [
    # GQA (2 value heads a key head), Dv not a multiple of the CUDA block's 32 columns
    _rule_case("gated_delta_decode", {"t": 1, "hk": 2, "hv": 4, "dk": 16, "dv": 24}, {"t": 1, **QWEN35},
               atol=2e-7, rel_atol=2e-7),
    # Hk = Hv, a prompt of 33 tokens
    _rule_case("gated_delta_prefill", {"t": 33, "hk": 3, "hv": 3, "dk": 24, "dv": 16}, {"t": 512, **QWEN35},
               atol=2e-7, rel_atol=2e-7),
    # Qwen's head dims (Dv over several CUDA blocks), few tokens
    _rule_case("gated_delta_heads128", {"t": 7, "hk": 1, "hv": 2, "dk": 128, "dv": 128}, {"t": 7, **QWEN35},
               atol=2e-7, rel_atol=2e-7),
    # the largest head dims the kernels take (LINEAR_MAX_HEAD_DIM), Dv not a multiple of 32
    _rule_case("gated_delta_max_dims", {"t": 3, "hk": 1, "hv": 1, "dk": 256, "dv": 200},
               {"t": 3, "hk": 2, "hv": 4, "dk": 256, "dv": 256}, atol=2e-7, rel_atol=2e-7),
    # ---- the chunked form (T >= 64 on gpu/emu). Small shapes stay a few chunks of small heads: the emulator runs
    # them in well under a second each. Its error against the float64 reference is the recurrent kernel's (2e-7 ..
    # 7e-7 of the largest output on emu, up to Dk = 256); the tolerances are the recurrent cases'.
    # three chunks, the last partial (150 = 2 * 64 + 22); GQA (2 value heads a key head); Dk != Dv, Dv not a
    # multiple of the scan's 16 state columns
    _rule_case("gated_delta_chunked", {"t": 150, "hk": 2, "hv": 4, "dk": 24, "dv": 20}, {"t": 512, **QWEN35},
               atol=2e-7, rel_atol=2e-7),
    # exactly one chunk (the threshold), 3 value heads a key head, Dk > the prep kernel's 32-dim tile and not a
    # multiple of it, Dv < 16
    _rule_case("gated_delta_chunked_one", {"t": 64, "hk": 1, "hv": 3, "dk": 40, "dv": 8}, {"t": 4096, **QWEN35},
               atol=2e-7, rel_atol=2e-7),
    # the largest head dims (the scan's 256 x 16 state columns in shared memory, 4 tiles of its update), one full
    # chunk and a 6-token one
    _rule_case("gated_delta_chunked_max_dims", {"t": 70, "hk": 1, "hv": 1, "dk": 256, "dv": 200},
               {"t": 512, "hk": 2, "hv": 4, "dk": 256, "dv": 256}, atol=2e-7, rel_atol=2e-7),
]


# ---- the batch twins (continuous batching): several sequences' rows in one call, each on its state in a pool -----
# Each case's pool holds more states than the batch uses (the others must come out unchanged) and the slots are out
# of order. "batch": (slots, counts) of the small shape; the large shape is 16 decode steps of Qwen3.5's layer.
def _conv_batch_case(name: str, channels: int, taps: int, slots: tuple, counts: tuple, pool: int) -> KernelCase:
    def make(rng, size):
        sl, ct, n, c, k = (slots, counts, pool, channels, taps) if size == "small" else (
            tuple(range(15, -1, -1)), (1,) * 16, 16, QWEN35_CHANNELS, 4)
        return {"x": rng.standard_normal((sum(ct), c), dtype=np.float32),
                "w": (0.5 * rng.standard_normal((c, k))).astype(np.float32),
                "states": rng.standard_normal((n, k - 1, c), dtype=np.float32), "slots": sl, "counts": ct}

    def setup(dev, inp):
        return {"x": dev.asarray(inp["x"]), "w": dev.asarray(inp["w"]), "out_states": dev.asarray(inp["states"].copy()),
                "batch": ops.StateBatch(inp["slots"], inp["counts"], device=dev),
                "out_y": poisoned(dev, inp["x"].shape, np.float32)}

    def launch(dev, st):
        ops.short_conv_batch(st["x"], st["w"], st["out_states"], st["batch"], out=st["out_y"], device=dev)

    def reference(inp):
        y, s = short_conv_batch_reference(inp["x"], inp["w"], inp["states"], inp["slots"], inp["counts"])
        return {"y": y, "states": s}

    return KernelCase(name, "linear_attention.cu", make, setup, launch, reference, atol=1e-6, rtol=1e-6,
                      bytes_moved=lambda inp: 2 * inp["x"].nbytes + 2 * inp["states"][0].nbytes * len(inp["slots"]),
                      flops=lambda inp: 2 * inp["x"].size * inp["w"].shape[1], op="short_conv_batch")


def _rule_batch_case(name: str, dims: dict, slots: tuple, counts: tuple, pool: int) -> KernelCase:
    def make(rng, size):
        p, sl, ct, n = (dims, slots, counts, pool) if size == "small" else (
            QWEN35, tuple(range(15, -1, -1)), (1,) * 16, 16)
        t, hk, hv, dk, dv = sum(ct), p["hk"], p["hv"], p["dk"], p["dv"]
        return {"qkv": rng.standard_normal((t, 2 * hk * dk + hv * dv), dtype=np.float32),
                "g": rng.uniform(-3.0, 0.0, (t, hv)).astype(np.float32),
                "beta": rng.uniform(0.02, 0.98, (t, hv)).astype(np.float32),
                "states": (0.5 * rng.standard_normal((n, hv, dk, dv))).astype(np.float32), "hk": hk,
                "slots": sl, "counts": ct}

    def setup(dev, inp):
        t, (_, hv, _, dv) = inp["qkv"].shape[0], inp["states"].shape
        return {"qkv": dev.asarray(inp["qkv"]), "g": dev.asarray(inp["g"]), "beta": dev.asarray(inp["beta"]),
                "out_states": dev.asarray(inp["states"].copy()), "hk": inp["hk"],
                "batch": ops.StateBatch(inp["slots"], inp["counts"], device=dev),
                "out_o": poisoned(dev, (t, hv, dv), np.float32)}

    def launch(dev, st):
        ops.gated_delta_rule_batch(st["qkv"], st["g"], st["beta"], st["out_states"], st["hk"], st["batch"],
                                   out=st["out_o"], device=dev)

    def reference(inp):
        o, s = gated_delta_rule_batch_reference(inp["qkv"], inp["g"], inp["beta"], inp["states"], inp["hk"],
                                                inp["slots"], inp["counts"])
        return {"o": o, "states": s}

    def bytes_moved(inp):
        t, (_, hv, _, dv) = inp["qkv"].shape[0], inp["states"].shape
        return (inp["qkv"].nbytes + inp["g"].nbytes + inp["beta"].nbytes + 4 * t * hv * dv
                + 2 * inp["states"][0].nbytes * len(inp["slots"]))

    return KernelCase(name, "linear_attention.cu", make, setup, launch, reference, atol=2e-7, rel_atol=2e-7,
                      bytes_moved=bytes_moved, flops=lambda inp: 6 * inp["qkv"].shape[0] * inp["states"][0].size,
                      op="gated_delta_rule_batch")


BATCH_CASES = [
    # decode steps beside a 20-row prompt chunk (the cpu convolution's threaded single kernel) and a 3-row one
    _conv_batch_case("short_conv_batch_mixed", 150, 4, slots=(3, 0, 4, 1), counts=(1, 20, 3, 1), pool=6),
    # two taps (a state of one row), decode steps only
    _conv_batch_case("short_conv_batch_decode", 40, 2, slots=(2, 0, 1), counts=(1, 1, 1), pool=4),
    # decode steps and a 70-row prompt chunk (the chunked form on gpu/emu, on its own state) and a 5-row one; GQA,
    # Dv not a multiple of the CUDA block's 32 columns
    _rule_batch_case("gated_delta_batch_mixed", {"hk": 2, "hv": 4, "dk": 16, "dv": 24}, slots=(2, 5, 0, 3),
                     counts=(1, 70, 5, 1), pool=6),
    # Qwen's head dims (Dv over several CUDA blocks), decode steps only
    _rule_batch_case("gated_delta_batch_decode", {"hk": 1, "hv": 2, "dk": 128, "dv": 128}, slots=(1, 3, 0),
                     counts=(1, 1, 1), pool=4),
]

CASES = CONV_CASES + RULE_CASES + BATCH_CASES
