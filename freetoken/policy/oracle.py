"""The bandwidth oracle: what PCIe copies and the CPU executor are achieving right now.

Every copy of missed records (timed with events on the transfer stream) and every CPU-executor call (timed on
the worker) adds a sample ``(bytes, seconds)``. The estimate is the median rate of the samples of the last
``window_s`` seconds of wall time, so single outliers (a page fault, a preempted worker, a copy that queued
behind a prefill) do not move it, while a sustained change (another process saturating PCIe or memory) owns the
window's majority after ``window_s / 2`` and the estimate follows: with the default 0.2 s window a change is
picked up within 0.1-0.2 s of decoding, inside the 300 ms the issue asks for. Before the window holds
``min_samples`` samples the estimate falls back to the longer history, then to the prior (a stored profile or
a default), so the first steps are not decided on one sample.

``inject(...)`` pins an estimate to a given figure: the emu and cpu devices have no PCIe, so tests and
``--pcie/--cpu`` overrides feed figures in; a pinned figure is never replaced by measurements.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from freetoken.policy.qstar import DEFAULT_CPU_HANDOFF_S

GB = 1e9


@dataclass
class RollingRate:
    """Median bytes/s over a sliding time window, with a prior and change detection."""

    prior: float | None = None  # bytes/s used until enough samples exist
    window_s: float = 0.2
    min_samples: int = 5
    history: int = 512  # samples kept for the fallback estimate
    change_ratio: float = 1.3  # a window median this far from the previous window's is a change
    clock: Callable[[], float] = time.monotonic
    pinned: float | None = None
    _samples: deque = field(default_factory=deque)  # (time, rate)
    _last_window: float | None = None
    changes: list = field(default_factory=list)  # (time, old rate, new rate)
    _cached: tuple | None = None  # (clock bucket, rate)

    def add(self, nbytes: float, seconds: float, now: float | None = None) -> None:
        """One measurement; non-positive or non-finite ones are dropped (a timer that read 0)."""
        if not (seconds > 0 and nbytes > 0 and math.isfinite(seconds) and math.isfinite(nbytes)):
            return
        t = self.clock() if now is None else now
        self._samples.append((t, nbytes / seconds))
        while len(self._samples) > self.history:
            self._samples.popleft()
        self._detect(t)

    def _window(self, now: float) -> list[float]:
        return [r for t, r in self._samples if now - t <= self.window_s]

    def _detect(self, now: float) -> None:
        recent = self._window(now)
        if len(recent) < self.min_samples:
            return
        med = _median(recent)
        if self._last_window is None:
            self._last_window = med
            return
        lo, hi = sorted((med, self._last_window))
        if hi > lo * self.change_ratio:
            self.changes.append((now, self._last_window, med))
            self._last_window = med
        elif now - self._samples[0][0] > self.window_s:
            self._last_window = med

    def rate(self, now: float | None = None) -> float | None:
        """The current estimate in bytes/s (None: no sample and no prior). Recomputed at most once per
        ``window_s / 20`` of clock time: the split asks per layer, and a fresh median every call would cost more
        than the decision it informs."""
        if self.pinned is not None:
            return self.pinned
        t = self.clock() if now is None else now
        bucket = int(t // (self.window_s / 20))
        if self._cached is not None and self._cached[0] == bucket:
            return self._cached[1]
        value = self._rate(t)
        self._cached = (bucket, value)
        return value

    def _rate(self, t: float) -> float | None:
        recent = self._window(t)
        if len(recent) >= self.min_samples:
            return _median(recent)
        if len(self._samples) >= self.min_samples:
            return _median([r for _, r in self._samples])
        if self._samples and self.prior is None:
            return _median([r for _, r in self._samples])
        return self.prior

    def count(self) -> int:
        return len(self._samples)


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class BandwidthOracle:
    """PCIe (host-to-device copies of expert records) and CPU-executor throughput, in bytes/s.

    ``pcie_gbps`` / ``cpu_gbps``: priors (a stored profile or defaults). The CPU rate is kept per expert format:
    a 4-bit format's records decode at a different rate than bf16's."""

    def __init__(self, pcie_gbps: float = 25.0, cpu_gbps: float = 20.0, window_s: float = 0.2,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.window_s = window_s
        self.pcie = RollingRate(prior=pcie_gbps * GB, window_s=window_s, clock=clock)
        self._cpu_prior = cpu_gbps * GB
        self._cpu_pin: float | None = None  # inject(cpu_gbps=...) for every format
        self._cpu: dict[str, RollingRate] = {}
        # the CPU path's fixed cost per call (activations out, partial outputs back, merge), as a "rate" of 1 unit
        # per second so the same windowed median applies: rate = 1 / seconds
        self.handoff = RollingRate(prior=1.0 / DEFAULT_CPU_HANDOFF_S, window_s=window_s, clock=clock)

    def cpu(self, fmt: str) -> RollingRate:
        r = self._cpu.get(fmt)
        if r is None:
            r = self._cpu[fmt] = RollingRate(prior=self._cpu_prior, window_s=self.window_s, clock=self.clock,
                                             pinned=self._cpu_pin)
        return r

    def add_copy(self, nbytes: float, seconds: float, now: float | None = None) -> None:
        self.pcie.add(nbytes, seconds, now)

    def add_cpu(self, fmt: str, nbytes: float, seconds: float, now: float | None = None) -> None:
        self.cpu(fmt).add(nbytes, seconds, now)

    def add_handoff(self, seconds: float, now: float | None = None) -> None:
        self.handoff.add(1.0, seconds, now)

    def handoff_seconds(self) -> float:
        """The CPU path's per-call cost (moving activations and partial outputs, merging), median of the window."""
        return 1.0 / self.handoff.rate()

    def inject(self, pcie_gbps: float | None = None, cpu_gbps: float | None = None, fmt: str | None = None) -> None:
        """Pin figures (GB/s): measurements no longer change them. ``fmt=None`` pins every format's CPU rate."""
        if pcie_gbps is not None:
            self.pcie.pinned = pcie_gbps * GB
        if cpu_gbps is not None:
            if fmt is not None:
                self.cpu(fmt).pinned = cpu_gbps * GB
            else:
                self._cpu_pin = cpu_gbps * GB
                for r in self._cpu.values():
                    r.pinned = self._cpu_pin

    def pcie_gbps(self) -> float:
        return self.pcie.rate() / GB

    def cpu_gbps(self, fmt: str) -> float:
        return self.cpu(fmt).rate() / GB

    def changes(self) -> list[tuple[str, float, float, float]]:
        """Every sustained change detected: (what, time, old GB/s, new GB/s)."""
        out = [("pcie", t, a / GB, b / GB) for t, a, b in self.pcie.changes]
        for fmt, r in self._cpu.items():
            out += [(f"cpu:{fmt}", t, a / GB, b / GB) for t, a, b in r.changes]
        return sorted(out, key=lambda c: c[1])
