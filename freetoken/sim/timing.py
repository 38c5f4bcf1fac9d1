"""Decode-step time model: replay a routing trace through the expert cache and the q* split, per mode.

Modes (:data:`MODES`):

* ``fetch_all``: every miss is copied over PCIe into a slot (and cached); the device LRU decides the victims.
* ``cpu_all``: every miss is computed on the CPU from the host copy and nothing is ever admitted, so the cache
  stays empty: every routed expert runs on the CPU (the "experts on the CPU" baseline).
* ``qstar``: per call, :func:`freetoken.policy.qstar.choose_fetch` picks how many misses to fetch and
  :func:`~freetoken.policy.qstar.fetch_order` which (the highest future value first, then the most tokens, then the
  most recently routed, then the lowest id); fetched experts are admitted (LRU), CPU-computed ones are not.
* ``qstar_prefetch``: ``qstar`` plus prefetching: while layer l computes, the experts predicted for the next call
  (:mod:`freetoken.sim.predict`) are copied on the otherwise idle transfer stream and admitted.
* ``fetch_all_prefetch`` (not in the default set): ``fetch_all`` plus the same prefetching.

Per call (decode step t, MoE layer l) with h hits and m misses, q of them fetched (costs from
:class:`~freetoken.policy.qstar.StepCosts`: x per copy, g per GPU expert, c per CPU expert, H handoff)::

    call time   = layer_s + critical(q),  critical = max(q x + (h + q) g,  [q < m] (H + (m - q) c + ...))
    gpu         = layer_s + (h + q) g       (busy GPU: non-expert work + the routed-expert kernel)
    stall       = critical - (h + q) g       (the GPU waiting for copies or for the CPU's partials)
    transfer    = q x;  cpu = the CPU path
    step time   = sum over layers of the call times + step_s = gpu + stall

``layer_s`` is the non-expert GPU time per layer (attention, router, shared expert, norms) and ``step_s`` the per
step rest (embedding, LM head, sampling); both default to 0, which isolates the expert phase.

The disk tier (``host_memory`` below the model's records, ``--host-memory`` at run time): host memory holds
``host_rows = host_memory // record_bytes`` records in an LRU of its own (:mod:`freetoken.policy.lru`, the same
rules as the device's), which sees only what must be in host memory: a call's misses (fetched or computed on the
CPU; hits on the GPU never touch it) and prefetched records. Each of them not in host memory is read from disk
first, ``disk_s = record_bytes / disk bandwidth + disk_latency_s`` each, serially and on the critical path (the
runtime reads the admission's worklist back and reads the records before it copies them)::

    call time   = layer_s + reads x disk_s + critical(q),   stall += reads x disk_s

A segment start (a prompt) streams every layer's records through the tier in layer order, untimed (decode steps are
what is scored), so the tier starts a segment's decode holding the last layers. ``disk_s`` and ``disk_reads`` are
reported per step.

Prefetch: the transfer stream is idle from the end of call l's demand copies (``q x`` after its routing) until the
next call's routing (``critical + layer_s`` after it), so ``floor((critical + layer_s - q x) / x)`` prefetched
copies fit without delaying any demand copy. For the next call's predicted set (``h'`` of them resident, ``m'``
not), the prefetch copies what the split would fetch if the prediction were right: the first ``choose_fetch(m',
h')`` of the non-resident ones in the demand fetch order (the highest future value, then the most recently
routed, then prediction rank; in ``fetch_all_prefetch`` all of them, in prediction rank), as many as fit.
It is an admit call on the predicted set: the resident predicted ones are refreshed, the copies go, in increasing
id order, into LRU victims the current call is not using. A correct prediction turns a miss into a hit; a wrong one
spends idle bandwidth and evicts a slot. No prefetch crosses a segment start (prefill runs there, borrowing slots).
With ``layer_s = 0`` and a balanced split there is little idle PCIe time, so little is prefetched.

The cache is the device LRU (:mod:`freetoken.policy.lru`, as :func:`freetoken.sim.policies.lru` replays it; same
recency, tie and prefill-borrow rules): ``fetch_all`` reproduces its misses exactly. Cache states differ between
modes: fetch_all admits every miss, qstar only what it fetches, cpu_all nothing.

Per cache policy (:func:`time_policies`, ``trace simulate --pcie --cpu --policies``): the modes above run the device
LRU; a demand policy of the miss-rate table (:data:`POLICY_MODES`: ``lru``, ``lfu_decay``, ``next_use``, their
``+bypass`` variants, ``next_use+bypass+prior``, ``default``, ``default+trans``) can replace it. Its decisions are
replayed exactly as its miss-rate row replays them (:func:`policy_decisions`: the same misses, the admitted ones are its
loads), and per call the misses it admits are fetched over PCIe (q = admitted) while those it bypasses are computed on
the CPU and not cached: ``call time = layer_s + critical(q)`` with the bypassed misses (and their tokens) on the CPU
path, the host tier as above. With ``bypassed="stream"`` (the runtime's ``--moe-mode gpu``: a bypassed miss is copied
through a scratch slot and not kept) they are fetched over PCIe like the admitted ones (q = misses), still not cached.
There is no q* split (the policy decides what is cached, so the miss counts stay the table's) and no prefetch. ``lru``
is ``fetch_all`` bit for bit; a policy that never bypasses is fetch_all on its own cache.

The future value, and why q* is (and is not by construction) at or below both extremes:

* Per call, on the same cache state and with ``future_value = 0``, ``critical(q*) <= min(critical(0),
  critical(m))``: the scan includes both extremes. :func:`split_vs_extremes_same_state` returns these per call;
  this is the by-construction check in the tests.
* Over a trace the cache states diverge, and the greedy split (``future_value = 0``) can lose badly to fetch_all:
  fetch_all caches every miss, so with locality it earns later hits, while the greedy split sends the marginal
  misses to the CPU call after call (an expert routed every step and computed on the CPU every step never becomes
  a hit; on synthetic traces that costs up to 10x). The ``future_value`` term prices this: a fetched expert is worth
  the hits it earns before eviction times what a hit saves (:func:`~freetoken.policy.qstar.marginal_hit_value`,
  ``x c / (x + g + c)``). Two online estimates (:mod:`freetoken.policy.estimators`, shared with the runtime's
  :class:`~freetoken.policy.split_policy.MissPolicy`), both things the device could count:

  - ``"auto"`` (the default), per miss: the cache's residency time ``tc`` is the mean idle age (steps since last
    routed) of the records admissions evict; ``p`` = the fraction of the expert's re-uses that came within ``tc``
    of its previous use, shrunk toward the fraction pooled over all experts (taken as 1 until the cache first
    evicts) with :data:`PRIOR_WEIGHT` (8) pseudo re-uses; a residency then earns ``p / (1 - p)`` hits (capped
    at :data:`MAX_HITS`, :func:`~freetoken.policy.qstar.expected_hits`). Misses are fetched most valuable first.
  - ``"global"``, one value per call: ``(reuse hits + PRIOR_HITS) / (ended lifetimes + 1)``, hits per record
    lifetime so far (a lifetime ends when a record holding a slot is evicted; :data:`PRIOR_HITS` = 8 before
    evidence). The first use of a prefetched record and the eviction of a never-used prefetch do not count.

* Measured on synthetic traces (localities 0 to 1, top-2 to top-8, 16 to 128 experts, batches of 1 to 4,
  records of 256 KiB to 32 MiB, 8 slots to the whole model, layer_s 0 and 100 us, cpu_token_s 0 and 20 us, PCIe/CPU
  0.25x to 4x; ~10,000 points), qstar / min(fetch_all, cpu_all) averaged 0.89 with ``"auto"`` and 0.90 with
  ``"global"``; it went above 1 at 40 points with ``"auto"`` (at most +1.3%, mostly 8-slot caches) and at 2 with
  ``"global"`` (+0.8%, an 8-slot cache). ``"global"`` is a mean over lifetimes that hot experts dominate, so it
  overvalues the colder experts that miss and can degenerate to fetch_all where splitting pays: 13.7 tok/s
  (= fetch_all) against 20.1 for ``"auto"`` and 22.8 for the best fixed value on a 94-layer, 128-expert, top-8
  trace with 2,000 slots at PCIe 25 / CPU 50 GB/s. Hence ``"auto"`` is the default. The small losses are the
  principled limit: the value of a fetch depends on future routing, which an online policy can only estimate, and
  LRU contents are not monotone in what is admitted. So the guarantee the tests hold to +1e-12 is the per-call one
  on identical cache state; over traces they check ``"global"`` exactly and ``"auto"`` within 0.5% on a few
  synthetic traces, and the CLI prints qstar / best per ratio so that real traces can be checked.
* Prefetch with a perfect (oracle) predictor, one token per step, is never worse than no prefetch in
  ``fetch_all_prefetch`` by construction when slots >= 2 x the largest active set: the oracle ranks a call's misses
  by id, so the prefetch takes the same victims in the same slots as the demand admission would, the LRU state
  stays that of ``fetch_all``, and prefetched misses are hits. In ``qstar_prefetch`` the call re-decides the split
  over the misses left, so it holds per call but is measured over the trace (the tests check it).

:func:`time_modes` runs the modes at one bandwidth point (:func:`time_policies` the cache policies,
:func:`format_policy_timing` prints them), :func:`sweep` over PCIe/CPU ratios (PCIe varies, the
CPU bandwidth stays); :mod:`freetoken.sim.report` prints them (:func:`format_timing`, :func:`format_sweep`). The
kernel is :mod:`freetoken.sim.timing_kernel`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from freetoken.policy.estimators import FUTURE_VALUES, MAX_HITS, PRIOR_HITS, PRIOR_WEIGHT, future_value_kind
from freetoken.policy.qstar import (
    DEFAULT_COPY_LATENCY_S,
    DEFAULT_CPU_HANDOFF_S,
    DEFAULT_GPU_GBPS,
    StepCosts,
    marginal_hit_value,
)
from freetoken.sim.predict import PREDICTORS, PredictorScore, precision_recall, predictions
from freetoken.sim.report import format_sweep, format_timing
from freetoken.sim.timing_kernel import (
    ADMITTED,
    BYPASSED_MISS,
    CPU_ALL,
    FETCH_ALL,
    FIELDS,
    QSTAR,
    lru_decisions,
    policy_timing_kernel,
    scored_decisions,
    timing_kernel,
)
from freetoken.trace.derived import WINDOWS, check_slots, prepare, token_counts, window_steps
from freetoken.trace.format import Trace

MODES = ("fetch_all", "cpu_all", "qstar", "qstar_prefetch")
ALL_MODES = (*MODES, "fetch_all_prefetch")
MODE_CODE = {"fetch_all": FETCH_ALL, "cpu_all": CPU_ALL, "qstar": QSTAR, "qstar_prefetch": QSTAR,
             "fetch_all_prefetch": FETCH_ALL}
#: the cache policies the time model can replay (:func:`time_policies`): the demand policies of the miss-rate table
POLICY_MODES = ("lru", "lfu_decay", "lfu_decay+bypass", "next_use", "next_use+bypass", "next_use+bypass+prior",
                "default", "default+trans")
#: where the time model runs a policy's bypassed misses: on the CPU, or fetched through a scratch slot (not cached)
BYPASSED_TO = ("cpu", "stream")
SWEEP_RATIOS = tuple(float(2.0 ** (e / 2)) for e in range(-4, 5))  # 0.25x .. 4x, geometric, 9 points


# ------------------------------------------------------------------------------------------------ public API


@dataclass
class ModeTiming:
    """One mode's time model over a window of decode steps; seconds are means per decode step."""

    mode: str
    slots: int
    window: str
    steps: int  # decode steps scored
    tokens_per_step: int  # the decode batch
    pcie_gbps: float
    cpu_gbps: float
    gpu_gbps: float
    step_s: float
    transfer_s: float  # demand copies (the transfer stream's busy time on the critical path's side)
    prefetch_s: float  # prefetch copies (in idle transfer-stream time)
    cpu_s: float  # the CPU path, handoff included
    gpu_s: float  # GPU busy: non-expert time + routed-expert kernels
    stall_s: float  # the GPU waiting for copies or for CPU partials; step_s = gpu_s + stall_s
    accesses: int
    hits: int
    misses: int
    fetched: int
    prefetched: int
    prefetch_used: int  # prefetched experts that were hit before being evicted
    future_value: str  # "auto", "global" or the fixed value ("1e-04 s"); "" for modes without a split
    predictor: str = ""
    prediction: PredictorScore | None = None
    per_step: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)  # seconds, every trace step
    host_rows: int = 0  # records host memory holds (0: all: no disk tier)
    disk_gbps: float = 0.0
    disk_s: float = 0.0  # reading records from disk (on the critical path, part of stall_s)
    disk_reads: float = 0.0  # records read from disk per decode step

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else float("inf")

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def cpu_experts(self) -> int:
        return self.misses - self.fetched

    def as_row(self) -> dict:
        row = {k: getattr(self, k) for k in ("mode", "slots", "window", "steps", "tokens_per_step", "pcie_gbps",
                                             "cpu_gbps", "gpu_gbps", "tokens_per_s", "step_s", "transfer_s",
                                             "prefetch_s", "cpu_s", "gpu_s", "stall_s", "accesses", "hits",
                                             "misses", "fetched", "cpu_experts", "prefetched", "prefetch_used",
                                             "hit_rate", "future_value", "predictor", "host_rows", "disk_gbps",
                                             "disk_s", "disk_reads")}
        if self.prediction is not None:
            row["precision"] = self.prediction.precision
            row["recall"] = self.prediction.recall
        return row


def _check_mode(mode: str) -> None:
    if mode not in MODE_CODE:
        raise ValueError(f"unknown mode {mode!r} (known: {', '.join(ALL_MODES)})")


def _prefetch_n(trace: Trace, prefetch_n: int | None) -> int:
    return int(prefetch_n) if prefetch_n is not None else min(trace.num_experts, trace.top_k * trace.tokens)


def _disk_tier(trace, host_memory, disk_gbps, disk_latency_s: float, window: str) -> tuple[int, float]:
    """(host rows of the disk tier, 0 without one; seconds per record read from disk), the arguments checked."""
    host_rows = host_rows_for(trace, host_memory)
    if host_rows and not (disk_gbps is not None and disk_gbps > 0):
        raise ValueError("a host memory below the model's records needs the disk bandwidth (disk_gbps > 0)")
    disk_s = trace.record_bytes / (disk_gbps * 1e9) + disk_latency_s if host_rows else 0.0
    if window not in WINDOWS:
        raise ValueError(f"unknown window {window!r} (expected one of {', '.join(WINDOWS)})")
    return host_rows, disk_s


def host_rows_for(trace: Trace, host_memory: int | None) -> int:
    """Records a host budget of ``host_memory`` bytes holds, 0 when it holds every record of the trace's model (no
    disk tier) or no budget is given; a budget under two layers' records is refused (ValueError naming the
    minimum), as the runtime refuses it."""
    if host_memory is None:
        return 0
    rows = int(host_memory) // int(trace.record_bytes)
    if rows >= trace.num_flat:
        return 0
    least = 2 * trace.num_experts
    if rows < least:
        raise ValueError(f"a host memory of {int(host_memory):,} bytes holds {rows} records; the disk tier needs at "
                         f"least two layers' records: {least} x {trace.record_bytes:,} = "
                         f"{least * trace.record_bytes:,} bytes")
    return rows


def run_kernel(trace: Trace, mode: str, slots: int, costs: StepCosts, *, future_value, layer_s, step_s, pred,
               prefill_borrow, prior_hits=PRIOR_HITS, prior_weight=PRIOR_WEIGHT, qdiag=None, host_rows: int = 0,
               disk_s: float = 0.0) -> np.ndarray:
    """One mode over the whole trace: the kernel's per-step accumulators float64 [len(FIELDS), steps] (see
    :mod:`freetoken.sim.timing_kernel`). ``pred``: predictions [steps, L, n] or None. ``host_rows`` > 0: a disk
    tier of that many records, each read in ``disk_s`` seconds."""
    _check_mode(mode)
    slots = check_slots(slots)
    p = prepare(trace)
    if slots < max(p.max_active, 1) and mode != "cpu_all":
        raise ValueError(f"lru needs at least as many slots as the largest active set ({p.max_active} = unique "
                         f"experts of one layer's decode batch), got {slots}")
    if mode == "cpu_all":
        slots = 0
    kind, fv, _ = future_value_kind(future_value)
    if layer_s < 0 or step_s < 0 or prior_hits < 0 or prior_weight < 0:
        raise ValueError("layer_s, step_s, prior_hits and prior_weight must be >= 0")
    use_pf = mode.endswith("_prefetch")
    if pred is None or not use_pf:
        pred = np.full((trace.steps, trace.num_layers, 1), -1, np.int32)
    borrow_n = min(2 * trace.num_experts, slots) if prefill_borrow else 0
    diag = np.zeros((0, 0, 3)) if qdiag is None else qdiag
    return timing_kernel(p.active, p.counts, token_counts(trace), p.seg_start, slots, trace.num_flat,
                         trace.num_experts, borrow_n, MODE_CODE[mode], float(costs.transfer_s),
                          float(costs.cpu_s), float(costs.gpu_s), float(costs.cpu_handoff_s),
                          float(costs.cpu_token_s), float(layer_s), float(step_s), kind, fv,
                          marginal_hit_value(costs), float(prior_hits), float(prior_weight), MAX_HITS,
                          np.ascontiguousarray(pred, np.int32), use_pf, diag, int(host_rows), float(disk_s))


def resolve_predictions(trace: Trace, predictor: str | np.ndarray, prefetch_n: int | None):
    """(name, predictions int32 [steps, L, n]) of a predictor name (cached on the trace) or a given array."""
    if isinstance(predictor, str):
        n = _prefetch_n(trace, prefetch_n)
        return predictor, trace.cached(("predictions", predictor, n), lambda: predictions(trace, predictor, n))
    pred = np.asarray(predictor)
    if pred.ndim != 3 or pred.shape[:2] != (trace.steps, trace.num_layers):
        raise ValueError(f"predictions must have shape [steps={trace.steps}, layers={trace.num_layers}, n], "
                         f"got {pred.shape}")
    return "given", pred


def time_modes(trace: Trace, slots: int, pcie_gbps: float, cpu_gbps: float, gpu_gbps: float = DEFAULT_GPU_GBPS,
               modes: Sequence[str] = MODES, *, window: str = "second_half", future_value: float | str = "auto",
               layer_s: float = 0.0, step_s: float = 0.0, predictor: str | np.ndarray = "coact",
               prefetch_n: int | None = None, prefill_borrow: bool = True,
               copy_latency_s: float = DEFAULT_COPY_LATENCY_S, cpu_handoff_s: float = DEFAULT_CPU_HANDOFF_S,
               cpu_token_s: float = 0.0, prior_hits: float = PRIOR_HITS, prior_weight: float = PRIOR_WEIGHT,
               host_memory: int | None = None, disk_gbps: float | None = None, disk_latency_s: float = 0.0,
               _pred=None) -> list[ModeTiming]:
    """Model each decode step's time for every mode at one bandwidth point; see the module docstring.

    ``slots``: GPU expert slots. Bandwidths in GB/s (1e9 bytes/s). ``window``: the steps scored (the cache runs
    over the whole trace). ``future_value``: ``"auto"`` (per-expert online estimate), ``"global"`` (hits per record
    lifetime) or a fixed number of seconds per fetched expert; ``prior_weight`` / ``prior_hits`` are their priors.
    ``predictor``: a :data:`freetoken.sim.predict.PREDICTORS` name (``coact`` learns on the first half of the
    trace) or a predictions array ``[steps, L, n]``; ``prefetch_n`` experts are predicted per call (default
    top_k x tokens). ``host_memory`` (bytes) below the model's records with ``disk_gbps``: the disk tier (see the
    module docstring; ``disk_latency_s`` per record read). Raises ValueError on bad arguments.
    """
    host_rows, disk_s = _disk_tier(trace, host_memory, disk_gbps, disk_latency_s, window)
    for mode in modes:
        _check_mode(mode)
    costs = StepCosts.from_bandwidths(trace.record_bytes, pcie_gbps, cpu_gbps, gpu_gbps, copy_latency_s,
                                      cpu_handoff_s, cpu_token_s)
    t0, t1 = window_steps(trace, window)
    p = prepare(trace)
    accesses = int(p.step_offsets[t1] - p.step_offsets[t0])
    pname, pred, score = "", None, None
    if any(m.endswith("_prefetch") for m in modes):
        pname, pred = resolve_predictions(trace, predictor, prefetch_n) if _pred is None else _pred
        score = precision_recall(trace, pred, (t0, t1))
    fv_name = future_value_kind(future_value)[2]
    out = []
    n = max(t1 - t0, 0)
    for mode in modes:
        acc = run_kernel(trace, mode, slots, costs, future_value=future_value, layer_s=layer_s, step_s=step_s,
                         pred=pred, prefill_borrow=prefill_borrow, prior_hits=prior_hits, prior_weight=prior_weight,
                         host_rows=host_rows, disk_s=disk_s)
        w = acc[:, t0:t1]
        mean = w.mean(axis=1) if n else np.zeros(len(FIELDS))
        tot = w.sum(axis=1)
        pf = mode.endswith("_prefetch")
        out.append(ModeTiming(
            mode=mode, slots=int(slots), window=window, steps=n, tokens_per_step=trace.tokens,
            pcie_gbps=float(pcie_gbps), cpu_gbps=float(cpu_gbps), gpu_gbps=float(gpu_gbps),
            step_s=float(mean[0]), transfer_s=float(mean[1]), prefetch_s=float(mean[2]), cpu_s=float(mean[3]),
            gpu_s=float(mean[4]), stall_s=float(mean[5]), accesses=accesses, hits=int(tot[6]), misses=int(tot[7]),
            fetched=int(tot[8]), prefetched=int(tot[9]), prefetch_used=int(tot[10]),
            future_value=fv_name if mode.startswith("qstar") else "", predictor=pname if pf else "",
            prediction=score if pf else None, per_step=acc[0].copy(), host_rows=host_rows,
            disk_gbps=float(disk_gbps or 0.0) if host_rows else 0.0, disk_s=float(mean[11]),
            disk_reads=float(mean[12])))
    return out


def policy_decisions(trace: Trace, policy: str, slots: int, prefill_borrow: bool = True) -> np.ndarray:
    """int8 [steps, L, A] (aligned with ``prepare(trace).active``): what the cache policy ``policy`` (one of
    :data:`POLICY_MODES`) does with each access over the whole trace: 0 hit, 1 admitted miss (fetched), 2 bypassed
    miss (computed on the CPU, not cached). The same replay as the miss-rate table's row of that name."""
    from freetoken.sim.policies import _demand_setup, demand_state

    if policy not in POLICY_MODES:
        raise ValueError(f"the time model replays the demand policies {', '.join(POLICY_MODES)}; got {policy!r}")
    slots, p, borrow_n = _demand_setup(trace, slots, policy, prefill_borrow)
    if policy == "lru":
        return lru_decisions(p.active, p.counts, p.seg_start, slots, trace.num_flat, borrow_n)
    st = demand_state(policy, trace, slots)
    return scored_decisions(st, p.active, p.counts, p.seg_start,
                            np.ascontiguousarray(trace.step_segment, np.int64),
                            np.ascontiguousarray(trace.prefill_counts, np.float64),
                            float(trace.tokens * trace.top_k), borrow_n)


def time_policies(trace: Trace, slots: int, pcie_gbps: float, cpu_gbps: float, gpu_gbps: float = DEFAULT_GPU_GBPS,
                  policies: Sequence[str] = ("lru", "default"), *, window: str = "second_half",
                  layer_s: float = 0.0, step_s: float = 0.0, prefill_borrow: bool = True,
                  copy_latency_s: float = DEFAULT_COPY_LATENCY_S, cpu_handoff_s: float = DEFAULT_CPU_HANDOFF_S,
                  cpu_token_s: float = 0.0, host_memory: int | None = None, disk_gbps: float | None = None,
                  disk_latency_s: float = 0.0, bypassed: str = "cpu") -> list[ModeTiming]:
    """The time model with a cache policy in place of the device LRU, one :class:`ModeTiming` per policy (its
    ``mode`` is the policy's name): the policy's decisions (:func:`policy_decisions`, those of the miss-rate
    table) are replayed and, per call, every miss it admits is fetched over PCIe and every miss it bypasses is
    computed on the CPU, not cached; the call time is ``critical(q)`` with q = the admitted misses (see the module
    docstring; no q* split and no prefetch: the policy decides). ``lru`` is ``fetch_all`` exactly. ``bypassed``:
    ``"cpu"`` as said, or ``"stream"``: the bypassed misses are fetched too (through a scratch slot, as the runtime's
    gpu mode does), so q = every miss. Other arguments as :func:`time_modes`'s."""
    if bypassed not in BYPASSED_TO:
        raise ValueError(f"bypassed misses go to {' or '.join(BYPASSED_TO)}, not {bypassed!r}")
    host_rows, disk_s = _disk_tier(trace, host_memory, disk_gbps, disk_latency_s, window)
    if layer_s < 0 or step_s < 0:
        raise ValueError("layer_s and step_s must be >= 0")
    for pol in policies:
        if pol not in POLICY_MODES:
            raise ValueError(f"the time model replays the demand policies {', '.join(POLICY_MODES)}; got {pol!r}")
    costs = StepCosts.from_bandwidths(trace.record_bytes, pcie_gbps, cpu_gbps, gpu_gbps, copy_latency_s,
                                      cpu_handoff_s, cpu_token_s)
    t0, t1 = window_steps(trace, window)
    p = prepare(trace)
    accesses = int(p.step_offsets[t1] - p.step_offsets[t0])
    n = max(t1 - t0, 0)
    out = []
    for pol in policies:
        status = policy_decisions(trace, pol, slots, prefill_borrow)
        if bypassed == "stream":  # the cache's contents are the decisions'; only where a bypassed miss runs changes
            status[status == BYPASSED_MISS] = ADMITTED
        acc = policy_timing_kernel(p.active, p.counts, token_counts(trace), status, p.seg_start, trace.num_flat,
                                   trace.num_experts, float(costs.transfer_s), float(costs.cpu_s),
                                   float(costs.gpu_s), float(costs.cpu_handoff_s), float(costs.cpu_token_s),
                                   float(layer_s), float(step_s), int(host_rows), float(disk_s))
        w = acc[:, t0:t1]
        mean = w.mean(axis=1) if n else np.zeros(len(FIELDS))
        tot = w.sum(axis=1)
        out.append(ModeTiming(
            mode=pol, slots=int(slots), window=window, steps=n, tokens_per_step=trace.tokens,
            pcie_gbps=float(pcie_gbps), cpu_gbps=float(cpu_gbps), gpu_gbps=float(gpu_gbps),
            step_s=float(mean[0]), transfer_s=float(mean[1]), prefetch_s=0.0, cpu_s=float(mean[3]),
            gpu_s=float(mean[4]), stall_s=float(mean[5]), accesses=accesses, hits=int(tot[6]), misses=int(tot[7]),
            fetched=int(tot[8]), prefetched=0, prefetch_used=0, future_value="", per_step=acc[0].copy(),
            host_rows=host_rows, disk_gbps=float(disk_gbps or 0.0) if host_rows else 0.0, disk_s=float(mean[11]),
            disk_reads=float(mean[12])))
    return out


def format_policy_timing(results: Sequence[ModeTiming], bypassed: str = "cpu") -> str:
    """A table of :func:`time_policies` (run with ``bypassed``): per (slots, policy) the miss rate, tokens/s and where
    the time goes."""
    from freetoken.sim.table import text_table

    def us(s: float) -> str:
        return f"{s * 1e6:,.1f}"

    header = ("policy", "slots", "miss rate", "misses", "fetched", "on cpu", "tok/s", "step us", "transfer us",
              "cpu us", "stall us")
    body = [(r.mode, str(r.slots), f"{100 * r.misses / r.accesses:.1f}%" if r.accesses else "-", f"{r.misses:,}",
             f"{r.fetched:,}", f"{r.cpu_experts:,}", f"{r.tokens_per_s:,.2f}", us(r.step_s), us(r.transfer_s),
             us(r.cpu_s), us(r.stall_s)) for r in results]
    out = text_table(header, body, left={0}, groups=[r.slots for r in results])
    where = ("computed on the CPU (on cpu)" if bypassed == "cpu" else
             "fetched too, through a scratch slot, and not kept")
    out.append(f"tokens/s per cache policy: its admitted misses fetched over PCIe, its bypassed ones {where}; "
               "lru = fetch_all")
    return "\n".join(s.rstrip() for s in out)


def split_vs_extremes_same_state(trace: Trace, slots: int, pcie_gbps: float, cpu_gbps: float,
                                 gpu_gbps: float = DEFAULT_GPU_GBPS, *, future_value: float | str = 0.0,
                                 prefill_borrow: bool = True, copy_latency_s: float = DEFAULT_COPY_LATENCY_S,
                                 cpu_handoff_s: float = DEFAULT_CPU_HANDOFF_S,
                                 cpu_token_s: float = 0.0, prior_hits: float = PRIOR_HITS) -> np.ndarray:
    """Replay ``qstar`` and return, per call, the expert-phase critical path of q* and of q = 0 and q = m on the
    same (qstar's) cache state: float64 ``[steps, L, 3]``. With ``future_value=0`` the first column is <= the
    other two everywhere, by construction."""
    costs = StepCosts.from_bandwidths(trace.record_bytes, pcie_gbps, cpu_gbps, gpu_gbps, copy_latency_s,
                                      cpu_handoff_s, cpu_token_s)
    diag = np.zeros((trace.steps, trace.num_layers, 3))
    run_kernel(trace, "qstar", slots, costs, future_value=future_value, layer_s=0.0, step_s=0.0, pred=None,
               prefill_borrow=prefill_borrow, prior_hits=prior_hits, qdiag=diag)
    return diag


def sweep(trace: Trace, slots: int, cpu_gbps: float, ratios: Iterable[float] = SWEEP_RATIOS,
          modes: Sequence[str] = MODES, **kwargs) -> list[dict]:
    """:func:`time_modes` at PCIe = ratio x ``cpu_gbps`` for each ratio (the CPU bandwidth stays); one row
    (:meth:`ModeTiming.as_row` plus ``ratio``) per (ratio, mode). ``kwargs`` go to :func:`time_modes`."""
    ratios = [float(r) for r in ratios]
    if not ratios or min(ratios) <= 0:
        raise ValueError("ratios must be positive")
    pre = None
    if any(m.endswith("_prefetch") for m in modes):
        pre = resolve_predictions(trace, kwargs.pop("predictor", "coact"), kwargs.pop("prefetch_n", None))
    rows = []
    for r in ratios:
        for res in time_modes(trace, slots, r * float(cpu_gbps), cpu_gbps, modes=modes, _pred=pre, **kwargs):
            rows.append({"ratio": r, **res.as_row()})
    return rows


def sweep_ratios(lo: float = 0.25, hi: float = 4.0, n: int = 9) -> tuple[float, ...]:
    """``n`` geometric steps from ``lo`` to ``hi``."""
    if not 0 < lo <= hi or n < 1:
        raise ValueError("need 0 < lo <= hi and n >= 1")
    return tuple(float(v) for v in np.geomspace(lo, hi, n))


__all__ = ["ALL_MODES", "BYPASSED_TO", "FUTURE_VALUES", "MAX_HITS", "MODES", "POLICY_MODES", "PREDICTORS", "PRIOR_HITS",
           "PRIOR_WEIGHT", "SWEEP_RATIOS", "ModeTiming", "format_policy_timing", "format_sweep", "format_timing",
           "policy_decisions", "resolve_predictions", "run_kernel", "split_vs_extremes_same_state", "sweep",
           "sweep_ratios", "time_modes", "time_policies"]
