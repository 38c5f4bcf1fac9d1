"""Next-layer prefetch (``--prefetch``): while MoE layer m computes, the experts that layer m+1's router picks for
layer m's MLP input are copied in on the transfer stream (the actual input of layer m+1 differs only by layer m's
output, so the prediction is often right). A prefetch admission is not counted in the cache's hit/miss statistics.

:class:`NextLayerPrefetch` holds the predictor, scores it against the routing that follows (precision / recall) and
turns prefetching off for a target layer whose predictions do not pay; the expert runner does the admissions.
"""

from __future__ import annotations

import numpy as np

#: Prefetch stays on for a layer while its predictions are at least this precise (after MIN_SAMPLES predicted
#: experts): below it the wasted copies and evictions outweigh the hits.
MIN_PRECISION = 0.3
MIN_SAMPLES = 64


class NextLayerPrefetch:
    """``predict(layer, h) -> (ids, weights)``: the routing of MoE layer ``layer`` for hidden states ``h``."""

    def __init__(self, device, num_layers: int, predict):
        self.dev, self.num_layers, self.predict_fn = device, num_layers, predict
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"predicted": 0, "correct": 0, "actual": 0}
        self._layer_stats = np.zeros((self.num_layers, 2), np.int64)  # per target layer: predicted, correct
        self.off: list[int] = []  # target layers whose predictions did not pay (MIN_PRECISION)
        self._predicted: dict[int, np.ndarray] = {}

    def forget(self) -> None:
        """Predictions never cross a forward pass."""
        self._predicted.clear()

    def predict(self, layer: int, h):
        """(device ids ``[T, k]``, the same on the host) predicted for MoE layer ``layer + 1`` from layer
        ``layer``'s input ``h``, or None when there is no next layer or its prefetch is off. The prediction is kept
        to be scored."""
        target = layer + 1
        if target >= self.num_layers or target in self.off:
            return None
        pred, _ = self.predict_fn(target, h)
        host = np.array(self.dev.to_host(pred))  # a copy: admission rewrites ids in place
        self._predicted[target] = host
        return pred, host

    def score(self, layer: int, ids) -> None:
        """Precision/recall of the prediction made for ``layer`` against its routed ``ids``."""
        pred = self._predicted.pop(layer, None)
        if pred is None:
            return
        actual = np.asarray(self.dev.to_host(ids))
        for p_row, a_row in zip(pred, actual, strict=True):
            ps, a_set = set(p_row.tolist()), set(a_row.tolist())
            self.stats["predicted"] += len(ps)
            self.stats["actual"] += len(a_set)
            self.stats["correct"] += len(ps & a_set)
            self._layer_stats[layer] += (len(ps), len(ps & a_set))
        # a wrong prediction spends PCIe time and evicts a resident expert: stop where precision stays too low
        predicted, correct = self._layer_stats[layer]
        if predicted >= MIN_SAMPLES and correct < MIN_PRECISION * predicted:
            self.off.append(layer)

    def report(self) -> str:
        parts = []
        ps = self.stats
        if ps["predicted"]:
            parts.append(f"prefetch precision {ps['correct'] / ps['predicted']:.0%}, recall "
                         f"{ps['correct'] / max(ps['actual'], 1):.0%}")
        if self.off:
            parts.append(f"prefetch turned off for MoE layers {sorted(self.off)} (too imprecise to pay)")
        return "; ".join(parts)
