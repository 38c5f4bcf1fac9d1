"""Hostile files (issue 20): every case named in the issue is refused promptly with a clear error naming the file.

Seeds are the fuzz harness's tiny Qwen3-MoE checkpoint, its GGUF export and a small trace
(:func:`freetoken.testing.fuzz.make_seeds`)."""

from __future__ import annotations

import json
import resource
import shutil
import struct
import time
import zipfile

import numpy as np
import pytest

import freetoken
from freetoken.loaders import GGUFFile, LoadError, SafetensorsDir, parse_header
from freetoken.models.config import from_gguf
from freetoken.models.fields import ConfigError
from freetoken.testing import fuzz
from freetoken.trace.format import TraceError, load_trace


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return fuzz.make_seeds(tmp_path_factory.mktemp("seeds"))


def hf_copy(seeds, tmp_path, config=None, tensors: bytes | None = None):
    d = tmp_path / "model"
    shutil.copytree(seeds.hf_dir, d)
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        (d / "model.safetensors").write_bytes(tensors)
    return d


def st_header(seeds):
    data = (seeds.hf_dir / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def add_tensor(header, blob, name, like):
    """A new tensor ``name`` holding a copy of ``like``'s bytes (appended, so nothing overlaps)."""
    spec = dict(header[like])
    a, b = spec["data_offsets"]
    spec["data_offsets"] = [len(blob), len(blob) + b - a]
    header[name] = spec
    return blob + blob[a:b]


def st_bytes(header, blob, raw: str | None = None):
    text = (raw if raw is not None else json.dumps(header)).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + blob


def gguf_with(seeds, tmp_path, edit):
    """A copy of the seed GGUF after ``edit(bytearray, slots)``."""
    data = bytearray(seeds.gguf.read_bytes())
    slots = fuzz.gguf_slots(bytes(data))
    named = {s.what: s for s in slots if s.what != "tensor name"}
    named.update({bytes(data[s.off:s.off + s.width]).decode(): s for s in slots if s.what == "tensor name"})
    edit(data, named)
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(data))
    return p


def put(data, slot, value, fmt="<Q"):
    struct.pack_into(fmt, data, slot.off, value)


# ---- safetensors headers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw, match", [
    ("[" * 100_000 + "]" * 100_000, "nested 100000 deep"),
    ('{"a": {"dtype": "F32", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 4]}}', "corrupt header"),
    ('{"a": {"dtype": ["BF16"], "shape": [1], "data_offsets": [0, 2]}}', r"unsupported dtype \['BF16'\]"),
    ('{"a": {"dtype": {"x": 1}, "shape": [1], "data_offsets": [0, 2]}}', "unsupported dtype"),
    ('{"a": {"dtype": "F32", "shape": [1e308], "data_offsets": [0, 4]}}', "not a list of at most 16"),
    ('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "b": NaN}', "NaN is not valid JSON"),
    ('{"__metadata__": {"format": 1}}', "__metadata__ is not an object of strings"),
])
def test_safetensors_header_is_bounded(tmp_path, raw, match):
    p = tmp_path / "x.safetensors"
    p.write_bytes(st_bytes(None, b"\0" * 8, raw))
    t0 = time.perf_counter()
    with pytest.raises(LoadError, match=match) as e:
        parse_header(p)
    assert str(p) in str(e.value) and time.perf_counter() - t0 < 10


def test_safetensors_huge_shape_against_small_file(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(st_bytes({"a": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 16]}}, b"\0" * 16))
    with pytest.raises(LoadError, match="no larger than the data"):
        parse_header(p)


@pytest.mark.parametrize("dtype", ["U16", "I16"])
def test_bf16_relabelled_as_integers_is_refused(seeds, tmp_path, dtype):
    header, blob = st_header(seeds)
    name = "model.layers.0.self_attn.q_proj.weight"
    header[name]["dtype"] = dtype
    d = hf_copy(seeds, tmp_path, tensors=st_bytes(header, blob))
    with pytest.raises(LoadError, match=rf"q_proj.weight'.*dtype {dtype} is not a weight dtype"):
        freetoken.load(d, device="cpu")


def test_fp8_quantization_config_on_a_bf16_checkpoint(seeds, tmp_path):
    cfg = {**fuzz.TINY_CONFIG, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                       "weight_block_size": [128, 128]}}
    d = hf_copy(seeds, tmp_path, config=cfg)
    with pytest.raises(LoadError, match="quantization_config says block FP8, but this expert weight is BF16"):
        freetoken.load(d, device="cpu")


def test_every_layer_is_checked(seeds, tmp_path):
    header, blob = st_header(seeds)
    header["model.layers.1.mlp.down_proj.weight"]["shape"] = [32, 128]  # same bytes, wrong shape (layer 1)
    d = hf_copy(seeds, tmp_path, tensors=st_bytes(header, blob))
    with pytest.raises(LoadError, match=r"layers.1.mlp.down_proj.weight'.*expected shape \[64, 64\]"):
        freetoken.load(d, device="cpu")


@pytest.mark.parametrize("old, new, match", [
    ("model.layers.1.input_layernorm.weight", "model.layers.2.input_layernorm.weight",
     "layer 2 is beyond num_hidden_layers = 2"),
    ("model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.0.mlp.experts.7.up_proj.weight",
     "expert 7 of layer 0 does not exist"),
])
def test_tensors_the_config_cannot_account_for(seeds, tmp_path, old, new, match):
    header, blob = st_header(seeds)
    blob = add_tensor(header, blob, new, old)
    d = hf_copy(seeds, tmp_path, tensors=st_bytes(header, blob))
    with pytest.raises(LoadError, match=match):
        freetoken.load(d, device="cpu")


def test_stray_tensor_of_a_known_kind(seeds, tmp_path):
    header, blob = st_header(seeds)
    blob = add_tensor(header, blob, "model.layers.1.mlp.gate.weight", "model.layers.0.mlp.gate.weight")  # dense layer
    d = hf_copy(seeds, tmp_path, tensors=st_bytes(header, blob))
    with pytest.raises(LoadError, match="router tensor the config leaves unused"):
        freetoken.load(d, device="cpu")


def test_memory_is_checked_before_allocating(seeds, tmp_path, monkeypatch):
    from freetoken.loaders import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: (100_000, "test"))
    with pytest.raises(LoadError, match=r"loading needs about .* of host memory \(non-expert weights .*\) but "
                                        r"only 0.1 MiB is available \(test\)"):
        freetoken.load(seeds.hf_dir, device="cpu")
    with pytest.raises(LoadError, match="only 0.1 MiB is available"):
        freetoken.load(seeds.gguf, device="cpu")
    monkeypatch.setenv(memory.SKIP_ENV, "1")
    freetoken.load(seeds.gguf, device="cpu", ctx=32)


def test_available_bytes_sees_the_address_space_limit():
    from freetoken.loaders.memory import available_bytes

    avail, source = available_bytes()
    assert avail is not None and avail > 0 and source
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        assert "RLIMIT_AS" not in source


def test_config_json_nesting_and_size(seeds, tmp_path):
    d = hf_copy(seeds, tmp_path)
    (d / "config.json").write_text('{"a": ' + "[" * 50_000 + "]" * 50_000 + "}")
    with pytest.raises(LoadError, match="config.json: corrupt .*nested 50001 deep"):
        SafetensorsDir(d)


# ---- GGUF ---------------------------------------------------------------------------------------------------


def test_q_norm_missing_from_one_layer(seeds, tmp_path):
    def edit(data, slots):
        s = slots["blk.0.attn_q_norm.weight"]
        data[s.off:s.off + s.width] = b"blk.0.attn_q_xorm.weight"

    p = gguf_with(seeds, tmp_path, edit)
    with pytest.raises(ConfigError, match=r"bad.gguf: blk.0.attn_q_norm.weight is missing \(1 of 2 layers lack "
                                          r"attn_q_norm.weight\) while other layers have"):
        from_gguf(GGUFFile(p))


def _tensor_slot(slots, name, field):
    return slots[f"{name} {field}"]


def test_overlapping_tensor_data(seeds, tmp_path):
    def edit(data, slots):
        a = _tensor_slot(slots, "blk.0.attn_q.weight", "offset")
        b = _tensor_slot(slots, "blk.0.attn_k.weight", "offset")
        put(data, b, int.from_bytes(data[a.off:a.off + 8], "little"))

    with pytest.raises(LoadError, match=r"bad.gguf: tensor 'blk.0.attn_(q|k).weight': corrupt header: data overlaps "
                                        r"that of 'blk.0.attn_(q|k).weight'"):
        GGUFFile(gguf_with(seeds, tmp_path, edit))


def test_misaligned_tensor_data(seeds, tmp_path):
    def edit(data, slots):
        s = _tensor_slot(slots, "blk.1.attn_v.weight", "offset")
        put(data, s, int.from_bytes(data[s.off:s.off + 8], "little") + 2)

    with pytest.raises(LoadError, match="attn_v.weight'.*not a multiple of the alignment 32"):
        GGUFFile(gguf_with(seeds, tmp_path, edit))


def test_tensor_past_the_end(seeds, tmp_path):
    def edit(data, slots):
        put(data, _tensor_slot(slots, "blk.1.ffn_down.weight", "offset"), 2**20)

    with pytest.raises(LoadError, match="ffn_down.weight'.*truncated: data ends at byte"):
        GGUFFile(gguf_with(seeds, tmp_path, edit))


def test_corrupt_array_length_fails_fast(seeds, tmp_path):
    def edit(data, slots):
        put(data, slots["tokenizer.ggml.merges array length"], 2**40 + 5)

    t0 = time.perf_counter()
    with pytest.raises(LoadError, match="metadata array 'tokenizer.ggml.merges' declares 1099511627781 items"):
        GGUFFile(gguf_with(seeds, tmp_path, edit))
    assert time.perf_counter() - t0 < 10


@pytest.mark.parametrize("value", [float("nan"), -(2.0**63), 0.0, -1e-6, float("inf")])
def test_rms_epsilon_nonsense(seeds, tmp_path, value):
    def edit(data, slots):
        put(data, slots["qwen3moe.attention.layer_norm_rms_epsilon value"], value, "<f")

    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="bad.gguf: metadata key 'qwen3moe.attention.layer_norm_rms_epsilon'"):
        freetoken.load(gguf_with(seeds, tmp_path, edit), device="cpu")
    assert time.perf_counter() - t0 < 10


def test_integer_tensor_type_is_refused(seeds, tmp_path):
    def edit(data, slots):
        from gguf import GGMLQuantizationType

        put(data, _tensor_slot(slots, "blk.0.attn_output.weight", "type"), int(GGMLQuantizationType.I16), "<I")

    with pytest.raises(LoadError, match="attn_output.weight'.*stored as I16"):
        freetoken.load(gguf_with(seeds, tmp_path, edit), device="cpu")


def test_layer_beyond_block_count(seeds, tmp_path):
    def edit(data, slots):
        s = slots["blk.1.attn_norm.weight"]
        data[s.off:s.off + s.width] = b"blk.7.attn_norm.weight"

    with pytest.raises(LoadError, match="blk.1.attn_norm.weight'.*missing"):
        freetoken.load(gguf_with(seeds, tmp_path, edit), device="cpu")


# ---- traces -------------------------------------------------------------------------------------------------


def test_trace_declaring_100_million_steps(seeds, tmp_path):
    with np.load(seeds.trace) as z:
        arrays = {k: z[k] for k in z.files}
    p = tmp_path / "big.npz"
    with zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED) as zf:
        for k, v in arrays.items():
            zf.writestr(k + ".npy", fuzz._npy_bytes(v, (10**8, 2, 1, 2) if k == "decode_ids" else None))
    assert p.stat().st_size < 20_000
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with pytest.raises(TraceError, match=r"big.npz: member 'decode_ids.npy': declares a int16 array of shape "
                                         r"\(100000000, 2, 1, 2\)"):
        load_trace(p)


def test_trace_zip_bomb_is_refused(tmp_path):
    p = tmp_path / "bomb.npz"
    with zipfile.ZipFile(p, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("decode_ids.npy", b"\0" * 100)
    data = bytearray(p.read_bytes())
    # claim a 1 TB uncompressed size in the central directory
    cd = data.rfind(b"PK\x01\x02")
    struct.pack_into("<I", data, cd + 24, 2**32 - 1)
    p.write_bytes(bytes(data))
    with pytest.raises(TraceError, match="bomb.npz"):
        load_trace(p)


def test_trace_scalars_are_capped(seeds, tmp_path):
    with np.load(seeds.trace) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["num_experts"] = np.int64(2**40)
    arrays["prefill_counts"] = np.zeros((0, 2, 2**40), np.int32)[:0] if False else arrays["prefill_counts"]
    p = tmp_path / "t.npz"
    np.savez_compressed(p, **arrays)
    with pytest.raises(TraceError, match="t.npz"):
        load_trace(p)


def _gguf_string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def test_large_numeric_metadata_array_is_one_read(tmp_path):
    """gguf-py alone parses arrays item by item (minutes for millions of items); ours reads them as one view."""
    n = 4_000_000
    kv = (_gguf_string(b"general.architecture") + struct.pack("<I", 8) + _gguf_string(b"qwen3moe")
          + _gguf_string(b"big.array") + struct.pack("<IIQ", 9, 0, n) + bytes(range(256)) * (n // 256))
    tensor = _gguf_string(b"output_norm.weight") + struct.pack("<IQIQ", 1, 8, 0, 0)
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 2) + kv + tensor
    p = tmp_path / "big-meta.gguf"
    p.write_bytes(head + b"\0" * (-len(head) % 32) + np.ones(8, np.float32).tobytes())
    t0 = time.perf_counter()
    gf = GGUFFile(p)
    arr = gf.meta("big.array")
    assert time.perf_counter() - t0 < 10
    assert arr.shape == (n,) and arr.dtype == np.uint8 and int(arr[257]) == 1
    np.testing.assert_array_equal(gf.get("output_norm.weight"), np.ones(8, np.float32))


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "fp8", "weight_block_size": 128}, "unsupported fp8 weight_block_size 128"),
    ({"quant_method": "compressed-tensors", "config_groups": [1]}, "config_groups is a list"),
    ({"quant_method": "compressed-tensors", "format": ["x"]}, "unsupported compressed-tensors format"),
    ({"quant_method": 5}, "has no quant_method"),
])
def test_quantization_config_of_the_wrong_type(seeds, tmp_path, qc, match):
    d = hf_copy(seeds, tmp_path, config={**fuzz.TINY_CONFIG, "quantization_config": qc})
    with pytest.raises(LoadError, match=f"{d}/config.json: .*{match}"):
        freetoken.load(d, device="cpu")
