"""Parity cases of ``ops.route_softmax_topk`` (``cuda/routing.cu``)."""

from __future__ import annotations

import numpy as np

from freetoken import ops
from freetoken.testing.cases.base import KernelCase, poisoned
from freetoken.testing.reference.routing import route_softmax_topk_reference


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
