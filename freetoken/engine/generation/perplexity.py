"""Perplexity of a model on a text, as llama.cpp's perplexity tool measures it: the text's tokens cut into chunks
of ``ctx`` tokens, each run as a fresh sequence, and the log-likelihood of the second half of each chunk's tokens
summed (the first half is context, so every scored token sees at least ctx/2 tokens before it)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Perplexity:
    nll: float  # mean negative log-likelihood per scored token (nats)
    stderr: float  # its standard error over the scored tokens
    tokens: int  # scored tokens
    chunks: int
    ctx: int
    #: -log p of every scored token, in order (two runs on the same text compare token by token: a paired error)
    per_token: np.ndarray = field(default=None, repr=False)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    def line(self) -> str:
        lo, hi = math.exp(self.nll - self.stderr), math.exp(self.nll + self.stderr)
        return (f"perplexity {self.ppl:.4f} (nll {self.nll:.4f} +- {self.stderr:.4f} nats/token, ppl {lo:.3f}.."
                f"{hi:.3f}) over {self.tokens} tokens: {self.chunks} chunks of {self.ctx}, scoring the second half "
                "of each")


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log p(target) per row of float32 logits [T, V] (log-softmax in float64)."""
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))
    return lse - x[np.arange(len(targets)), targets]


def perplexity(model, ids: list[int] | np.ndarray, ctx: int = 512, max_chunks: int | None = None,
               progress: Callable[[int, int, float], None] | None = None) -> Perplexity:
    """The perplexity of ``model`` (a :class:`freetoken.engine.generation.generate.Model`) on token ids ``ids``;
    ``progress`` is called after each chunk with (chunks done, chunks, running perplexity)."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    if ctx < 2:
        raise ValueError(f"ctx must be at least 2 tokens, got {ctx}")
    if ctx > model.decoder.ctx:
        raise ValueError(f"ctx {ctx} is longer than the model's context ({model.decoder.ctx}; --ctx raises it)")
    chunks = len(ids) // ctx
    if max_chunks is not None:
        chunks = min(chunks, max_chunks)
    if chunks < 1:
        raise ValueError(f"the text is {len(ids)} tokens, shorter than one chunk of {ctx}")
    first = ctx // 2
    nll = []
    for c in range(chunks):
        chunk = ids[c * ctx:(c + 1) * ctx]
        logits = model.logits(chunk)
        nll.append(token_nll(logits[first - 1:ctx - 1], chunk[first:]))
        if progress is not None:
            progress(c + 1, chunks, math.exp(float(np.concatenate(nll).mean())))
    all_nll = np.concatenate(nll)
    se = float(all_nll.std(ddof=1) / math.sqrt(len(all_nll))) if len(all_nll) > 1 else 0.0
    return Perplexity(float(all_nll.mean()), se, len(all_nll), chunks, ctx, all_nll)
