"""The expert formats' reference codecs and checkpoint conversions (Q8_0 and the k-quants: test_kquant_formats.py).

Decoders are checked bit for bit against independent decoders written here with ``ml_dtypes`` (and against
``gguf.quants`` for the GGUF layouts) on random bytes that include every special code. Quantizers are checked
for their per-element error bounds and Gaussian NMSE; conversions against the documented checkpoint decode.
"""

from __future__ import annotations

import gguf.quants as gq
import ml_dtypes
import numpy as np
import pytest
from gguf.quants import GGMLQuantizationType as QT
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from freetoken import formats
from freetoken.formats import RecordLayout, _fp, bf16, ds_fp4, fp8_block, mxfp4, nvfp4, q4_0

#: GGUF's Q8_0 and the k-quants (super-blocks of 256): tests/test_kquant_formats.py. Every other format is tested
#: here, so a new one fails below until this module's tables (EXPECTED_SPECS, BITS, NMSE_MAX, ...) know it.
KQUANT_NAMES = ("q8_0", "q4_k", "q5_k", "q6_k", "iq4_xs")
NAMES = tuple(name for name in formats.NAMES if name not in KQUANT_NAMES)
E, N, K = 6, 200, 160  # N and K not multiples of 128: partial fp8 blocks in both directions

# ---- independent reference decoders (ml_dtypes / gguf) ----------------------------------------------------


def ref_unpack(w: np.ndarray) -> np.ndarray:
    """Packed [..., K/2] -> codes [..., K], low nibble first."""
    return np.stack([w & 15, w >> 4], axis=-1).reshape(*w.shape[:-1], 2 * w.shape[-1])


def ref_e2m1(codes):
    return codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def ref_e4m3(bits):
    return bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def ref_e8m0(bits):
    return bits.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)


def ref_fp8_scales(s, n, k):
    return np.repeat(np.repeat(s, 128, axis=1), 128, axis=2)[:, :n, :k]


def ref_q4_0_gguf(banks):
    """Re-join our banks into GGUF Q4_0 bytes by hand and decode them with gguf.quants."""
    e, n, half_k = banks["w"].shape
    d = banks["s"][..., None].view(np.uint8)
    raw = np.concatenate([d, banks["w"].reshape(e, n, half_k // 16, 16)], axis=-1).reshape(e, n, -1)
    return gq.dequantize(raw, QT.Q4_0)


def ref_decode(name: str, b: dict) -> np.ndarray:
    """The decode column of base.py's table, written with ml_dtypes."""
    if name == "bf16":
        return b["w"].view(ml_dtypes.bfloat16).astype(np.float32)
    if name == "fp8_block":
        return ref_e4m3(b["w"]) * ref_fp8_scales(b["s"], *b["w"].shape[1:])
    if name == "nvfp4":
        return ref_e2m1(ref_unpack(b["w"])) * np.repeat(ref_e4m3(b["s"]), 16, axis=-1) * b["g"][:, None, None]
    if name in ("mxfp4", "ds_fp4"):
        return ref_e2m1(ref_unpack(b["w"])) * np.repeat(ref_e8m0(b["s"]), 32, axis=-1)
    assert name == "q4_0"
    return ref_q4_0_gguf(b)


def assert_same(got: np.ndarray, want: np.ndarray, bits: bool = True) -> None:
    """Same NaN positions; elsewhere the same float32 bits (``bits``) or the same values (+0 == -0)."""
    assert got.dtype == np.float32 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg="NaN positions differ")
    ok = ~np.isnan(want)
    if bits:
        np.testing.assert_array_equal(got.view(np.uint32)[ok], want.astype(np.float32).view(np.uint32)[ok])
    else:
        np.testing.assert_array_equal(got[ok], want[ok])


# ---- random banks with every special code -----------------------------------------------------------------

U16_SPECIALS = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF,  # f16
                0x007F, 0x0080, 0x7F7F, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFF81, 0x3F80]  # bf16
F32_SPECIALS = [0.0, -0.0, 1.0, -1.5, np.inf, -np.inf, np.nan, 1e-40, 3e38]


def random_banks(fmt, e: int, n: int, k: int, rng) -> dict[str, np.ndarray]:
    """Banks of random bits; the first elements of each bank are every byte / special 16-bit or float value."""
    out = {}
    for spec in fmt.bank_specs(n, k):
        shape = (e,) + spec.shape
        if spec.dtype == np.uint8:
            a = rng.integers(0, 256, shape, dtype=np.uint8)
            specials = np.arange(256, dtype=np.uint8)
        elif spec.dtype == np.uint16:
            a = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
            specials = np.array(U16_SPECIALS, np.uint16)
        else:
            a = (rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 6, shape)).astype(np.float32)
            specials = np.array(F32_SPECIALS, np.float32)
        flat = a.reshape(-1)
        flat[: min(flat.size, specials.size)] = specials[: flat.size]
        out[spec.name] = a
    return out


def gaussian(shape, seed=0, scale=0.05) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


# ---- schema -----------------------------------------------------------------------------------------------

EXPECTED_SPECS = {  # base.py's table for an [N, K] matrix
    "bf16": {"w": (np.uint16, (N, K))},
    "fp8_block": {"w": (np.uint8, (N, K)), "s": (np.float32, (2, 2))},
    "nvfp4": {"w": (np.uint8, (N, K // 2)), "s": (np.uint8, (N, K // 16)), "g": (np.float32, ())},
    "mxfp4": {"w": (np.uint8, (N, K // 2)), "s": (np.uint8, (N, K // 32))},
    "ds_fp4": {"w": (np.uint8, (N, K // 2)), "s": (np.uint8, (N, K // 32))},
    "q4_0": {"w": (np.uint8, (N, K // 2)), "s": (np.uint16, (N, K // 32))},
}
BITS = {"bf16": 16, "fp8_block": 8 + 32 / 128**2, "nvfp4": 4.5, "mxfp4": 4.25, "ds_fp4": 4.25, "q4_0": 4.5}


@pytest.mark.parametrize("name", NAMES)
def test_bank_specs_match_base_table(name):
    fmt = formats.get(name)
    assert fmt.name == name and fmt.k_multiple == 32 and fmt.bits_per_weight == pytest.approx(BITS[name])
    got = {s.name: (s.dtype, s.shape) for s in fmt.bank_specs(N, K)}
    assert got == {b: (np.dtype(d), s) for b, (d, s) in EXPECTED_SPECS[name].items()}


@pytest.mark.parametrize("name", formats.NAMES)
def test_quantize_output_matches_specs(name):
    fmt = formats.get(name)
    k = K if K % fmt.k_multiple == 0 else 2 * fmt.k_multiple  # the k-quants' super-blocks: K = 512
    banks = fmt.quantize(gaussian((3, N, k)))
    specs = fmt.bank_specs(N, k)
    assert sorted(banks) == sorted(s.name for s in specs)
    for s in specs:
        assert banks[s.name].dtype == s.dtype and banks[s.name].shape == (3,) + s.shape, s.name
    assert fmt.check_banks(banks, N, k) == 3
    assert fmt.dequantize(banks).shape == (3, N, k)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_record_layout_accepts_quantize_output(name, bias):
    hidden, inter = 96, 160
    layout = RecordLayout(formats.get(name), hidden, inter, bias)
    gate, up, down = gaussian((2, inter, hidden), 1), gaussian((2, inter, hidden), 2), gaussian((2, hidden, inter), 3)
    biases = {"gate": gaussian((2, inter), 4), "up": gaussian((2, inter), 5), "down": gaussian((2, hidden), 6)}
    banks = layout.quantize(gate, up, down, biases if bias else None)
    assert layout.check(banks) == 2
    assert {f"{m}.{s.name}" for m in ("gate", "up", "down") for s in formats.get(name).bank_specs(8, 32)} <= set(banks)
    deq = layout.dequantize(banks)
    assert deq["gate"].shape == gate.shape and deq["down"].shape == down.shape


@pytest.mark.parametrize("name", NAMES)
def test_bad_banks_raise_naming_the_bank(name):
    fmt = formats.get(name)
    good = fmt.quantize(gaussian((2, N, K)))
    for bank in good:
        missing = {b: a for b, a in good.items() if b != bank}
        with pytest.raises(ValueError, match=f"'{bank}'"):
            fmt.dequantize(missing)
        other = np.float64 if good[bank].dtype == np.float32 else np.float32
        with pytest.raises(ValueError, match=rf"(^|\.){bank}: "):
            fmt.dequantize({**good, bank: good[bank].astype(other)})
        bad_shape = good[bank][..., :-1] if good[bank].ndim > 1 else good[bank][:, None]
        with pytest.raises(ValueError, match=rf"(^|\.){bank}: "):
            fmt.dequantize({**good, bank: bad_shape})
        if bank != "w":  # the expert count comes from "w"
            with pytest.raises(ValueError, match=rf"\.{bank}: 1 experts"):
                fmt.dequantize({**good, bank: good[bank][:1]})
    layout = RecordLayout(fmt, 64, 96)
    banks = layout.quantize(gaussian((1, 96, 64)), gaussian((1, 96, 64)), gaussian((1, 64, 96)))
    for name_ in banks:  # a record's errors name the matrix and the bank
        with pytest.raises(ValueError, match=rf"^{name_}: "):
            layout.check({**banks, name_: banks[name_].astype(np.float64)})


@pytest.mark.parametrize("name", NAMES)
def test_bad_shapes_raise(name):
    fmt = formats.get(name)
    with pytest.raises(ValueError, match="32"):
        fmt.quantize(gaussian((1, 8, 48)))
    with pytest.raises(ValueError, match="32"):
        RecordLayout(fmt, 48, 64)
    with pytest.raises(ValueError, match=r"\[E, N, K\]"):
        fmt.quantize(gaussian((8, 64)))
    with pytest.raises(ValueError, match="dtype"):
        fmt.quantize(np.ones((1, 8, 32), np.int32))
    if name != "bf16":
        w = gaussian((1, 8, 64))
        w[0, 3, 5] = np.nan
        with pytest.raises(ValueError, match="NaN"):
            fmt.quantize(w)


# ---- decode ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_decode_matches_reference_on_all_codes(name):
    fmt = formats.get(name)
    banks = random_banks(fmt, E, N, K, np.random.default_rng(NAMES.index(name)))
    with np.errstate(all="ignore"):  # the references overflow and multiply inf by 0 like we do
        assert_same(fmt.dequantize(banks), ref_decode(name, banks))


def test_q4_0_decode_matches_base_formula():
    banks = random_banks(q4_0.FORMAT, 2, 8, 64, np.random.default_rng(7))
    qs = banks["w"].reshape(2, 8, 2, 16)
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32) - 8  # element j, then j + 16
    d = banks["s"].view(np.float16).astype(np.float32)[..., None]
    with np.errstate(invalid="ignore"):
        assert_same(q4_0.FORMAT.dequantize(banks), (q * d).reshape(2, 8, 64))


def test_scalar_decoders_match_ml_dtypes():
    b = np.arange(256, dtype=np.uint8)
    assert_same(_fp.e4m3_decode(b), ref_e4m3(b))
    assert_same(_fp.e8m0_decode(b), ref_e8m0(b))
    assert np.isnan(_fp.e8m0_decode(np.uint8(255))) and _fp.e8m0_decode(np.uint8(0)) == np.float32(2.0**-127)
    assert_same(_fp.e2m1_decode(b[:16]), ref_e2m1(b[:16]))
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    assert_same(_fp.bf16_decode(h), h.view(ml_dtypes.bfloat16).astype(np.float32))
    assert_same(_fp.f16_decode(h), h.view(np.float16).astype(np.float32))
    packed = np.random.default_rng(0).integers(0, 256, (3, 16), dtype=np.uint8)
    np.testing.assert_array_equal(_fp.unpack_nibbles(packed), ref_unpack(packed))
    np.testing.assert_array_equal(_fp.pack_nibbles(_fp.unpack_nibbles(packed)), packed)


# ---- encoders ---------------------------------------------------------------------------------------------


def _e2m1_probe_values() -> np.ndarray:
    grid = np.abs(_fp.E2M1_VALUES[:8]).astype(np.float32)
    mids = (grid[:-1] + grid[1:]) / 2
    pts = np.concatenate([grid, mids, [6.5, 7.0, 1e30, 1e-30, 0.0]]).astype(np.float32)
    near = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0))])
    rnd = np.random.default_rng(1).uniform(-8, 8, 20000).astype(np.float32)
    return np.concatenate([near, -near, rnd])


def test_e2m1_encode_is_round_to_nearest_even_and_saturates():
    x = _e2m1_probe_values()
    codes = _fp.e2m1_encode(x)
    np.testing.assert_array_equal(codes, x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))
    # Brute force: the decoded value is a nearest grid value of the saturated input.
    err = np.abs(_fp.e2m1_decode(codes) - np.clip(x, -6, 6))
    best = np.abs(_fp.E2M1_VALUES[None, :] - np.clip(x, -6, 6)[:, None]).min(axis=1)
    np.testing.assert_array_equal(err, best)


@settings(max_examples=200, deadline=None)
@given(st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_e2m1_encode_property(v):
    x = np.array([v], np.float32)
    assert _fp.e2m1_encode(x)[0] == x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)[0]


def test_e4m3_encode_saturates_instead_of_nan():
    x = np.array([448, 463.9, 464, 1e6, -1e30, 2.0**-10, -0.0], np.float32)
    np.testing.assert_array_equal(_fp.e4m3_decode(_fp.e4m3_encode(x)), [448, 448, 448, 448, -448, 0, -0.0])


# ---- quantize ---------------------------------------------------------------------------------------------


def _half_gap(a: np.ndarray) -> np.ndarray:
    """Largest nearest-rounding error of e2m1 at magnitude ``a`` (in scale units), saturation included."""
    return np.where(a <= 2, 0.25, np.where(a <= 4, 0.5, np.maximum(1.0, a - 6)))


def _error_bound(name: str, w: np.ndarray, banks: dict) -> np.ndarray:
    """Per-element bound on |w - dequantize(quantize(w))| implied by each quantizer's recipe."""
    a = np.abs(w)
    if name == "bf16":
        return a * 2.0**-8  # unit roundoff of an 8-bit significand
    if name == "fp8_block":  # e4m3: 4-bit significand (rel. 2^-4), subnormal spacing 2^-9 of the block scale
        s = ref_fp8_scales(banks["s"], *w.shape[1:])
        return np.maximum(a * 2.0**-4, s * 2.0**-10) * (1 + 1e-6)
    if name == "nvfp4":
        step = np.repeat(ref_e4m3(banks["s"]), 16, axis=-1) * banks["g"][:, None, None]
        return step * _half_gap(a / step) * (1 + 1e-6)
    if name in ("mxfp4", "ds_fp4"):
        step = np.repeat(ref_e8m0(banks["s"]), 32, axis=-1)
        return step * _half_gap(a / step)  # up to 2 steps where OCP's scale saturates values in (6, 8)
    # q4_0: |(q - 8) d - w| <= |d| (half a step; a full step on the side clipped at q = 15), and rounding d to
    # fp16 adds 9 |d - d16| at most: half an fp16 ulp, relative 2^-11 or, for subnormal d, absolute 2^-25.
    d16 = np.repeat(np.abs(banks["s"].view(np.float16).astype(np.float32)), 32, axis=-1)
    return d16 * (1 + 9 * 2.0**-11) * 1.001 + 9 * 2.0**-25


# Gaussian NMSE ceilings, a few percent above what these recipes give on this data (bf16 2.7e-6, fp8_block 7.0e-4,
# nvfp4 9.0e-3, mxfp4 1.39e-2, q4_0 7.4e-3; see bench/format_nmse.py): a worse rounding or scale rule exceeds them.
NMSE_MAX = {"bf16": 4e-6, "fp8_block": 8e-4, "nvfp4": 1.0e-2, "mxfp4": 1.45e-2, "ds_fp4": 1.45e-2, "q4_0": 8e-3}


@pytest.mark.parametrize("name", NAMES)
def test_quantize_error_bounds(name):
    fmt = formats.get(name)
    w = gaussian((4, 192, 1024), seed=3)
    w[0, :, :512] *= 1e-3  # a wide dynamic range within one matrix
    w[1] *= 1e3
    banks = fmt.quantize(w)
    dq = fmt.dequantize(banks)
    assert np.isfinite(dq).all()
    err = np.abs(dq - w)
    bound = _error_bound(name, w, banks)
    worst = np.unravel_index(np.argmax(err - bound), w.shape)
    assert (err <= bound).all(), (worst, w[worst], dq[worst], bound[worst])
    g = gaussian((4, 192, 1024), seed=4)
    dg = fmt.dequantize(fmt.quantize(g))
    nmse = float(((dg.astype(np.float64) - g) ** 2).sum() / (g.astype(np.float64) ** 2).sum())
    assert nmse < NMSE_MAX[name], nmse


@pytest.mark.parametrize("name", NAMES)
def test_quantize_zeros(name):
    fmt = formats.get(name)
    z = fmt.dequantize(fmt.quantize(np.zeros((2, 8, 256), np.float32)))
    assert np.isfinite(z).all() and (z == 0).all()
    w = gaussian((1, 160, 256))
    w[:, :, 128:] = 0.0  # an all-zero block (every format's block fits) next to nonzero ones
    w[:, :, :4] = -0.0
    dq = fmt.dequantize(fmt.quantize(w))
    assert np.isfinite(dq).all() and (dq[:, :, 128:] == 0).all()


def test_bf16_quantize_is_ml_dtypes_rounding():
    w = np.concatenate([gaussian((1, 4, 64)), np.full((1, 1, 64), np.inf, np.float32)], axis=1)
    w[0, 0, :3] = [np.nan, 3.4e38, -1e-45]
    dq = bf16.FORMAT.dequantize(bf16.FORMAT.quantize(w))
    assert_same(dq, w.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_fp8_block_partial_blocks():
    w = gaussian((2, 200, 96), seed=5)  # 2 x 1 blocks: 128 x 96 and 72 x 96
    w[1, 150, 7] = 3.0
    banks = fp8_block.FORMAT.quantize(w)
    assert banks["s"].shape == (2, 2, 1)
    amax = np.array([[np.abs(x[:128]).max(), np.abs(x[128:]).max()] for x in w], np.float32)
    np.testing.assert_array_equal(banks["s"][..., 0], amax / np.float32(448))
    assert ref_e4m3(banks["w"][1, 150, 7:8])[0] == 448  # the block maximum lands on e4m3's maximum
    assert_same(fp8_block.FORMAT.dequantize(banks), ref_decode("fp8_block", banks))


def test_nvfp4_quantize_recipe():
    w = gaussian((3, 32, 64), seed=6)
    w[2] = 0.0
    banks = nvfp4.FORMAT.quantize(w)
    amax = np.abs(w).max(axis=(1, 2))
    np.testing.assert_array_equal(banks["g"][:2], amax[:2] / np.float32(6 * 448))
    assert banks["g"][2] == 1.0 and (banks["s"][2] == 0).all()
    bmax = np.abs(w[:2].reshape(2, 32, 4, 16)).max(-1)
    want = (bmax / (np.float32(6) * banks["g"][:2, None, None])).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(banks["s"][:2], want)


def test_mxfp4_quantize_recipe_and_gguf_agreement():
    w = gaussian((2, 16, 256), seed=8)
    w[0, 0, :32] = 0.0
    w[0, 1, :32] = 1e-45  # below 2^-127 * 0.5 * 4: the exponent clamps at e8m0's minimum
    banks = mxfp4.FORMAT.quantize(w)
    amax = np.abs(w.reshape(2, 16, 8, 32)).max(-1)
    with np.errstate(divide="ignore"):
        want = np.where(amax > 0, np.clip(np.floor(np.log2(amax.astype(np.float64))) - 2 + 127, 0, 254), 127)
    np.testing.assert_array_equal(banks["s"], want.astype(np.uint8))
    # ggml's MXFP4 quantizer uses the same OCP exponent and nearest values (ties aside, absent in random data).
    ours = mxfp4.FORMAT.dequantize(mxfp4.FORMAT.quantize(w[1:]))
    assert_same(ours, gq.dequantize(gq.quantize(w[1:], QT.MXFP4), QT.MXFP4), bits=False)


# ---- q4_0 and GGUF ----------------------------------------------------------------------------------------


def test_q4_0_matches_gguf_bytes_and_decode():
    w = gaussian((3, 40, 256), seed=9)
    w[0, 0, :32] = 0.0
    ref = gq.quantize(w, QT.Q4_0)
    banks = q4_0.FORMAT.quantize(w)
    np.testing.assert_array_equal(q4_0.to_gguf(banks), ref)
    assert_same(q4_0.FORMAT.dequantize(banks), gq.dequantize(ref, QT.Q4_0))


def test_q4_0_from_gguf_flat_bytes_and_errors():
    raw = np.random.default_rng(10).integers(0, 256, (2, 3, 4 * 18), dtype=np.uint8)
    banks = q4_0.from_gguf(raw.reshape(-1), shape=(2, 3, 128))
    np.testing.assert_array_equal(q4_0.to_gguf(banks), raw)
    with pytest.raises(ValueError, match="raw"):
        q4_0.from_gguf(raw.reshape(-1)[:-1], shape=(2, 3, 128))
    with pytest.raises(ValueError, match="raw"):
        q4_0.from_gguf(raw[..., :-1])
    with pytest.raises(ValueError, match="raw"):
        q4_0.from_gguf(raw[0])  # no expert dimension
    with pytest.raises(ValueError, match="raw"):
        q4_0.from_gguf(raw.astype(np.int16))


def _gguf_bytes(block_bytes: int):
    shapes = st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 3))
    return shapes.flatmap(lambda s: hnp.arrays(np.uint8, (s[0], s[1], s[2] * block_bytes)))


@settings(max_examples=40, deadline=None)
@given(_gguf_bytes(18))
def test_q4_0_gguf_round_trip_property(raw):
    banks = q4_0.from_gguf(raw)
    np.testing.assert_array_equal(q4_0.to_gguf(banks), raw)
    with np.errstate(invalid="ignore"):
        assert_same(q4_0.FORMAT.dequantize(banks), gq.dequantize(raw, QT.Q4_0))


@settings(max_examples=40, deadline=None)
@given(_gguf_bytes(17))
def test_mxfp4_gguf_round_trip_property(raw):
    raw = raw.copy()
    raw.reshape(-1, 17)[:, 0] %= 255  # e8m0 255: ggml decodes 2^128, OCP (and we) NaN; checked below
    banks = mxfp4.from_gguf(raw)
    np.testing.assert_array_equal(mxfp4.to_gguf(banks), raw)
    with np.errstate(over="ignore"):
        assert_same(mxfp4.FORMAT.dequantize(banks), gq.dequantize(raw, QT.MXFP4), bits=False)  # ggml: +0 for -0


def test_mxfp4_from_gguf_all_codes_and_nan_scale():
    rng = np.random.default_rng(11)
    raw = rng.integers(0, 256, (2, 300, 2 * 17), dtype=np.uint8)
    blk = raw.reshape(-1, 17)
    blk[:, 0] = np.arange(blk.shape[0]) % 256  # every e8m0 byte, 255 included
    banks = mxfp4.from_gguf(raw)
    dq = mxfp4.FORMAT.dequantize(banks)
    ok = (blk[:, 0] != 255).reshape(2, 300, 2).repeat(32, axis=-1)
    with np.errstate(over="ignore"):
        assert_same(dq, ref_decode("mxfp4", banks))
        ref = gq.dequantize(raw, QT.MXFP4)
    np.testing.assert_array_equal(dq[ok], ref[ok])
    assert np.isnan(dq[~ok]).all()


# ---- checkpoint conversions -------------------------------------------------------------------------------


def test_bf16_from_hf():
    bits = np.random.default_rng(12).integers(0, 1 << 16, (2, 8, 64), dtype=np.uint16)
    for given_ in (bits, bits.view(ml_dtypes.bfloat16)):
        banks = bf16.from_hf(given_)
        assert banks["w"].dtype == np.uint16
        assert_same(bf16.FORMAT.dequantize(banks), bits.view(ml_dtypes.bfloat16).astype(np.float32))
    with pytest.raises(ValueError, match="weight.*dtype"):
        bf16.from_hf(bits.astype(np.float32))
    with pytest.raises(ValueError, match=r"weight.*\[E, N, K\]"):
        bf16.from_hf(bits[0])
    with pytest.raises(ValueError, match="32"):
        bf16.from_hf(bits[..., :48])


def test_fp8_block_from_hf():
    rng = np.random.default_rng(13)
    w = rng.integers(0, 256, (2, 200, 160), dtype=np.uint8)
    s = rng.standard_normal((2, 2, 2)).astype(np.float32)
    for given_ in (w, w.view(ml_dtypes.float8_e4m3fn)):
        banks = fp8_block.from_hf(given_, s)
        assert_same(fp8_block.FORMAT.dequantize(banks), ref_e4m3(w) * ref_fp8_scales(s, 200, 160))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        fp8_block.from_hf(w, s[:, :1])
    with pytest.raises(ValueError, match="weight_scale_inv"):
        fp8_block.from_hf(w, s.astype(np.float64))
    with pytest.raises(ValueError, match="weight"):
        fp8_block.from_hf(w.astype(np.float32), s)


def _nvfp4_tensors(rng, e=3, n=24, k=64):
    w = rng.integers(0, 256, (e, n, k // 2), dtype=np.uint8)
    s = rng.integers(0, 256, (e, n, k // 16), dtype=np.uint8)
    s[s & 0x7F == 0x7F] = 0x38  # no NaN scales: compared by value below
    return w, s


def test_nvfp4_from_modelopt():
    rng = np.random.default_rng(14)
    w, s = _nvfp4_tensors(rng)
    g = rng.uniform(1e-4, 1e-2, 3).astype(np.float32)
    ref = ref_e2m1(ref_unpack(w)) * np.repeat(ref_e4m3(s), 16, -1) * g[:, None, None]
    for g_shape, scale in (((3,), s), ((3, 1), s.view(ml_dtypes.float8_e4m3fn))):
        banks = nvfp4.from_modelopt(w, scale, g.reshape(g_shape))
        assert banks["g"].shape == (3,)
        assert_same(nvfp4.FORMAT.dequantize(banks), ref)
    with pytest.raises(ValueError, match="weight_scale_2"):
        nvfp4.from_modelopt(w, s, g[:2])
    with pytest.raises(ValueError, match="weight_scale_2"):
        nvfp4.from_modelopt(w, s, g.astype(np.float64))
    with pytest.raises(ValueError, match="weight_scale"):
        nvfp4.from_modelopt(w, s[..., :-1], g)
    with pytest.raises(ValueError, match="weight"):
        nvfp4.from_modelopt(w[0], s[0], g[:1])


def test_nvfp4_from_compressed_tensors_within_one_ulp():
    rng = np.random.default_rng(15)
    w, s = _nvfp4_tensors(rng, e=4)
    glob = np.array([448 * 6 / 0.37, 1234.5678, 0.3, 256.0], np.float32)  # divisors; the last a power of two
    banks = nvfp4.from_compressed_tensors(w, s.view(ml_dtypes.float8_e4m3fn), glob[:, None])
    assert banks["g"].dtype == np.float32 and (banks["g"] == (np.float32(1) / glob)).all()
    dq = nvfp4.FORMAT.dequantize(banks)
    ref = ref_e2m1(ref_unpack(w)) * np.repeat(ref_e4m3(s), 16, -1) / glob[:, None, None]
    ulps = np.abs(dq.view(np.int32).astype(np.int64) - ref.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1
    assert_same(dq[3], ref[3])  # exact for a power-of-two global
    for bad in (0.0, np.inf, np.nan, 1e-39):
        with pytest.raises(ValueError, match="weight_global_scale"):
            nvfp4.from_compressed_tensors(w, s, np.array([1.0, bad, 1.0, 1.0], np.float32))


def test_mxfp4_from_gpt_oss_deinterleaves():
    rng = np.random.default_rng(16)
    e, inter, hidden = 2, 24, 64
    blocks = rng.integers(0, 256, (e, 2 * inter, hidden // 32, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (e, 2 * inter, hidden // 32), dtype=np.uint8)
    scales[0, 0, 0], scales[1, 3, 1] = 255, 0
    full = ref_e2m1(ref_unpack(blocks.reshape(e, 2 * inter, -1))) * np.repeat(ref_e8m0(scales), 32, -1)
    gate, up = mxfp4.from_gpt_oss(blocks, scales)
    assert_same(mxfp4.FORMAT.dequantize(gate), full[:, 0::2])
    assert_same(mxfp4.FORMAT.dequantize(up), full[:, 1::2])
    with pytest.raises(ValueError, match="blocks"):
        mxfp4.from_gpt_oss(blocks[:, :-1], scales[:, :-1])
    with pytest.raises(ValueError, match="scales"):
        mxfp4.from_gpt_oss(blocks, scales[..., :1])
    with pytest.raises(ValueError, match="blocks"):
        mxfp4.from_gpt_oss(blocks[..., :8], scales)


def test_mxfp4_from_gpt_oss_down_and_record():
    rng = np.random.default_rng(17)
    e, inter, hidden = 2, 64, 96
    gu_blocks = rng.integers(0, 256, (e, 2 * inter, hidden // 32, 16), dtype=np.uint8)
    gu_scales = rng.integers(110, 130, (e, 2 * inter, hidden // 32), dtype=np.uint8)
    d_blocks = rng.integers(0, 256, (e, hidden, inter // 32, 16), dtype=np.uint8)
    d_scales = rng.integers(110, 130, (e, hidden, inter // 32), dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
    gate, up = mxfp4.from_gpt_oss(gu_blocks, gu_scales)
    down = mxfp4.from_gpt_oss_down(d_blocks, d_scales)
    ref = ref_e2m1(ref_unpack(d_blocks.reshape(e, hidden, -1))) * np.repeat(ref_e8m0(d_scales.view(np.uint8)), 32, -1)
    assert_same(mxfp4.FORMAT.dequantize(down), ref)
    banks = {f"{m}.{b}": a for m, d in (("gate", gate), ("up", up), ("down", down)) for b, a in d.items()}
    assert RecordLayout(mxfp4.FORMAT, hidden, inter).check(banks) == e


def test_ds_fp4_from_deepseek():
    rng = np.random.default_rng(18)
    w = rng.integers(-128, 128, (2, 16, 64), dtype=np.int8)
    s = rng.integers(0, 256, (2, 16, 4), dtype=np.uint8)
    s.reshape(-1)[:3] = [0, 254, 255]
    with np.errstate(over="ignore"):  # e8m0 254 times 6 overflows float32
        ref = ref_e2m1(ref_unpack(w.view(np.uint8))) * np.repeat(ref_e8m0(s), 32, -1)
    for weight, scale in ((w, s), (w.view(np.uint8), s.view(ml_dtypes.float8_e8m0fnu))):
        banks = ds_fp4.from_deepseek(weight, scale)
        assert banks["w"].dtype == np.uint8
        assert_same(ds_fp4.FORMAT.dequantize(banks), ref)
    with pytest.raises(ValueError, match="scale"):
        ds_fp4.from_deepseek(w, s[..., :2])
    with pytest.raises(ValueError, match="weight"):
        ds_fp4.from_deepseek(w.astype(np.int16), s)
