"""How a run's miss policy is set up: ``--moe-mode auto`` from the stored bandwidth profile, and the oracle's priors
(a stored profile, or figures the user pinned)."""

from __future__ import annotations

from freetoken.policy.oracle import BandwidthOracle
from freetoken.policy.profile import load_profile, recommend_mode, this_hardware

#: How misses are served: ``gpu`` copies every miss in, ``cpu`` computes misses on the CPU, ``hybrid`` splits them
#: (q*), ``auto`` is what the stored ``freetoken bench bw`` profile recommends.
MODES = ("gpu", "cpu", "hybrid", "auto")


#: How the expert cache picks its victims: ``next_use`` (:mod:`freetoken.policy.next_use`'s ``RECOMMENDED``: the
#: simulator's ``default`` row, admitted on the device, bypassed misses streamed through scratch slots), ``lru``, or
#: ``auto`` (:func:`resolve_cache_policy`).
CACHE_POLICIES = ("auto", "next_use", "lru")


def resolve_cache_policy(policy: str, mode: str, prefetch: bool, slots: int, records: int,
                         mixed: bool = False) -> tuple[str, str]:
    """(``next_use`` or ``lru``, a note for the report) for the requested ``policy`` under the resolved moe ``mode``.

    ``auto`` is ``next_use`` with ``--moe-mode gpu`` (bypassed misses streamed through scratch slots), no
    ``--prefetch`` (its admissions are not calls of the policy) and fewer ``slots`` than expert ``records`` (with room
    for all nothing is evicted and the policy cannot matter); otherwise ``lru``. Under ``hybrid`` ``auto`` keeps
    ``lru``: there q* splits every miss between PCIe and the CPU by measured bandwidth, while under ``next_use`` the
    misses the policy admits are always copied and q* places only those it bypasses (the time model has that losing
    where the CPU's bandwidth is far above PCIe's, and winning elsewhere, but only the LRU split has been timed on a
    GPU: ``bench/results/policy``). ``next_use`` is there on request, except with layers of several formats
    (``mixed``: their split keeps an LRU shadow); never under ``cpu`` (it caches nothing at decode). ``next_use``
    asked for where it cannot run is an error naming the conflict."""
    if policy not in CACHE_POLICIES:
        raise ValueError(f"cache policy {policy!r}: choose one of {', '.join(CACHE_POLICIES)}")
    conflict = ("--moe-mode cpu computes every miss on the CPU and caches none" if mode == "cpu" else
                "--moe-mode hybrid splits layers of several expert formats against an LRU shadow of the cache"
                if mode == "hybrid" and mixed else
                "--prefetch admits predicted experts outside the policy's calls" if prefetch else "")
    if policy == "next_use" and conflict:
        raise ValueError(f"cache policy next_use cannot run here: {conflict}")
    if policy != "auto":
        return policy, ""
    if conflict:
        return "lru", f"cache policy auto -> lru ({conflict})"
    if slots >= records:
        return "lru", "cache policy auto -> lru (room for every expert: nothing is evicted)"
    if mode == "hybrid":
        return "lru", ("cache policy auto -> lru (--moe-mode hybrid: q* splits every miss by bandwidth; "
                       "--cache-policy next_use caches by expected use and splits only the misses it bypasses)")
    return "next_use", ""


def make_oracle(pcie_gbps: float | None = None, cpu_gbps: float | None = None) -> BandwidthOracle | None:
    """An oracle with the pinned figures, or None when none is pinned (then :func:`resolve_mode` makes one)."""
    if pcie_gbps is None and cpu_gbps is None:
        return None
    oracle = BandwidthOracle()
    oracle.inject(pcie_gbps=pcie_gbps, cpu_gbps=cpu_gbps)
    return oracle


def resolve_mode(mode: str, device, fmt: str, oracle: BandwidthOracle | None):
    """(mode, oracle, note): ``auto`` becomes the profile's recommendation (``gpu`` without a profile); the oracle
    starts from the profile's figures unless the caller brought its own."""
    if mode not in MODES:
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
