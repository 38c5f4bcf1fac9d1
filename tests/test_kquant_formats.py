"""GGUF's Q8_0 and k-quant expert formats (q8_0, q4_k, q5_k, q6_k, iq4_xs): decode, GGUF byte moves, quantizers.

Decoders are checked bit for bit against ``gguf.quants.dequantize`` on random blocks, and on probe blocks whose
decoded values are the codes themselves (unit scales) or the sub-block scales themselves (unit codes), so every
code and every scale value is seen to decode right. ``from_gguf`` / ``to_gguf`` must move bytes only, as base.py's
table splits them. The quantizers (gguf-py has none for the k-quants) are checked for Gaussian NMSE and zeros.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import gguf.quants as gq
import numpy as np
import pytest
from gguf.quants import GGMLQuantizationType as QT
from test_formats import KQUANT_NAMES, assert_same, gaussian

from freetoken import formats
from freetoken.formats import RecordLayout, _kquant


def f16(x: float) -> list[int]:
    """The two little-endian bytes of fp16 ``x``."""
    return list(np.array([x], "<f2").view(np.uint8))


@dataclass(frozen=True)
class Block:
    """A GGUF block type as gguf-py lays it out, for building test blocks."""

    qtype: QT
    weights: int
    size: int
    #: The scale bytes (what the ``s`` bank holds); the rest are the quants (the ``w`` bank).
    header: slice
    #: Byte offsets of the fp16 fields (d first, then dmin where there is one).
    f16: tuple[int, ...]
    #: Distinct values of a code, and a header with d = 1, dmin = 0 and every sub-block scale 1 (value = code).
    codes: int
    unit_header: tuple[int, ...]
    #: Quants whose every code decodes to 1 under unit scales, and the distinct sub-block scale values (None:
    #: q8_0, whose only scale is d).
    unit_quants: tuple[int, ...]
    scales: int | None
    #: Q4_K / Q5_K: 6-bit mins too.
    mins: bool = False

    @property
    def quants(self) -> slice:
        return slice(self.header.stop, self.size) if self.header.start == 0 else slice(0, self.header.start)


_AFFINE_UNIT = (*f16(1), *f16(0), 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1)  # sc = 1, m = 0 for all 8 sub-blocks
BLOCKS = {
    "q8_0": Block(QT.Q8_0, 32, 34, slice(0, 2), (0,), 256, (*f16(1),), (1,) * 32, None),
    "q4_k": Block(QT.Q4_K, 256, 144, slice(0, 16), (0, 2), 16, _AFFINE_UNIT, (0x11,) * 128, 64, mins=True),
    "q5_k": Block(QT.Q5_K, 256, 176, slice(0, 16), (0, 2), 32, _AFFINE_UNIT, (0,) * 32 + (0x11,) * 128, 64,
                  mins=True),
    # codes 33 (q - 32 = 1): low nibbles 1, 2-bit high fields 2
    "q6_k": Block(QT.Q6_K, 256, 210, slice(192, 210), (208,), 64, (1,) * 16 + (*f16(1),),
                  (0x11,) * 128 + (0xAA,) * 64, 256),
    # ls = 33 (ls - 32 = 1): low nibbles 1, 2-bit high fields 2; code 8 is the table's 1
    "iq4_xs": Block(QT.IQ4_XS, 256, 136, slice(0, 8), (0,), 16, (*f16(1), 0xAA, 0xAA, 0x11, 0x11, 0x11, 0x11),
                    (0x88,) * 128, 64),
}


def module(name: str):
    return importlib.import_module(f"freetoken.formats.{name}")


def finite_f16(rng, shape) -> np.ndarray:
    """Random finite fp16 bits as uint8 [..., 2]: both signs, normals and subnormals (exponent 31 -> 0)."""
    bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    bits = np.where((bits >> 10) & 31 == 31, bits & np.uint16(0x83FF), bits).astype("<u2")
    return bits[..., None].view(np.uint8)


def random_blocks(blk: Block, e: int, n: int, k: int, rng) -> np.ndarray:
    """Random GGUF bytes uint8 [e, n, k / weights * size] whose fp16 fields are random finite values."""
    raw = rng.integers(0, 256, (e, n, k // blk.weights, blk.size), dtype=np.uint8)
    for off in blk.f16:
        raw[..., off:off + 2] = finite_f16(rng, raw.shape[:-1])
    return raw.reshape(e, n, -1)


def decode_both(name: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ours through from_gguf, gguf-py's) decode of GGUF bytes."""
    fmt = formats.get(name)
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN scales: inf * 0 and inf - inf
        return fmt.dequantize(module(name).from_gguf(raw)), gq.dequantize(raw, BLOCKS[name].qtype)


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    return float(((got.astype(np.float64) - want) ** 2).sum() / (want.astype(np.float64) ** 2).sum())


# ---- decode ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("e, n, blocks", [(1, 1, 1), (2, 7, 2), (3, 4, 1)])
@pytest.mark.parametrize("name", KQUANT_NAMES)
def test_decode_matches_gguf_on_random_blocks(name, e, n, blocks):
    blk = BLOCKS[name]
    raw = random_blocks(blk, e, n, blocks * blk.weights, np.random.default_rng(KQUANT_NAMES.index(name)))
    got, want = decode_both(name, raw)
    assert got.shape == (e, n, blocks * blk.weights)
    assert_same(got, want)


@pytest.mark.parametrize("name", KQUANT_NAMES)
def test_decode_every_code_and_scale(name):
    """Probes on 256 random blocks: unit scales make the decoded values the codes, unit codes make them the
    sub-block scales (and, for Q4_K / Q5_K, zero scales the negated mins); each must take all its values."""
    blk = BLOCKS[name]
    raw = random_blocks(blk, 2, 64, 2 * blk.weights, np.random.default_rng(20))
    flat = raw.reshape(-1, blk.size)
    codes = flat.copy()
    codes[:, blk.header] = blk.unit_header
    probes = [(codes, blk.codes)]
    if blk.scales:
        scales = flat.copy()
        scales[:, blk.quants] = blk.unit_quants
        scales[:, blk.f16[0]:blk.f16[0] + 2] = f16(1)
        if blk.mins:
            scales[:, blk.f16[1]:blk.f16[1] + 2] = f16(0)
            mins = flat.copy()
            mins[:, blk.f16[0]:blk.f16[0] + 2] = f16(0)
            mins[:, blk.f16[1]:blk.f16[1] + 2] = f16(1)
            probes.append((mins, blk.scales))
        probes.append((scales, blk.scales))
    for probe, count in probes:
        got, want = decode_both(name, probe.reshape(raw.shape))
        assert np.unique(want).size == count
        assert_same(got, want)


@pytest.mark.parametrize("name", KQUANT_NAMES)
def test_decode_inf_and_nan_scales(name):
    blk = BLOCKS[name]
    raw = random_blocks(blk, 2, 3, 2 * blk.weights, np.random.default_rng(21))
    flat = raw.reshape(-1, blk.size)
    specials = np.array([0x7C00, 0xFC00, 0x7E00, 0xFFFF, 0x0000, 0x8000, 0x3C00], "<u2")
    for i, off in enumerate(blk.f16):  # d and dmin cycle through the specials out of step
        flat[:, off:off + 2] = specials[(np.arange(flat.shape[0]) + i) % specials.size][:, None].view(np.uint8)
    got, want = decode_both(name, raw)
    assert np.isnan(want).any() and np.isinf(want).any()
    assert_same(got, want)


# ---- GGUF byte moves -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", KQUANT_NAMES)
def test_gguf_round_trip_and_split(name):
    blk, fmt, mod = BLOCKS[name], formats.get(name), module(name)
    rng = np.random.default_rng(22)
    for e, n, blocks in [(1, 1, 1), (2, 3, 4), (3, 2, 1)]:
        k = blocks * blk.weights
        raw = rng.integers(0, 256, (e, n, blocks * blk.size), dtype=np.uint8)
        banks = mod.from_gguf(raw)
        assert fmt.check_banks(banks, n, k) == e
        np.testing.assert_array_equal(mod.to_gguf(banks), raw)
        # base.py's split: "s" is each block's header bytes (little-endian fields), "w" its quants, in file order
        split = raw.reshape(e, n, blocks, blk.size)
        np.testing.assert_array_equal(banks["s"].astype(banks["s"].dtype.newbyteorder("<")).view(np.uint8),
                                      split[..., blk.header].reshape(e, n, -1))
        np.testing.assert_array_equal(banks["w"], split[..., blk.quants].reshape(e, n, -1))
        flat = mod.from_gguf(raw.reshape(-1), shape=(e, n, k))
        assert sorted(flat) == sorted(banks)
        for b in banks:
            np.testing.assert_array_equal(flat[b], banks[b])


@pytest.mark.parametrize("name", KQUANT_NAMES)
def test_from_gguf_errors_name_the_type(name):
    blk, mod = BLOCKS[name], module(name)
    raw = np.random.default_rng(23).integers(0, 256, (2, 3, 2 * blk.size), dtype=np.uint8)
    k = 2 * blk.weights
    with pytest.raises(ValueError, match=f"raw: .*{blk.qtype.name}"):
        mod.from_gguf(raw.reshape(-1)[:-1], shape=(2, 3, k))
    with pytest.raises(ValueError, match=f"raw: .*{blk.qtype.name}"):
        mod.from_gguf(raw.reshape(-1), shape=(2, 3, k + blk.weights // 2))  # K not whole blocks
    with pytest.raises(ValueError, match=f"raw: .*{blk.qtype.name}"):
        mod.from_gguf(raw[..., :-1])
    with pytest.raises(ValueError, match="raw"):
        mod.from_gguf(raw[0])  # no expert dimension
    with pytest.raises(ValueError, match="raw"):
        mod.from_gguf(raw.astype(np.int16))
    with pytest.raises(ValueError, match="shape"):
        mod.from_gguf(raw.reshape(-1), shape=(6, k))


# ---- schema ----------------------------------------------------------------------------------------------

N, K = 200, 512
EXPECTED_SPECS = {  # base.py's table for an [N, K] matrix: (w bytes per row, s dtype and columns), bits per weight
    "q8_0": ((N, K), (np.uint16, (N, K // 32)), 8.5),
    "q4_k": ((N, K // 2), (np.uint8, (N, K // 256 * 16)), 4.5),
    "q5_k": ((N, K // 256 * 160), (np.uint8, (N, K // 256 * 16)), 5.5),
    "q6_k": ((N, K // 256 * 192), (np.uint8, (N, K // 256 * 18)), 6.5625),
    "iq4_xs": ((N, K // 2), (np.uint8, (N, K // 256 * 8)), 4.25),
}


@pytest.mark.parametrize("name", KQUANT_NAMES)
def test_bank_specs_match_base_table(name):
    fmt, blk = formats.get(name), BLOCKS[name]
    w_shape, (s_dtype, s_shape), bits = EXPECTED_SPECS[name]
    assert fmt.name == name and fmt.k_multiple == blk.weights and fmt.bits_per_weight == bits
    assert gq.GGML_QUANT_SIZES[blk.qtype] == (blk.weights, blk.size)
    got = {s.name: (s.dtype, s.shape) for s in fmt.bank_specs(N, K)}
    assert got == {"w": (np.dtype(np.uint8), w_shape), "s": (np.dtype(s_dtype), s_shape)}


@pytest.mark.parametrize("name", KQUANT_NAMES)
def test_bad_shapes_and_banks_raise(name):
    fmt = formats.get(name)
    bad_k = fmt.k_multiple + fmt.k_multiple // 2
    with pytest.raises(ValueError, match=f"{name} needs K .* divisible by {fmt.k_multiple}"):
        fmt.quantize(gaussian((1, 8, bad_k)))
    with pytest.raises(ValueError, match=f"{name} needs K"):
        RecordLayout(fmt, bad_k, 512)
    w = gaussian((1, 8, 512))
    w[0, 3, 5] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        fmt.quantize(w)
    good = fmt.quantize(gaussian((2, 8, 512)))
    for bank in good:
        with pytest.raises(ValueError, match=f"'{bank}'"):
            fmt.dequantize({b: a for b, a in good.items() if b != bank})
        with pytest.raises(ValueError, match=rf"(^|\.){bank}: "):
            fmt.dequantize({**good, bank: good[bank].astype(np.float32)})
        with pytest.raises(ValueError, match=rf"(^|\.){bank}: "):
            fmt.dequantize({**good, bank: good[bank][..., :-1]})


@pytest.mark.parametrize("gate_up, down", [("q4_k", "q6_k"), ("q5_k", "q6_k"), ("iq4_xs", "q8_0"), ("q8_0", None)])
def test_record_layout_with_mixed_formats(gate_up, down):
    hidden, inter = 256, 512
    layout = RecordLayout(formats.get(gate_up), hidden, inter, down_fmt=down and formats.get(down))
    assert layout.name == (gate_up if down is None else f"{gate_up}+{down}")
    gate, up, w_down = gaussian((2, inter, hidden), 1), gaussian((2, inter, hidden), 2), gaussian((2, hidden, inter), 3)
    banks = layout.quantize(gate, up, w_down)
    assert layout.check(banks) == 2
    deq = layout.dequantize(banks)
    assert_same(deq["down"], layout.format_of("down").dequantize(layout.split(banks, "down")))
    for m, w in (("gate", gate), ("up", up), ("down", w_down)):
        assert nmse(deq[m], w) < NMSE_MAX[layout.format_of(m).name]


# ---- quantize --------------------------------------------------------------------------------------------

# Gaussian NMSE ceilings, a few percent above what the recipes give on this data (measured: q8_0 2.86e-5,
# q4_k 6.14e-3, q5_k 1.46e-3, q6_k 3.53e-4, iq4_xs 6.41e-3); the same at 1e3 times the scale.
NMSE_MAX = {"q8_0": 3.0e-5, "q4_k": 6.5e-3, "q5_k": 1.55e-3, "q6_k": 3.75e-4, "iq4_xs": 6.8e-3}


@pytest.mark.parametrize("name", KQUANT_NAMES)
def test_quantize_nmse(name):
    fmt = formats.get(name)
    g = gaussian((4, 192, 1024), seed=4)
    for scale in (1.0, 1e3):
        w = g * np.float32(scale)
        dq = fmt.dequantize(fmt.quantize(w))
        assert np.isfinite(dq).all()
        assert nmse(dq, w) < NMSE_MAX[name], scale


@pytest.mark.parametrize("name", [n for n in KQUANT_NAMES if n != "q8_0"])  # q8_0 quantizes as gguf-py does
def test_quantize_tiny_weights_keep_their_scales(name):
    """Weights of ~1e-5: super-block scales are fp16 subnormals; rounding them up instead of to nearest keeps every
    block's largest scale in range and no scale at zero (nearest rounding gave NMSE 1 to 5 here)."""
    g = gaussian((2, 64, 1024), seed=5, scale=5e-6)
    assert nmse(formats.get(name).dequantize(formats.get(name).quantize(g)), g) < 3 * NMSE_MAX[name]


@pytest.mark.parametrize("name", KQUANT_NAMES)
def test_quantize_zeros(name):
    fmt = formats.get(name)
    z = fmt.dequantize(fmt.quantize(np.zeros((2, 8, 512), np.float32)))
    assert np.isfinite(z).all() and (z == 0).all()
    w = gaussian((1, 16, 512))
    w[:, :, 256:] = 0.0  # an all-zero block next to nonzero ones
    w[:, :, 32:64] = 0.0  # zero sub-blocks inside a nonzero block
    w[:, :, :4] = -0.0
    w[:, 3] = 0.0  # an all-zero row
    dq = fmt.dequantize(fmt.quantize(w))
    assert np.isfinite(dq).all() and (dq[:, :, 256:] == 0).all() and (dq[:, :, 32:64] == 0).all()
    assert (dq[:, 3] == 0).all()


def test_q8_0_quantize_is_gguf():
    w = gaussian((3, 40, 256), seed=9)
    w[0, 0, :32] = 0.0
    ref = gq.quantize(w, QT.Q8_0)
    q8_0 = module("q8_0")
    banks = q8_0.FORMAT.quantize(w)
    np.testing.assert_array_equal(q8_0.to_gguf(banks), ref)
    assert_same(q8_0.FORMAT.dequantize(banks), gq.dequantize(ref, QT.Q8_0))


@pytest.mark.parametrize("bits, group", [(4, 32), (4, 16), (4, 64), (2, 32), (2, 1), (1, 32)])
def test_pack_fields_inverts_unpack(bits, group):
    packed = np.random.default_rng(24).integers(0, 256, (3, 2, 128), dtype=np.uint8)
    codes = _kquant.unpack_fields(packed, bits, group)
    assert codes.shape == (3, 2, 128 * 8 // bits) and codes.max() == (1 << bits) - 1
    np.testing.assert_array_equal(_kquant.pack_fields(codes, bits, group), packed)
