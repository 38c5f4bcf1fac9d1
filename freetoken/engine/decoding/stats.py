"""What one generation returns: :class:`GenerationStats` (its result, filled in as it runs) and
:class:`Generation` (its items as they come, with those stats)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0  # prompt tokens prefilled by this call
    cached_tokens: int = 0  # prompt tokens whose K/V rows were reused from the previous call (``reuse_cache``)
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    routing: list = field(default_factory=list)  # per decode step: expert ids per MoE layer (host arrays)
    prefill_routing: list = field(default_factory=list)  # the prompt's expert ids per MoE layer ([T, k] each)
    #: why generation ended: "stop" (an end-of-sequence token or a stop string), "length" (``max_tokens``),
    #: "context" (the context is full); None while running or when the caller closed the iterator early
    finish_reason: str | None = None
    #: the stop string of ``generate_text`` that ended the text (None: none did, an end-of-sequence token, say)
    stop_sequence: str | None = None
    #: the anchor the prompt's start was restored from (its id), and why one was refused (then recomputed)
    anchor: str | None = None
    anchor_refused: str | None = None
    #: ids of the anchors made at this call's ``boundaries``
    anchors_made: list = field(default_factory=list)

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        """Tokens produced by decode steps (the first token comes from the prefill) per second."""
        return max(self.generated_tokens - 1, 0) / self.decode_seconds if self.decode_seconds else 0.0


class Generation(Iterator):
    """One generation as it runs: iterate it for its items (token ids from :meth:`Model.generate`, text pieces from
    :meth:`Model.generate_text`) as they come; ``stats`` (:class:`GenerationStats`) is its result, filled in as it
    runs and final once the iteration has ended (or :meth:`close` stopped it early)."""

    def __init__(self, items: Iterator, stats: GenerationStats):
        self._items, self.stats = items, stats

    def __next__(self):
        return next(self._items)

    def close(self) -> None:
        """Stop here (the decoder keeps exactly the tokens it ran)."""
        self._items.close()
