"""Comparison helpers shared by the test suite and bench/gpu_check."""

from __future__ import annotations

import numpy as np


def max_error(got: np.ndarray, ref: np.ndarray) -> float:
    """Largest |got - ref| over positions where the reference is not NaN (inf if got is NaN there)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        return float("inf")
    mask = ~np.isnan(ref)
    if np.isnan(got[mask]).any():
        return float("inf")
    diff = np.abs(got[mask] - ref[mask])
    same_inf = np.isinf(got[mask]) & (got[mask] == ref[mask])
    diff[same_inf] = 0.0
    return float(diff.max()) if diff.size else 0.0


def assert_close(got, ref, atol: float = 0.0, rtol: float = 0.0, name: str = "output") -> None:
    """Every element within ``atol + rtol * |ref|``; NaN never passes unless the reference is NaN there."""
    got = np.asarray(got)
    ref = np.asarray(ref)
    if got.shape != ref.shape:
        raise AssertionError(f"{name}: shape {got.shape} != reference {ref.shape}")
    g = got.astype(np.float64)
    r = ref.astype(np.float64)
    ref_nan = np.isnan(r)
    if not np.array_equal(np.isnan(g), ref_nan):
        bad = np.argwhere(np.isnan(g) != ref_nan)[:5].tolist()
        raise AssertionError(f"{name}: NaN pattern differs from the reference at {bad}")
    with np.errstate(invalid="ignore"):
        ok = ref_nan | (g == r) | (np.abs(g - r) <= atol + rtol * np.abs(r))
    if not ok.all():
        where = np.argwhere(~ok)
        i = tuple(where[0])
        raise AssertionError(
            f"{name}: {len(where)} of {ok.size} elements out of tolerance (atol={atol}, rtol={rtol}); "
            f"first at {list(i)}: got {g[i]!r}, want {r[i]!r}; max error {max_error(g, r):.3g}"
        )


def poison(shape, dtype) -> np.ndarray:
    """An output buffer filled with a value no correct kernel writes: NaN for floats, a sentinel for ints."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return np.full(shape, np.nan, dtype=dtype)
    return np.full(shape, np.iinfo(dtype).min, dtype=dtype)


def random_record(layout, experts: int, seed: int = 0, scale: float = 0.2, bias: bool | None = None) -> dict:
    """Gaussian expert weights for ``layout`` (``RecordLayout``), quantized into its banks [experts, ...].

    Biases (``scale / 2``) are drawn when the layout has them (or ``bias`` says so)."""
    rng = np.random.default_rng(seed)
    hidden, inter = layout.hidden, layout.inter
    gate, up = (rng.standard_normal((experts, inter, hidden)).astype(np.float32) * scale for _ in range(2))
    down = rng.standard_normal((experts, hidden, inter)).astype(np.float32) * scale
    with_bias = layout.bias if bias is None else bias
    biases = {m: rng.standard_normal((experts, n)).astype(np.float32) * scale / 2
              for m, n in (("gate", inter), ("up", inter), ("down", hidden))} if with_bias else None
    return layout.quantize(gate, up, down, biases)
