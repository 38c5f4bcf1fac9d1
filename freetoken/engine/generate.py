"""Generation: a decoder, a tokenizer and a sampler; tokens stream out as they come."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from freetoken.engine.sampling import Sampler, SamplingParams


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    routing: list = field(default_factory=list)  # per decode step: expert ids per MoE layer (host arrays)
    prefill_routing: list = field(default_factory=list)  # the prompt's expert ids per MoE layer ([T, k] each)

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        """Tokens produced by decode steps (the first token comes from the prefill) per second."""
        return max(self.generated_tokens - 1, 0) / self.decode_seconds if self.decode_seconds else 0.0


class Model:
    """A loaded model: ``logits(ids)`` and ``generate(prompt, ...)``."""

    def __init__(self, decoder, tokenizer=None, eos_ids: Sequence[int] = ()):
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.eos_ids = set(int(i) for i in eos_ids)
        self.stats = GenerationStats()

    @property
    def config(self):
        return self.decoder.cfg

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        return self.tokenizer.decode(list(ids))

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [T, vocab] logits of a fresh sequence."""
        self.decoder.reset()
        return self.decoder.forward(np.asarray(token_ids, np.int64))

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 64, sampling: SamplingParams | None = None,
                 record_routing: bool = False) -> Iterator[int]:
        """Yield up to ``max_tokens`` new token ids (stops early at an end-of-sequence token)."""
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        sampler = Sampler(sampling)
        st = self.stats = GenerationStats(prompt_tokens=len(ids))
        self.decoder.reset()
        t0 = time.perf_counter()
        logits = self.decoder.forward(np.asarray(ids, np.int64))[-1]
        st.prefill_seconds = time.perf_counter() - t0
        if record_routing:
            st.prefill_routing = [np.asarray(self.decoder.dev.to_host(r)) for r in self.decoder.last_routing]
        history = list(ids)
        for _ in range(max_tokens):
            tok = sampler(logits, history)
            history.append(tok)
            st.generated_tokens += 1
            yield tok
            if st.generated_tokens == max_tokens or tok in self.eos_ids or self.decoder.length >= self.decoder.max_len:
                return
            t0 = time.perf_counter()
            logits = self.decoder.forward(np.array([tok], np.int64))[-1]
            st.decode_seconds += time.perf_counter() - t0
            if record_routing:
                st.routing.append([np.asarray(self.decoder.dev.to_host(r)) for r in self.decoder.last_routing])

    def generate_text(self, prompt: str, max_tokens: int = 64, sampling: SamplingParams | None = None,
                      record_routing: bool = False) -> Iterator[str]:
        """Yield text pieces as tokens come (a piece is held back while it ends in an incomplete character)."""
        out: list[int] = []
        shown = ""
        for tok in self.generate(prompt, max_tokens, sampling, record_routing):
            if tok in self.eos_ids:
                break
            out.append(tok)
            text = self.decode(out)
            if text.endswith("\ufffd"):
                continue
            yield text[len(shown):]
            shown = text
        text = self.decode(out) if out else ""
        if len(text) > len(shown):
            yield text[len(shown):]
