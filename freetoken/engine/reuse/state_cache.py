"""The linear-attention states of earlier sequences, found again by their token ids: the recurrent half of prefix
reuse for models with Gated DeltaNet layers (Qwen3-Next, Qwen3.5-MoE).

A recurrent state cannot be cut back to a shorter prefix the way the KV rows can, so a prefix is reusable only at a
length where its states were kept. The decoder keeps a few snapshots of its own sequence
(:meth:`freetoken.models.decoder.MoeDecoder.resume_points`: prompt ends, message boundaries, every few thousand tokens
of a long prompt); when that sequence is replaced (another conversation, a request that departs earlier), the
engine moves its KV blocks into the radix prefix cache (:mod:`freetoken.engine.reuse.prefix_cache`) and its states into
this cache, so a later request that shares one of those prefixes resumes there instead of prefilling from the start.

Each entry is the exact token ids of a prefix and host copies of every linear layer's conv and recurrent state at
its end (:meth:`~freetoken.models.decoder.MoeDecoder.export_states`). A lookup takes the longest entry whose tokens
are a prefix of the request (compared whole, not by hash) and that the KV rows at hand cover. Entries live in host
memory (on a GPU the device's memory is worth more as expert slots; a resume copies one state back, tens of MB for
Qwen3.5-35B-A3B, about 3 ms over PCIe), up to ``max_bytes``, least recently used first out; the newest entry always
stays, however large.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Host memory the cache may hold by default: 16 states of Qwen3.5-35B-A3B (62.8 MiB each).
DEFAULT_STATE_CACHE_BYTES = 1 << 30


@dataclass(eq=False)
class StateEntry:
    tokens: np.ndarray  # int32, the exact prefix
    arrays: dict  # name -> host float32 array (MoeDecoder.export_states)

    @property
    def length(self) -> int:
        return int(self.tokens.size)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values())


class StateCache:
    """Linear-attention states by token prefix, in host memory up to ``max_bytes`` (see the module doc)."""

    def __init__(self, max_bytes: int = DEFAULT_STATE_CACHE_BYTES):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[tuple, StateEntry] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    @staticmethod
    def _key(tokens: np.ndarray) -> tuple:
        return (int(tokens.size), hash(tokens.tobytes()))

    def lengths(self) -> list[int]:
        return sorted(e.length for e in self._entries.values())

    def has(self, tokens: Sequence[int]) -> bool:
        """Whether the states at the end of exactly ``tokens`` are kept."""
        toks = np.asarray(tokens, np.int64).astype(np.int32)
        e = self._entries.get(self._key(toks))
        return e is not None and np.array_equal(e.tokens, toks)

    def put(self, tokens: Sequence[int], arrays: dict[str, np.ndarray]) -> None:
        """Keep ``arrays`` (host copies the cache now owns) as the states at the end of ``tokens``; an entry of the
        same prefix is replaced. Then least recently used entries go until the cache is within its budget."""
        toks = np.asarray(tokens, np.int64).astype(np.int32)
        if toks.size == 0 or not arrays:
            return
        key = self._key(toks)
        self._entries.pop(key, None)
        self._entries[key] = StateEntry(toks, dict(arrays))
        while len(self._entries) > 1 and self.nbytes > self.max_bytes:
            self._entries.popitem(last=False)

    def best(self, ids: Sequence[int], limit: int) -> StateEntry | None:
        """The longest entry of at most ``limit`` tokens whose tokens are a prefix of ``ids`` (marked used), or
        None."""
        ids = np.asarray(ids, np.int64)
        found = None
        for e in self._entries.values():
            n = e.length
            if n <= limit and n <= ids.size and (found is None or n > found.length) \
                    and np.array_equal(e.tokens, ids[:n]):
                found = e
        if found is not None:
            self._entries.move_to_end(self._key(found.tokens))
        return found

    def clear(self) -> None:
        self._entries.clear()
