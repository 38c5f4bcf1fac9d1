"""How a run's miss policy is set up: ``--moe-mode auto`` from the stored bandwidth profile, the oracle's priors,
and the one-line report ``freetoken run`` prints."""

from __future__ import annotations

from freetoken.policy.oracle import BandwidthOracle
from freetoken.policy.profile import load_profile, recommend_mode, this_hardware


def resolve_mode(mode: str, device, fmt: str, oracle: BandwidthOracle | None):
    """(mode, oracle, note): ``auto`` becomes the profile's recommendation (``gpu`` without a profile); the oracle
    starts from the profile's figures unless the caller brought its own."""
    if mode not in ("gpu", "cpu", "hybrid", "auto"):
        raise ValueError(f"moe mode {mode!r}: choose gpu, cpu, hybrid or auto")
    note = ""
    profile = None
    if mode == "auto" or oracle is None:
        gpu, cpu = this_hardware(device)
        profile = load_profile(gpu, cpu, fmt)
    if mode == "auto":
        mode = recommend_mode(profile)
        note = (f"auto -> {mode} (profile: PCIe {profile.pcie_gbps:.1f} GB/s, CPU {profile.cpu_gbps:.1f} GB/s)"
                if profile else f"auto -> gpu (no bandwidth profile for {fmt} experts on this machine: run "
                f"`freetoken bench bw --model MODEL` or `--format {fmt}`)")
    if oracle is None:
        oracle = (BandwidthOracle(pcie_gbps=profile.pcie_gbps, cpu_gbps=profile.cpu_gbps) if profile
                  else BandwidthOracle())
    return mode, oracle, note


def hit_stats(decoder) -> tuple[float, int, int]:
    """(hit rate, hits, misses) of the routed experts of decode steps: with a split policy a miss is fetched or
    computed on the CPU (the cache's own counters see only the fetched ones), else the cache's counters."""
    ex = decoder.executor
    if ex is not None:
        st = ex.stats
        misses = st["fetched"] + st["cpu"]
        total = st["hits"] + misses
        return (st["hits"] / total if total else 0.0), st["hits"], misses
    cs = decoder.cache.stats()
    return cs["hit_rate"], cs["hits"], cs["misses"]


def report(decoder) -> str:
    """What the miss policy did: mode, split counts, current bandwidth estimates, prefetch precision/recall."""
    parts = [f"moe mode {decoder.moe_mode}"]
    ex = decoder.executor
    if ex is not None:
        st = ex.stats
        parts.append(f"{st['hits']} hits, {st['fetched']} fetched, {st['cpu']} on the CPU; PCIe "
                     f"{ex.oracle.pcie_gbps():.1f} GB/s, CPU {ex.oracle.cpu_gbps(ex.fmt):.1f} GB/s")
    if decoder.prefetch:
        ps = decoder.prefetch_stats
        if ps["predicted"]:
            parts.append(f"prefetch precision {ps['correct'] / ps['predicted']:.0%}, recall "
                         f"{ps['correct'] / max(ps['actual'], 1):.0%}")
        if decoder.prefetch_off:
            parts.append(f"prefetch turned off for MoE layers {sorted(decoder.prefetch_off)} (too imprecise to pay)")
    if getattr(decoder, "policy_note", ""):
        parts.append(decoder.policy_note)
    return "; ".join(parts)
