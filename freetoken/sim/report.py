"""Plain-text reports of the decode-step time model (:mod:`freetoken.sim.timing`): one table per bandwidth point
(:func:`format_timing`) and the PCIe/CPU sweep (:func:`format_sweep`)."""

from __future__ import annotations

from collections.abc import Sequence

from freetoken.sim.table import text_table


def _us(s: float) -> str:
    return f"{s * 1e6:,.1f}"


def format_timing(results: Sequence) -> str:
    """A table: one line per (slots, mode) with tokens/s and microseconds per decode step, then notes
    (``results``: :class:`freetoken.sim.timing.ModeTiming` objects)."""
    header = ("mode", "slots", "tok/s", "step us", "transfer us", "prefetch us", "cpu us", "gpu us", "stall us",
              "hit rate", "fetched", "on cpu", "note")
    body = []
    qstar = {r.slots: r for r in results if r.mode == "qstar"}
    for r in results:
        note = []
        if r.future_value:
            note.append(f"future value {r.future_value}")
        if r.prediction is not None:
            note.append(f"{r.predictor}: precision {r.prediction.precision:.2f} recall {r.prediction.recall:.2f}; "
                        f"{r.prefetch_used:,} of {r.prefetched:,} prefetched used")
            base = qstar.get(r.slots)
            if r.mode == "qstar_prefetch" and base is not None and base.step_s > 0:
                gain = base.step_s / r.step_s - 1.0 if r.step_s > 0 else 0.0
                note.append(f"{100 * gain:+.1f}% tok/s vs qstar ({'pays' if gain > 0 else 'does not pay'})")
        body.append((r.mode, str(r.slots), f"{r.tokens_per_s:,.2f}", _us(r.step_s), _us(r.transfer_s),
                     _us(r.prefetch_s), _us(r.cpu_s), _us(r.gpu_s), _us(r.stall_s), f"{100 * r.hit_rate:.1f}%",
                     f"{r.fetched:,}", f"{r.cpu_experts:,}", "; ".join(note)))
        if r.host_rows:
            note.insert(0, f"disk {_us(r.disk_s)} us ({r.disk_reads:.2f} records read) per step")
            body[-1] = (*body[-1][:-1], "; ".join(note))
    out = text_table(header, body, left={0, 12}, groups=[r.slots for r in results])
    if results:
        r0 = results[0]
        out.append("")
        out.append(f"PCIe {r0.pcie_gbps:g} GB/s, CPU {r0.cpu_gbps:g} GB/s, GPU {r0.gpu_gbps:g} GB/s; "
                   f"{r0.steps:,} decode steps scored ({r0.window}), {r0.tokens_per_step} token(s) per step; "
                   "times are per decode step; step = gpu + stall")
        if r0.host_rows:
            out.append(f"disk tier: host memory holds {r0.host_rows:,} records, disk {r0.disk_gbps:g} GB/s; the disk "
                       "reads are part of stall")
    return "\n".join(s.rstrip() for s in out)


def format_sweep(rows: Sequence[dict]) -> str:
    """tokens/s per mode (columns) against the PCIe/CPU ratio (rows), per slot count; ``best extreme`` is
    max(fetch_all, cpu_all) and ``qstar/best`` the ratio of qstar to it."""
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    extra = "fetch_all" in modes and "cpu_all" in modes and "qstar" in modes
    header = ["slots", "PCIe/CPU", "PCIe GB/s", *modes] + (["qstar/best"] if extra else [])
    table: dict[tuple[int, float], dict] = {}
    for r in rows:
        table.setdefault((r["slots"], r["ratio"]), {"pcie": r["pcie_gbps"]})[r["mode"]] = r["tokens_per_s"]
    body = []
    for (slots, ratio), d in table.items():
        cells = [str(slots), f"{ratio:.3g}x", f"{d['pcie']:.3g}", *(f"{d.get(m, float('nan')):,.2f}" for m in modes)]
        if extra:
            cells.append(f"{d['qstar'] / max(d['fetch_all'], d['cpu_all']):.3f}")
        body.append(cells)
    out = text_table(header, body)
    out.append("tokens/s per mode; PCIe varies, the CPU bandwidth stays")
    return "\n".join(out)
