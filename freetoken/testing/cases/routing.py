"""Parity cases of ``ops.route_softmax_topk`` and ``ops.route_sigmoid_group_topk`` (``cuda/routing.cu``)."""

from __future__ import annotations

import numpy as np

from freetoken import ops
from freetoken.testing.cases.base import KernelCase, poisoned
from freetoken.testing.reference.routing import (
    route_sigmoid_group_topk_reference,
    route_softmax_group_topk_reference,
    route_softmax_topk_reference,
)


def _make(k: int, renormalize: bool):
    def make(rng, size):
        rows, experts = (11, 60) if size == "small" else (4096, 128)  # 60 experts: not a multiple of 32
        x = (2.0 * rng.standard_normal((rows, experts))).astype(np.float32)
        x[1, :] = 0.25  # all ties: the lowest indices win
        x[2, 5:9] = np.float32(9.0)  # tied maxima
        x[3] += 80.0  # large logits: the max subtraction matters
        x[4, 7] = -np.inf  # a masked expert
        x[5, 3] = np.nan  # a NaN row: NaN weights, ranked as -inf (ids 0..k-1)
        return {"x": x, "k": k, "renormalize": renormalize}

    def setup(dev, inp):
        rows = inp["x"].shape[0]
        return {"x": dev.asarray(inp["x"]), "k": inp["k"], "renormalize": inp["renormalize"],
                "out_ids": poisoned(dev, (rows, inp["k"]), np.int32),
                "out_weights": poisoned(dev, (rows, inp["k"]), np.float32)}

    def launch(dev, st):
        ops.route_softmax_topk(st["x"], st["k"], st["renormalize"], out_ids=st["out_ids"],
                               out_weights=st["out_weights"], device=dev)

    def reference(inp):
        ids, w = route_softmax_topk_reference(inp["x"], inp["k"], inp["renormalize"])
        return {"ids": ids, "weights": w}

    return KernelCase(f"route_softmax_topk_k{k}_{'renorm' if renormalize else 'plain'}", "routing.cu", make, setup,
                      launch, reference, atol=1e-7, rtol=1e-5, bytes_moved=lambda inp: inp["x"].nbytes,
                      op="route_softmax_topk")


CASES = [_make(8, True), _make(6, False), _make(1, True)]


def _make_group(n: int, n_group: int, topk_group: int, k: int, renormalize: bool, scale: float, large: tuple):
    def make(rng, size):
        rows, experts = (13, n) if size == "small" else large
        x = (2.0 * rng.standard_normal((rows, experts))).astype(np.float32)
        bias = (0.1 * rng.standard_normal(experts)).astype(np.float32)
        x[1, :] = 0.25  # equal scores: the bias alone ranks the experts
        x[2, :experts // 2] = 30.0  # saturated scores (sigmoid 1.0 in float32): ties broken by the bias
        x[3, 5] = -np.inf  # a masked expert: score 0
        x[4, 3] = np.nan  # a NaN key, ranked as -inf: never chosen while others are in play
        x[5, :] = -np.inf  # every score 0: the bias picks
        return {"x": x, "bias": bias, "k": k, "n_group": n_group, "topk_group": topk_group,
                "renormalize": renormalize, "scale": scale}

    def setup(dev, inp):
        rows = inp["x"].shape[0]
        return {**inp, "x": dev.asarray(inp["x"]), "bias": dev.asarray(inp["bias"]),
                "out_ids": poisoned(dev, (rows, inp["k"]), np.int32),
                "out_weights": poisoned(dev, (rows, inp["k"]), np.float32)}

    def launch(dev, st):
        ops.route_sigmoid_group_topk(st["x"], st["bias"], st["k"], st["n_group"], st["topk_group"],
                                     st["renormalize"], st["scale"], out_ids=st["out_ids"],
                                     out_weights=st["out_weights"], device=dev)

    def reference(inp):
        ids, w = route_sigmoid_group_topk_reference(inp["x"], inp["bias"], inp["k"], inp["n_group"],
                                                    inp["topk_group"], inp["renormalize"], inp["scale"])
        return {"ids": ids, "weights": w}

    name = f"route_sigmoid_group_e{n}_g{n_group}of{topk_group}_k{k}_{'renorm' if renormalize else 'plain'}"
    return KernelCase(name, "routing.cu", make, setup, launch, reference, atol=1e-7, rtol=1e-5,
                      bytes_moved=lambda inp: inp["x"].nbytes, op="route_sigmoid_group_topk")


CASES += [
    # DeepSeek-V3's shape at full size (256 experts, 8 groups, 4 in play, top-8, scaled 2.5)
    _make_group(64, 8, 4, 8, True, 2.5, (4096, 256)),
    _make_group(60, 5, 2, 6, False, 1.0, (4096, 160)),  # 12 experts a group: not a multiple of 32
    _make_group(40, 1, 1, 4, True, 1.0, (4096, 128)),  # GLM-4.5: one group
    _make_group(64, 32, 3, 5, True, 1.5, (4096, 256)),  # the most groups a warp holds
]


def _make_softmax_group(n: int, n_group: int, topk_group: int, k: int, renormalize: bool, scale: float,
                        large: tuple):
    def make(rng, size):
        rows, experts = (13, n) if size == "small" else large
        x = (2.0 * rng.standard_normal((rows, experts))).astype(np.float32)
        x[1, :] = 0.25  # equal probabilities: ties to the lower group and index
        x[2, 3] = 80.0  # one expert takes all the probability: the rest are 0 and tie
        x[3, 5] = -np.inf  # a masked expert: probability 0
        x[4, 3] = np.nan  # a NaN row: every probability NaN, ranked as -inf
        return {"x": x, "k": k, "n_group": n_group, "topk_group": topk_group, "renormalize": renormalize,
                "scale": scale}

    def setup(dev, inp):
        rows = inp["x"].shape[0]
        return {**inp, "x": dev.asarray(inp["x"]), "out_ids": poisoned(dev, (rows, inp["k"]), np.int32),
                "out_weights": poisoned(dev, (rows, inp["k"]), np.float32)}

    def launch(dev, st):
        ops.route_softmax_group_topk(st["x"], st["k"], st["n_group"], st["topk_group"], st["renormalize"],
                                     st["scale"], out_ids=st["out_ids"], out_weights=st["out_weights"], device=dev)

    def reference(inp):
        ids, w = route_softmax_group_topk_reference(inp["x"], inp["k"], inp["n_group"], inp["topk_group"],
                                                    inp["renormalize"], inp["scale"])
        return {"ids": ids, "weights": w}

    name = f"route_softmax_group_e{n}_g{n_group}of{topk_group}_k{k}_{'renorm' if renormalize else 'plain'}"
    return KernelCase(name, "routing.cu", make, setup, launch, reference, atol=1e-7, rtol=1e-5,
                      bytes_moved=lambda inp: inp["x"].nbytes, op="route_softmax_group_topk")


CASES += [
    # DeepSeek-V2's shape at full size (160 experts, 8 groups, 3 in play, top-6, scaled 16), V2-Lite's greedy
    _make_softmax_group(80, 8, 3, 6, False, 16.0, (4096, 160)),
    _make_softmax_group(64, 1, 1, 6, False, 1.0, (4096, 64)),
    _make_softmax_group(60, 5, 2, 4, True, 1.0, (4096, 160)),
]
