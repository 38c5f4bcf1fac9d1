"""Next-token sampling from logits on the host: greedy, temperature, top-k, top-p, repetition penalty, logit bias,
a seed.

The order follows the common convention (and HF's logits processors): a grammar's mask, then the logit bias (OpenAI's
``logit_bias``: added to the raw logits, -100 bans a token, +100 all but forces it), then repetition penalty, then
temperature, then top-k, then top-p (nucleus) on the remaining probability mass. ``temperature == 0`` is greedy.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    #: (token id, bias) pairs added to those tokens' logits before anything but the grammar
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for tok, bias in self.logit_bias:
            if tok < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: token {tok} with bias {bias} (ids >= 0, biases in [-100, 100])")


class Sampler:
    """Draws tokens with :class:`SamplingParams`; the same seed gives the same sequence.

    ``constraint`` (a :class:`freetoken.engine.decoding.grammar.TokenConstraint`): only the tokens its grammar allows
    can be drawn (the others' logits become -inf before anything else), and each drawn token advances it."""

    def __init__(self, params: SamplingParams | None = None, constraint=None):
        self.params = params or SamplingParams()
        self.rng = np.random.default_rng(self.params.seed)
        self.constraint = constraint

    def __call__(self, logits: np.ndarray, previous: Iterable[int] = ()) -> int:
        tok = self._draw(logits, previous)
        if self.constraint is not None:
            self.constraint.consume(tok)
        return tok

    def _draw(self, logits: np.ndarray, previous: Iterable[int]) -> int:
        p = self.params
        z = np.asarray(logits, np.float64).copy()
        if z.ndim != 1:
            raise ValueError(f"logits must be one row [vocab], got shape {z.shape}")
        if self.constraint is not None:
            allowed = self.constraint.allowed()
            if not allowed.any():
                raise ValueError("the output grammar allows no token here")
            z[:allowed.size][~allowed] = -np.inf
            z[allowed.size:] = -np.inf
        for tok, bias in p.logit_bias:
            z[tok] += bias
        if p.repetition_penalty != 1.0:
            seen = np.unique(np.fromiter(previous, dtype=np.int64))
            if seen.size:
                vals = z[seen]
                z[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.temperature == 0.0:
            return int(np.argmax(z))
        z /= p.temperature
        if 0 < p.top_k < z.size:
            kth = np.partition(z, -p.top_k)[-p.top_k]
            z[z < kth] = -np.inf
        z -= z.max()
        probs = np.exp(z)
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            keep = cum - probs[order] < p.top_p  # the smallest prefix whose mass reaches top_p
            drop = order[~keep]
            probs[drop] = 0.0
            probs /= probs.sum()
        return int(self.rng.choice(probs.size, p=probs))
