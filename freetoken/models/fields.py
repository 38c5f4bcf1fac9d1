"""Typed, range-checked reads of config fields (HF ``config.json`` keys, GGUF metadata values).

Every size is a whole number in a sane range, every float finite and in range, every flag a boolean, before any
array is allocated: a downloaded file with ``num_hidden_layers: 1.5``, ``1e308``, ``"12"``, ``NaN`` or ``-2**63``
is refused with a message naming the file, the field, the value and what was expected (``ConfigError``), never
run, looped over or allocated.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

#: Upper bounds far above any real model (DeepSeek-V3: hidden 7168, 61 layers, 256 experts, 129k vocabulary;
#: 10M-token contexts exist) and far below what would allocate terabytes or loop for hours.
MAX_HIDDEN = 1 << 17
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_EXPERTS = 1 << 14
MAX_INTERMEDIATE = 1 << 20
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 28


class ConfigError(ValueError):
    """A config freetoken cannot run: unknown architecture or a missing/invalid field (named)."""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Fields:
    """Reads fields of one config (``get(name) -> value or None``), naming ``where`` (the file) in errors."""

    def __init__(self, get: Callable[[str], Any], where: str, kind: str = "field"):
        self.get, self.where, self.kind = get, where, kind

    def _raw(self, names: tuple[str, ...]):
        for n in names:
            v = self.get(n)
            if v is not None:
                return n, v
        return names[0], None

    def fail(self, name: str, value, expected: str):
        raise ConfigError(f"{self.where}: {self.kind} {name!r} = {_show(value)}: expected {expected}")

    def missing(self, name: str):
        raise ConfigError(f"{self.where}: missing {self.kind} {name!r}")

    def int(self, *names: str, default: int | None = None, lo: int = 1, hi: int = MAX_HIDDEN) -> int:
        """A whole number in ``[lo, hi]`` (an integral float such as ``2.0`` is accepted; ``1.5`` is not)."""
        name, v = self._raw(names)
        if v is None:
            if default is None:
                self.missing(name)
            return default
        return self.whole(name, v, lo, hi)

    def whole(self, name: str, v, lo: int, hi: int) -> int:
        """``v`` (the value of ``name``) as a whole number in ``[lo, hi]``."""
        ok = not isinstance(v, bool) and isinstance(v, (int, float))
        if ok and isinstance(v, float):
            ok = math.isfinite(v) and v == int(v)
        if not ok or not lo <= v <= hi:
            self.fail(name, v, f"a whole number in [{lo}, {hi}]")
        return int(v)

    def float(self, *names: str, default: float | None = None, lo: float = 0.0, hi: float = math.inf,
              lo_open: bool = True) -> float:
        """A finite number in ``(lo, hi]`` (``[lo, hi]`` when not ``lo_open``)."""
        name, v = self._raw(names)
        if v is None:
            if default is None:
                self.missing(name)
            return default
        bound = f"a finite number {'>' if lo_open else '>='} {lo:g}" + (f" and <= {hi:g}" if hi < math.inf else "")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(name, v, bound)
        try:
            f = float(v)
        except OverflowError:
            self.fail(name, v, bound)
        if not (math.isfinite(f) and (f > lo if lo_open else f >= lo) and f <= hi):
            self.fail(name, v, bound)
        return f

    def bool(self, name: str, default: bool) -> bool:
        v = self.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
            return bool(v)
        self.fail(name, v, "true or false")

    def str(self, name: str, default: str | None = None) -> str | None:
        v = self.get(name)
        if v is None:
            return default
        if not isinstance(v, str):
            self.fail(name, v, "a string")
        return v

    def int_list(self, name: str, lo: int, hi: int) -> list[int]:
        """A list (possibly empty) of whole numbers in ``[lo, hi]``."""
        v = self.get(name)
        if v is None:
            return []
        if not isinstance(v, (list, tuple)) or len(v) > hi - lo + 1:
            self.fail(name, v, f"a list of whole numbers in [{lo}, {hi}]")
        return [self.whole(f"{name}[{i}]", x, lo, hi) for i, x in enumerate(v)]

    def dict(self, name: str) -> dict | None:
        v = self.get(name)
        if v is not None and not isinstance(v, dict):
            self.fail(name, v, "an object")
        return v
