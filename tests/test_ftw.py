"""FTW files (docs/ftw.md): the bundled model and every family's tiny checkpoint round-trip to the same logits
(bit for bit: the same stored values reach the same kernels), on cpu and emu; experts re-quantized on conversion
equal a load that quantizes them; a hostile file is refused before anything is loaded, naming what is wrong; a
failed conversion leaves no file."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tiny_models import FAMILIES, make_checkpoint

from freetoken.convert.ftw_export import write_ftw
from freetoken.engine.loading.load import load
from freetoken.engine.loading.sources import open_source
from freetoken.loaders import LoadError
from freetoken.loaders.ftw_file import ALIGN, PREAMBLE, RECORD_HEADER_BYTES, FTWFile, checksum
from freetoken.testing.oracles import need

TOKENS = np.random.default_rng(5).integers(2, 4000, 24)


@pytest.fixture(scope="module")
def bundled_ftw(tmp_path_factory):
    path = tmp_path_factory.mktemp("ftw") / "bundled.ftw"
    return write_ftw(open_source(None), path)


@pytest.mark.parametrize("kind", ["cpu", "emu"])
def test_bundled_model_from_ftw_is_bit_exact(bundled_ftw, kind):
    from freetoken.device import device_status

    if not device_status()[kind][0]:
        pytest.skip(f"{kind} unavailable: {device_status()[kind][1]}")
    want = load(None, device=kind, ctx=64).logits(TOKENS)
    model = load(bundled_ftw, device=kind, ctx=64)
    np.testing.assert_array_equal(model.logits(TOKENS), want)
    ref = load(None, device="cpu", ctx=64)
    assert model.encode("def main():\n    return 0\n") == ref.encode("def main():\n    return 0\n")
    assert model.chat_template is not None and model.chat_template.source == ref.chat_template.source


def test_records_are_copied_straight_into_the_host_pool(bundled_ftw, monkeypatch):
    """On emu (as on a GPU) an FTW file's records go straight into the host pool's arrays: no per-layer banks are
    handed to load_layer, and the pool holds each record's stored bytes."""
    from freetoken.engine.experts.cached import CachedExperts

    def refuse(*a, **kw):
        raise AssertionError("an FTW load handed a layer's banks to load_layer")

    monkeypatch.setattr(CachedExperts, "load_layer", refuse)
    model = load(bundled_ftw, device="emu", ctx=64)
    ftw = FTWFile(bundled_ftw)
    pool, moe = model.experts.cache.pool, sorted({layer for layer, _ in ftw.records})
    for m, layer in enumerate(moe):
        for e in (0, pool.num_experts - 1):
            rec = ftw.record_banks(layer, e)
            assert all(np.array_equal(pool.layer_banks(m)[name][e], a) for name, a in rec.items())


def test_the_file_holds_what_the_index_says(bundled_ftw):
    ftw = FTWFile(bundled_ftw)
    assert ftw.tensors["embed"].storage == "bf16"  # the checkpoint's bf16, not widened
    layer0 = min(layer for layer, _ in ftw.records)
    r = ftw.records[(layer0, 0)]
    assert r.offset % ALIGN == 0 and r.nbytes == RECORD_HEADER_BYTES + ftw.layout_of(r).record_bytes
    banks = ftw.record_banks(layer0, 0)
    from freetoken.engine.loading.load import DEFAULT_MODEL
    from freetoken.loaders import SafetensorsDir

    gate = SafetensorsDir(DEFAULT_MODEL).get(f"model.layers.{layer0}.mlp.experts.0.gate_proj.weight")
    assert np.array_equal(banks["gate.w"], gate.view(np.uint16) if gate.dtype != np.uint16 else gate)


def test_experts_quantized_on_conversion_equal_a_quantizing_load(bundled_ftw, tmp_path):
    out = write_ftw(open_source(bundled_ftw), tmp_path / "q4.ftw", expert_format="q4_0")  # FTW -> FTW
    model = load(out, device="cpu", ctx=64)
    assert model.experts.layout.fmt.name == "q4_0"
    want = load(None, device="cpu", ctx=64, expert_format="q4_0").logits(TOKENS)
    np.testing.assert_array_equal(model.logits(TOKENS), want)
    # and an FTW file loaded with another expert format quantizes its records as the HF load would
    np.testing.assert_array_equal(load(bundled_ftw, device="cpu", ctx=64, expert_format="q4_0").logits(TOKENS), want)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_round_trips(family, tmp_path):
    need("torch")
    need("transformers")
    make_checkpoint(family, tmp_path / "hf")
    out = write_ftw(open_source(tmp_path / "hf"), tmp_path / "m.ftw")
    tokens = TOKENS % 128
    want = load(tmp_path / "hf", device="cpu", ctx=64).logits(tokens)
    np.testing.assert_array_equal(load(out, device="cpu", ctx=64).logits(tokens), want)


# ---- hostile files -----------------------------------------------------------------------------------------
def _copy(src, dst):
    dst.write_bytes(src.read_bytes())
    return dst


def _preamble(path):
    with open(path, "rb") as f:
        return PREAMBLE.unpack(f.read(PREAMBLE.size))


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _rewrite_index(path, edit):
    """Apply ``edit`` to the index JSON and write it back with a correct checksum (a file damaged by a writer, not
    by the disk)."""
    magic, version, off, n, _, _, align = _preamble(path)
    with open(path, "r+b") as f:
        f.seek(off)
        index = json.loads(f.read(n))
        edit(index)
        raw = json.dumps(index).encode()
        f.seek(off)
        f.write(raw)
        f.truncate(off + len(raw))
        f.seek(0)
        f.write(PREAMBLE.pack(magic, version, off, len(raw), bytes.fromhex(checksum(raw)), off + len(raw), align))


def _refused(path, match):
    with pytest.raises(LoadError, match=match) as e:
        load(path, device="cpu", ctx=64)
    assert str(path) in str(e.value)


def test_a_flipped_byte_in_a_record_names_the_record(bundled_ftw, tmp_path):
    bad = _copy(bundled_ftw, tmp_path / "bad.ftw")
    r = FTWFile(bad).records[(1, 3)]
    _flip(bad, r.offset + RECORD_HEADER_BYTES + 100)
    _refused(bad, r"expert record \(layer 1, expert 3\): checksum mismatch")
    with pytest.raises(LoadError, match="layer 1, expert 3"):
        FTWFile(bad, verify="full").record_payload(1, 3)
    FTWFile(bad, verify="none").record_payload(1, 3)  # not verified: read as it is


def test_a_flipped_byte_in_a_record_header_names_the_record(bundled_ftw, tmp_path):
    bad = _copy(bundled_ftw, tmp_path / "bad.ftw")
    r = FTWFile(bad).records[(2, 7)]
    _flip(bad, r.offset + 16)  # the expert field
    _refused(bad, r"expert record \(layer 2, expert 7\): its header does not match the index")


def test_a_flipped_byte_in_a_tensor_names_the_tensor(bundled_ftw, tmp_path):
    bad = _copy(bundled_ftw, tmp_path / "bad.ftw")
    _flip(bad, FTWFile(bad).tensors["blk.1.o_proj"].offset + 7)
    _refused(bad, r"tensor blk\.1\.o_proj: checksum mismatch")


def test_a_flipped_byte_in_the_index_is_refused(bundled_ftw, tmp_path):
    bad = _copy(bundled_ftw, tmp_path / "bad.ftw")
    _flip(bad, _preamble(bad)[2] + 50)
    _refused(bad, "index's checksum does not match")


def test_truncation_and_appending_are_refused(bundled_ftw, tmp_path):
    bad = _copy(bundled_ftw, tmp_path / "bad.ftw")
    os.truncate(bad, bad.stat().st_size - 1)
    _refused(bad, "truncated")
    with open(_copy(bundled_ftw, bad), "ab") as f:
        f.write(b"\0")
    _refused(bad, "appended")


def test_another_version_is_refused(bundled_ftw, tmp_path):
    bad = _copy(bundled_ftw, tmp_path / "bad.ftw")
    with open(bad, "r+b") as f:
        f.seek(4)
        f.write((2).to_bytes(4, "little"))
    _refused(bad, "FTW version 2; this freetoken reads version 1 only")


def test_overlapping_and_outside_records_are_refused(bundled_ftw, tmp_path):
    bad = _copy(bundled_ftw, tmp_path / "bad.ftw")

    def overlap(ix):
        ix["records"][5]["offset"] = ix["records"][4]["offset"]

    _rewrite_index(bad, overlap)
    _refused(bad, r"expert record \(layer \d+, expert \d+\) \(at \d+\) overlaps")

    def outside(ix):
        ix["records"][-1]["offset"] = 1 << 40

    _rewrite_index(_copy(bundled_ftw, bad), outside)
    _refused(bad, "runs past the data")


def test_a_missing_expert_and_an_unknown_config_field_are_refused(bundled_ftw, tmp_path):
    bad = _copy(bundled_ftw, tmp_path / "bad.ftw")
    _rewrite_index(bad, lambda ix: ix["records"].pop(9))
    _refused(bad, r"MoE layer \d+ has 15 expert records for 16 experts \(missing \[\d+\]")
    _rewrite_index(_copy(bundled_ftw, bad), lambda ix: ix["model_config"].update(new_thing=1))
    _refused(bad, r"model_config has fields this freetoken does not know: \['new_thing'\]")


def test_not_an_ftw_file(tmp_path):
    bad = tmp_path / "x.ftw"
    bad.write_bytes(b"FTWF" + b"\0" * 10)
    with pytest.raises(LoadError, match="not an FTW file"):
        FTWFile(bad)


# ---- conversion ----------------------------------------------------------------------------------------------
def test_a_failed_conversion_leaves_nothing(bundled_ftw, tmp_path, monkeypatch):
    import freetoken.convert.ftw_export as fx

    calls = []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full (test)")
        return real(*a, **kw)

    real = fx._write_layer
    monkeypatch.setattr(fx, "_write_layer", failing)
    with pytest.raises(OSError, match="disk full"):
        write_ftw(open_source(bundled_ftw), tmp_path / "out.ftw")
    assert list(tmp_path.iterdir()) == []


def test_a_killed_conversion_leaves_nothing_the_next_one_keeps(bundled_ftw, tmp_path):
    """SIGKILL cannot be caught: the killed writer's temporary file is removed by the next conversion to the same
    name, and the CLI writes the file whole."""
    stale = tmp_path / ".out.ftw.partial-999999999"  # what a SIGKILLed run leaves: its process is gone
    stale.write_bytes(b"half a file")
    r = subprocess.run([sys.executable, "-m", "freetoken", "convert", str(bundled_ftw), str(tmp_path / "out.ftw")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.ftw"]
    assert FTWFile(tmp_path / "out.ftw").index["source"] == "bundled.ftw, from default_model"
    r = subprocess.run([sys.executable, "-m", "freetoken", "convert", str(bundled_ftw), str(tmp_path / "out.ftw")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "exists; pass --force" in r.stderr
