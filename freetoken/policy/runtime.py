"""How a run's miss policy is set up: ``--moe-mode auto`` from the stored bandwidth profile, and the oracle's priors
(a stored profile, or figures the user pinned)."""

from __future__ import annotations

from freetoken.policy.oracle import BandwidthOracle
from freetoken.policy.profile import load_profile, recommend_mode, this_hardware

#: How misses are served: ``gpu`` copies every miss in, ``cpu`` computes misses on the CPU, ``hybrid`` splits them
#: (q*), ``auto`` is what the stored ``freetoken bench bw`` profile recommends.
MODES = ("gpu", "cpu", "hybrid", "auto")


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
