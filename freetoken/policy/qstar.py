"""q*: split one MoE layer's cache misses between PCIe copies and the CPU.

At one decode step and MoE layer (an **admit call**), the routed experts are ``h`` hits (resident in GPU slots) and
``m`` misses. Each miss is either **fetched** (copied over PCIe into a slot, then computed on the GPU, and kept in
the cache where it may hit later) or **computed on the CPU** from the host copy (the CPU reads the weights once;
the activations go to the host and the partial output comes back to be merged on the device; nothing is cached).
q* is how many of the ``m`` misses to fetch.

Cost model (:class:`StepCosts`, all in seconds; build it from bandwidths with :meth:`StepCosts.from_bandwidths`):

* ``transfer_s`` (x): one record over PCIe, ``record_bytes / pcie_bps + copy_latency_s``. Copies run one after
  the other on the transfer stream.
* ``gpu_s`` (g): the GPU computing one resident expert, ``record_bytes / gpu_bps`` (decode is weight-bound).
* ``cpu_s`` (c): the CPU computing one expert, ``record_bytes / cpu_bps`` (the weights streamed once from host
  memory at the CPU's bandwidth), plus ``cpu_token_s`` per token routed to it (0 by default: weight-bound).
* ``cpu_handoff_s`` (H): paid once per call that sends at least one expert to the CPU: the activations to the
  host, the synchronisation, the partial outputs back over PCIe and their merge on the device.

The two paths start together when the routing is known. The GPU path copies the ``q`` fetched records, then runs
the routed-expert kernel over the ``h + q`` resident ones; the CPU path runs the other ``m - q`` experts::

    gpu_path(q) = q * x + (h + q) * g
    cpu_path(q) = 0                                           if q == m
                = H + (m - q) * c + cpu_token_s * tokens(CPU set)  otherwise
    critical(q) = max(gpu_path(q), cpu_path(q))

The split minimises ``critical(q) - future_value * q`` over ``q = 0 .. m`` (:func:`choose_fetch`), an O(m) scan
(ties: the larger q, since a fetched expert may hit later at no cost now). ``future_value`` (seconds saved later
per fetched expert) is the explicit, tunable term for what a fetched expert is worth beyond this call: it may hit
later, a CPU-computed one never does. With ``future_value = 0`` the split is the greedy per-call optimum. It may
also be one value per miss (``critical(q) - sum of the first q values``): a fetched record earns
:func:`expected_hits` hits before eviction, each worth about :func:`marginal_hit_value`; the trace time model
(:mod:`freetoken.policy.estimators`) estimates both online.

:func:`fetch_order` / :func:`which_to_fetch` pick WHICH misses are fetched, deterministically: the highest
per-miss future value first (when there are per-miss values), then the most tokens (they would cost the CPU the
most), then the most likely to be reused (a higher ``reuse`` score, e.g. the step the expert was last routed), then
the lower id. With a scalar future value that order gives the CPU the ``m - q`` misses with the fewest tokens,
which minimises the CPU path for every q; with per-miss values and ``cpu_token_s = 0`` it fetches the q most
valuable. Either way the scan over q is then the optimum over every subset of the misses (the tests check this
against brute force); with per-miss values and ``cpu_token_s > 0`` the order is a heuristic.

The kernels (:func:`critical_path`, :func:`best_q`, :func:`best_q_values`, :func:`order_misses`) are Numba
functions so that the trace time model (:mod:`freetoken.sim.timing`) and the runtime
(:class:`freetoken.policy.split_policy.MissPolicy`) run exactly this code per call; they are callable from Python
too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numba as nb
import numpy as np

GB = 1e9  # bandwidths are in GB/s = 1e9 bytes/s
DEFAULT_GPU_GBPS = 900.0  # a consumer GPU's memory bandwidth, order of magnitude (RTX 4090: ~1000 GB/s)
DEFAULT_COPY_LATENCY_S = 5e-6  # per record copy (launch / DMA set-up)
DEFAULT_CPU_HANDOFF_S = 25e-6  # activations to the host, sync, partial outputs back, merge


@dataclass(frozen=True)
class StepCosts:
    """Per-expert costs of one admit call, in seconds (see the module docstring for the model)."""

    transfer_s: float  # x: one record over PCIe, latency included
    cpu_s: float  # c: the CPU computing one expert (weights streamed once)
    gpu_s: float  # g: the GPU computing one resident expert
    cpu_handoff_s: float = 0.0  # H: once per call with at least one CPU expert
    cpu_token_s: float = 0.0  # extra CPU seconds per token routed to a CPU expert

    def __post_init__(self):
        for name in ("transfer_s", "cpu_s", "gpu_s", "cpu_handoff_s", "cpu_token_s"):
            v = float(getattr(self, name))
            if not v >= 0.0 or v == float("inf"):
                raise ValueError(f"StepCosts.{name} must be a finite number >= 0, got {v}")

    @classmethod
    def from_bandwidths(cls, record_bytes: int, pcie_gbps: float, cpu_gbps: float,
                        gpu_gbps: float = DEFAULT_GPU_GBPS, copy_latency_s: float = DEFAULT_COPY_LATENCY_S,
                        cpu_handoff_s: float = DEFAULT_CPU_HANDOFF_S, cpu_token_s: float = 0.0) -> StepCosts:
        """Costs of one ``record_bytes`` expert record at the given bandwidths (GB/s = 1e9 bytes/s)."""
        for name, v in (("pcie_gbps", pcie_gbps), ("cpu_gbps", cpu_gbps), ("gpu_gbps", gpu_gbps)):
            if not float(v) > 0.0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if int(record_bytes) < 1:
            raise ValueError(f"record_bytes must be >= 1, got {record_bytes}")
        b = float(record_bytes)
        return cls(transfer_s=b / (pcie_gbps * GB) + copy_latency_s, cpu_s=b / (cpu_gbps * GB),
                   gpu_s=b / (gpu_gbps * GB), cpu_handoff_s=cpu_handoff_s, cpu_token_s=cpu_token_s)


@dataclass(frozen=True)
class SplitTime:
    """The parts of one call's expert phase for a given q (seconds)."""

    q: int
    transfer: float  # q * x: the transfer stream's busy time
    gpu_compute: float  # (h + q) * g
    gpu_path: float  # transfer + gpu_compute
    cpu_path: float  # 0, or handoff + CPU experts
    critical: float  # max(gpu_path, cpu_path)


# ------------------------------------------------------------------------------------------------ kernels


@nb.njit(cache=True)
def critical_path(x, c, g, hand, ctok, m, h, q, tok_rest):  # pragma: no cover - compiled (also run uncompiled)
    """critical(q); ``tok_rest`` = tokens routed to the m - q CPU experts. Keep the expression order: the
    Python wrappers and the brute-force tests rely on bitwise-identical results."""
    gpu = q * x + (h + q) * g
    cpu = 0.0
    if q < m:
        cpu = hand + (m - q) * c + ctok * tok_rest
    return max(gpu, cpu)


@nb.njit(cache=True)
def best_q(x, c, g, hand, ctok, m, h, tok_ordered, fv):  # pragma: no cover - compiled
    """argmin over q = 0..m of critical(q) - fv * q (ties: the larger q). ``tok_ordered[:m]``: the misses' token
    counts in fetch order (the first q are fetched)."""
    rest = 0
    for j in range(m):
        rest += tok_ordered[j]
    best_q = 0
    best = critical_path(x, c, g, hand, ctok, m, h, 0, rest)
    for q in range(1, m + 1):
        rest -= tok_ordered[q - 1]
        obj = critical_path(x, c, g, hand, ctok, m, h, q, rest) - fv * q
        if obj <= best:
            best = obj
            best_q = q
    return best_q


@nb.njit(cache=True)
def best_q_values(x, c, g, hand, ctok, m, h, tok_ordered, fv_ordered):  # pragma: no cover - compiled
    """:func:`best_q` with a future value per miss: argmin of critical(q) - sum(fv_ordered[:q])."""
    rest = 0
    for j in range(m):
        rest += tok_ordered[j]
    best_q = 0
    best = critical_path(x, c, g, hand, ctok, m, h, 0, rest)
    acc = 0.0
    for q in range(1, m + 1):
        rest -= tok_ordered[q - 1]
        acc += fv_ordered[q - 1]
        obj = critical_path(x, c, g, hand, ctok, m, h, q, rest) - acc
        if obj <= best:
            best = obj
            best_q = q
    return best_q


@nb.njit(cache=True)
def _before(values, tokens, reuse, key, i, j):  # pragma: no cover - compiled
    """Miss i comes before miss j in the fetch order."""
    if values[i] != values[j]:
        return values[i] > values[j]
    if tokens[i] != tokens[j]:
        return tokens[i] > tokens[j]
    if reuse[i] != reuse[j]:
        return reuse[i] > reuse[j]
    return key[i] < key[j]


@nb.njit(cache=True)
def order_misses(values, tokens, reuse, key, n, perm, scratch):  # pragma: no cover - compiled
    """The fetch order of ``n`` misses: ``perm[:n]`` = their indices, the highest future ``values`` first, then the
    most ``tokens``, then the highest ``reuse`` score, then the lowest ``key`` (the id, or the prediction rank);
    ties on every key keep the input order. A stable merge sort (``scratch``: n ints of room)."""
    for i in range(n):
        perm[i] = i
    width = 1
    while width < n:
        lo = 0
        while lo < n - width:
            mid = lo + width
            hi = min(lo + 2 * width, n)
            a, b, k = lo, mid, lo
            while a < mid and b < hi:
                if _before(values, tokens, reuse, key, perm[b], perm[a]):
                    scratch[k] = perm[b]
                    b += 1
                else:
                    scratch[k] = perm[a]
                    a += 1
                k += 1
            while a < mid:
                scratch[k] = perm[a]
                a += 1
                k += 1
            while b < hi:
                scratch[k] = perm[b]
                b += 1
                k += 1
            for i in range(lo, hi):
                perm[i] = scratch[i]
            lo += 2 * width
        width *= 2


# ---------------------------------------------------------------------------------------------- public API


def _tokens(misses: int, tokens) -> np.ndarray:
    if tokens is None:
        return np.ones(misses, np.int64)
    tok = np.asarray(tokens, np.int64).reshape(-1)
    if tok.shape[0] != misses:
        raise ValueError(f"tokens must have one count per miss ({misses}), got {tok.shape[0]}")
    if tok.size and int(tok.min()) < 0:
        raise ValueError("token counts must be >= 0")
    return tok


def _check_counts(misses, hits) -> tuple[int, int]:
    m, h = int(misses), int(hits)
    if m != misses or h != hits or m < 0 or h < 0:
        raise ValueError(f"misses and hits must be non-negative integers, got {misses!r}, {hits!r}")
    return m, h


def split_time(costs: StepCosts, q: int, misses: int, hits: int, tokens: Sequence[int] | None = None) -> SplitTime:
    """The expert phase of one call when the first ``q`` of ``misses`` (in fetch order) are fetched.

    ``tokens``: tokens routed to each miss, in fetch order (default one each)."""
    m, h = _check_counts(misses, hits)
    if not 0 <= int(q) <= m:
        raise ValueError(f"q must be in [0, {m}], got {q}")
    q = int(q)
    tok = _tokens(m, tokens)
    rest = int(tok[q:].sum())
    x, c, g = costs.transfer_s, costs.cpu_s, costs.gpu_s
    crit = float(critical_path(x, c, g, costs.cpu_handoff_s, costs.cpu_token_s, m, h, q, rest))
    gpu = q * x + (h + q) * g
    cpu = costs.cpu_handoff_s + (m - q) * c + costs.cpu_token_s * rest if q < m else 0.0
    return SplitTime(q=q, transfer=q * x, gpu_compute=(h + q) * g, gpu_path=gpu, cpu_path=cpu, critical=crit)


def _future_values(m: int, future_value) -> tuple[float, np.ndarray | None]:
    """(scalar, None) or (0, per-miss array) after validation."""
    fv = np.asarray(future_value, np.float64)
    if fv.ndim == 0:
        v = float(fv)
        if not v >= 0.0 or v == float("inf"):
            raise ValueError(f"future_value must be a finite number >= 0 (seconds per fetched expert), got {v}")
        return v, None
    fv = fv.reshape(-1)
    if fv.shape[0] != m:
        raise ValueError(f"future_value must be a number or one value per miss ({m}), got {fv.shape[0]}")
    if fv.size and (not np.isfinite(fv).all() or fv.min() < 0):
        raise ValueError("future values must be finite and >= 0")
    return 0.0, fv


def objective(costs: StepCosts, q: int, misses: int, hits: int, future_value=0.0,
              tokens: Sequence[int] | None = None) -> float:
    """What :func:`choose_fetch` minimises: ``critical(q) - future_value * q``, or ``critical(q) -
    sum(future_value[:q])`` with one value per miss in fetch order (seconds)."""
    m, _ = _check_counts(misses, hits)
    v, arr = _future_values(m, future_value)
    crit = split_time(costs, q, misses, hits, tokens).critical
    if arr is None:
        return crit - v * int(q)
    acc = 0.0
    for j in range(int(q)):  # the order best_q_values sums in
        acc += float(arr[j])
    return crit - acc


def choose_fetch(costs: StepCosts, misses: int, hits: int, future_value=0.0,
                 tokens: Sequence[int] | None = None) -> int:
    """q*: how many of the ``misses`` to fetch (the rest are computed on the CPU).

    Minimises ``critical(q) - future_value * q`` over ``q = 0 .. misses`` in one O(m) scan; ties go to the larger
    q. ``future_value`` is in seconds saved later per fetched expert (>= 0; 0 = the greedy per-call optimum; see
    :func:`auto_future_value`), or one value per miss in fetch order (then ``sum(future_value[:q])`` is
    subtracted). ``tokens``: tokens routed to each miss in fetch order (:func:`fetch_order`; default one each);
    they matter only when ``costs.cpu_token_s > 0``.
    """
    m, h = _check_counts(misses, hits)
    v, arr = _future_values(m, future_value)
    if m == 0:
        return 0
    tok = _tokens(m, tokens)
    args = (float(costs.transfer_s), float(costs.cpu_s), float(costs.gpu_s), float(costs.cpu_handoff_s),
            float(costs.cpu_token_s), m, h, tok)
    return int(best_q(*args, v) if arr is None else best_q_values(*args, arr))


def fetch_order(ids: Sequence[int], tokens: Sequence[int] | None = None, reuse: Sequence[float] | None = None,
                values: Sequence[float] | None = None) -> np.ndarray:
    """The fetch priority of the misses ``ids``: indices into ``ids``, the highest ``values`` (per-miss future
    values, when given) first, then the most tokens, then the highest ``reuse`` score, then the lowest id.
    Deterministic (a total order on distinct ids)."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    n = ids.shape[0]
    tok = _tokens(n, tokens)
    ru = np.zeros(n) if reuse is None else np.asarray(reuse, np.float64).reshape(-1)
    if ru.shape[0] != n:
        raise ValueError(f"reuse must have one score per miss ({n}), got {ru.shape[0]}")
    val = np.zeros(n) if values is None else np.asarray(values, np.float64).reshape(-1)
    if val.shape[0] != n:
        raise ValueError(f"values must have one value per miss ({n}), got {val.shape[0]}")
    perm = np.empty(n, np.int64)
    order_misses(val, tok, ru, ids, n, perm, np.empty(n, np.int64))
    return perm


def which_to_fetch(ids: Sequence[int], q: int, tokens: Sequence[int] | None = None,
                   reuse: Sequence[float] | None = None, values: Sequence[float] | None = None) -> np.ndarray:
    """Boolean mask over ``ids``: the ``q`` misses to fetch, the first ``q`` of :func:`fetch_order`."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    if not 0 <= int(q) <= ids.shape[0]:
        raise ValueError(f"q must be in [0, {ids.shape[0]}], got {q}")
    mask = np.zeros(ids.shape[0], bool)
    mask[fetch_order(ids, tokens, reuse, values)[: int(q)]] = True
    return mask


def split(costs: StepCosts, ids: Sequence[int], hits: int, future_value=0.0,
          tokens: Sequence[int] | None = None, reuse: Sequence[float] | None = None) -> np.ndarray:
    """The mask of the misses ``ids`` to fetch: :func:`choose_fetch` over :func:`fetch_order`.

    ``future_value``: a number, or one value per miss aligned with ``ids`` (then the most valuable go first)."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    v, arr = _future_values(ids.shape[0], future_value)
    order = fetch_order(ids, tokens, reuse, arr)
    tok = _tokens(ids.shape[0], tokens)[order]
    q = choose_fetch(costs, ids.shape[0], hits, v if arr is None else arr[order], tok)
    mask = np.zeros(ids.shape[0], bool)
    mask[order[:q]] = True
    return mask


def place_bypassed(costs: StepCosts, admitted: int, hits: int, tokens: Sequence[int]) -> np.ndarray:
    """Where a cache policy's bypassed misses run (``--moe-mode hybrid`` under ``--cache-policy next_use``): the mask
    of those streamed through a scratch slot (fetched, not kept); the others are computed on the CPU.

    The ``admitted`` misses (the policy caches them) are fetched in any case; of the bypassed ones (``tokens``
    routed to each) the first n in :func:`fetch_order` are streamed, n minimising ``critical(admitted + n)`` over
    ``n = 0 .. len(tokens)`` (ties: the larger n), the q* objective with the admitted misses fixed on the PCIe side.
    """
    a, h = _check_counts(admitted, hits)
    tok = _tokens(len(tokens), tokens)
    b = tok.shape[0]
    order = fetch_order(np.arange(b), tok)
    ordered = tok[order]
    x, c, g = float(costs.transfer_s), float(costs.cpu_s), float(costs.gpu_s)
    rest = int(ordered.sum())
    best_n, best = 0, critical_path(x, c, g, float(costs.cpu_handoff_s), float(costs.cpu_token_s), a + b, h, a, rest)
    for n in range(1, b + 1):
        rest -= int(ordered[n - 1])
        t = critical_path(x, c, g, float(costs.cpu_handoff_s), float(costs.cpu_token_s), a + b, h, a + n, rest)
        if t <= best:
            best_n, best = n, t
    mask = np.zeros(b, bool)
    mask[order[:best_n]] = True
    return mask


def marginal_hit_value(costs: StepCosts) -> float:
    """Seconds one more hit (one miss fewer) saves a call at the balanced split, ``x * c / (x + g + c)``.

    Where the two paths balance, ``critical = (m x + m g + h g + ...) c / (x + g + c)`` roughly, so turning a miss
    into a hit lowers it by ``x c / (x + g + c)``: ``x`` when the CPU is slow (every miss is fetched), ~0 when the
    CPU is free. The handoff and token terms are left out."""
    x, c, g = costs.transfer_s, costs.cpu_s, costs.gpu_s
    den = x + g + c
    return x * c / den if den > 0 else 0.0


def expected_hits(p_reaccess: float, max_hits: float = 64.0) -> float:
    """Hits one residency earns when each next use comes before eviction with probability ``p_reaccess``:
    every in-time use is a hit and renews the residency, so the count is geometric, ``p / (1 - p)``, capped at
    ``max_hits``."""
    p = float(p_reaccess)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p_reaccess must be in [0, 1], got {p}")
    return max_hits if p >= 1.0 else min(max_hits, p / (1.0 - p))


def auto_future_value(costs: StepCosts, hits_per_admission: float) -> float:
    """An estimate of ``future_value``: the hits an admitted record earns before it is evicted (measured on the
    cache so far) times what each hit saves (:func:`marginal_hit_value`)."""
    return max(0.0, float(hits_per_admission)) * marginal_hit_value(costs)
