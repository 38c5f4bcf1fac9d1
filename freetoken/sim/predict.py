"""Next-layer expert predictors for prefetching, run on routing traces.

A predictor names, for every admit call (decode step ``t``, MoE layer ``l``), up to ``n`` experts of layer ``l``
ranked best first, using only what is known before that call's routing: the routing of the calls before it
(layer ``l - 1`` of step ``t``; for layer 0, layer ``L - 1`` of step ``t - 1``) and earlier steps. Predictions are
arrays ``int32 [steps, layers, n]`` of expert ids (0 .. E-1, not flat ids), padded with -1.

* :func:`predict_coactivation`: cross-layer co-activation learned from the first part of the trace. For each
  transition (layer l -> l + 1, and the last layer -> layer 0 of the next step), ``P(j | i)`` is the fraction of
  the calls with expert ``i`` active at the source layer that had ``j`` active at the destination; a call's
  score for ``j`` is ``sum_i P(j | i)`` over the source call's active experts; the top ``n`` positive scores are
  predicted (ties: the lower id).
* :func:`predict_previous`: the baseline "the same experts as at this layer in the previous step" (most tokens
  first, then the lower id).
* :func:`predict_oracle`: the call's actual active set (a perfect predictor, for bounds and tests).

:func:`precision_recall` scores predictions on a window of steps: precision = correct / predicted, recall =
correct / actual, micro-averaged over the calls (an expert counts once per call however many tokens chose it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freetoken.trace.derived import active_sets, prepare, window_steps
from freetoken.trace.format import Trace


def _check_n(trace: Trace, n: int) -> int:
    n = int(n)
    if n < 1:
        raise ValueError(f"the number of predicted experts must be >= 1, got {n}")
    return min(n, trace.num_experts)


def _top_n(scores: np.ndarray, n: int) -> np.ndarray:
    """Row-wise top-n indices of ``scores`` [..., E] by descending score, ties the lower index; -1 where the score
    is not positive."""
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :n]
    top = np.take_along_axis(scores, order, -1)
    return np.where(top > 0, order, -1).astype(np.int32)


@dataclass
class CoactivationModel:
    """``prob[l, i, j]`` = P(expert j active at layer l | expert i active at the layer before l), where the layer
    before layer 0 is the last layer of the previous step."""

    prob: np.ndarray  # float64 [L, E, E]
    fit_steps: tuple[int, int]


def fit_coactivation(trace: Trace, fit_steps: tuple[int, int] | None = None) -> CoactivationModel:
    """Learn the transition probabilities from the calls of steps [t0, t1) (default the first half)."""
    t0, t1 = (0, trace.steps // 2) if fit_steps is None else (int(fit_steps[0]), int(fit_steps[1]))
    if not 0 <= t0 <= t1 <= trace.steps:
        raise ValueError(f"fit_steps must satisfy 0 <= t0 <= t1 <= steps ({trace.steps}), got {fit_steps}")
    act, _ = active_sets(trace)
    L, E = trace.num_layers, trace.num_experts
    prob = np.zeros((L, E, E))
    a = act[t0:t1]  # [S, L, E]
    for layer in range(L):
        if layer > 0:
            src, dst = a[:, layer - 1].astype(np.float64), a[:, layer].astype(np.float64)
        else:  # the last layer of step t -> layer 0 of step t + 1
            src, dst = a[:-1, L - 1].astype(np.float64), a[1:, 0].astype(np.float64)
        cnt = src.T @ dst  # [E, E]
        tot = src.sum(0)[:, None]
        np.divide(cnt, tot, out=prob[layer], where=tot > 0)
    return CoactivationModel(prob=prob, fit_steps=(t0, t1))


def predict_coactivation(trace: Trace, n: int, fit_steps: tuple[int, int] | None = None,
                         model: CoactivationModel | None = None) -> np.ndarray:
    """Top-``n`` co-activation predictions ``int32 [steps, L, n]`` (see the module docstring); learned on
    ``fit_steps`` (default the first half) unless ``model`` is given."""
    n = _check_n(trace, n)
    model = fit_coactivation(trace, fit_steps) if model is None else model
    act, _ = active_sets(trace)
    steps, L = trace.steps, trace.num_layers
    out = np.full((steps, L, n), -1, np.int32)
    for layer in range(L):
        if layer > 0:
            out[:, layer] = _top_n(act[:, layer - 1].astype(np.float64) @ model.prob[layer], n)
        elif steps > 1:
            out[1:, 0] = _top_n(act[:-1, L - 1].astype(np.float64) @ model.prob[0], n)
    return out


def predict_previous(trace: Trace, n: int) -> np.ndarray:
    """Predict each call's experts as the previous step's at the same layer (most tokens first, then lower id)."""
    n = _check_n(trace, n)
    _, tok = active_sets(trace)
    out = np.full((trace.steps, trace.num_layers, n), -1, np.int32)
    for layer in range(trace.num_layers):
        if trace.steps > 1:
            out[1:, layer] = _top_n(tok[:-1, layer].astype(np.float64), n)
    return out


def predict_oracle(trace: Trace, n: int | None = None) -> np.ndarray:
    """The actual active set of each call (most tokens first, then lower id); ``n`` defaults to the largest."""
    _, tok = active_sets(trace)
    n = _check_n(trace, prepare(trace).max_active or 1) if n is None else _check_n(trace, n)
    out = np.full((trace.steps, trace.num_layers, n), -1, np.int32)
    for layer in range(trace.num_layers):
        out[:, layer] = _top_n(tok[:, layer].astype(np.float64), n)
    return out


PREDICTORS = {"coact": predict_coactivation, "prev": predict_previous, "oracle": predict_oracle}


def predictions(trace: Trace, predictor: str, n: int) -> np.ndarray:
    """Predictions of the named predictor (:data:`PREDICTORS`), ``n`` per call."""
    if predictor not in PREDICTORS:
        raise ValueError(f"unknown predictor {predictor!r} (known: {', '.join(PREDICTORS)})")
    return PREDICTORS[predictor](trace, n)


@dataclass
class PredictorScore:
    predicted: int  # predicted experts (not counting the -1 padding)
    actual: int  # active experts
    correct: int  # predicted and active

    @property
    def precision(self) -> float:
        return self.correct / self.predicted if self.predicted else 0.0

    @property
    def recall(self) -> float:
        return self.correct / self.actual if self.actual else 0.0


def precision_recall(trace: Trace, pred: np.ndarray, window: str | tuple[int, int] = "second_half") -> PredictorScore:
    """Score ``pred`` (``int32 [steps, L, n]``, -1 padded) against the trace over a window of steps: ``"all"``,
    ``"second_half"`` or ``(t0, t1)``."""
    t0, t1 = window_steps(trace, window) if isinstance(window, str) else (int(window[0]), int(window[1]))
    pred = np.asarray(pred)
    if pred.ndim != 3 or pred.shape[:2] != (trace.steps, trace.num_layers):
        raise ValueError(f"predictions must have shape [steps={trace.steps}, layers={trace.num_layers}, n], "
                         f"got {pred.shape}")
    act, _ = active_sets(trace)
    p = pred[t0:t1].astype(np.int64)
    a = act[t0:t1]
    valid = p >= 0
    hit = np.take_along_axis(a, np.where(valid, p, 0), -1) & valid
    return PredictorScore(predicted=int(valid.sum()), actual=int(a.sum()), correct=int(hit.sum()))
