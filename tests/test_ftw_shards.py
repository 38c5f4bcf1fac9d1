"""Sharded FTW sets (docs/ftw.md, "Shards"): the bundled model written as four shards holds the same bytes as one
file and gives bit-identical logits (cpu, emu), opened by any shard or by the name it was written as; a per-expert
format plan shards too; a set with a shard missing, swapped in from another conversion, truncated, damaged or
rewritten is refused naming the file; a failed, interrupted or killed conversion leaves no shard; --shard-size is
parsed and refused as the other sizes are."""

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_ftw import _flip, _preamble, _rewrite_index

from freetoken.cli import main
from freetoken.convert.expert_plan import hot_cold_plan
from freetoken.convert.ftw_export import write_ftw
from freetoken.engine.loading.load import load
from freetoken.engine.loading.sources import open_source
from freetoken.loaders import LoadError
from freetoken.loaders.ftw_file import RECORD_HEADER_BYTES, FTWFile, is_ftw

TOKENS = np.random.default_rng(5).integers(2, 4000, 24)
#: The bundled model is 14.4 MB as one file (a 1.5 MB embedding, records of 110 KB): four shards.
SHARD = 4_000_000


def _names(directory):
    return sorted(p.name for p in directory.iterdir())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    src = open_source(None)
    one = tmp_path_factory.mktemp("one")
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    return {"single": write_ftw(src, one / "m.ftw"),
            "set": write_ftw(src, a / "m.ftw", shard_bytes=SHARD),
            "other": write_ftw(src, b / "m.ftw", shard_bytes=SHARD)}  # the same model converted again


@pytest.fixture
def copy(files, tmp_path):
    """A copy of the set to damage; its shards by number."""
    for p in FTWFile(files["set"]).shards:
        shutil.copy(p, tmp_path / p.name)
    return {k: tmp_path / f"m-{k:05d}-of-00004.ftw" for k in range(1, 5)}


# ---- what a set holds ------------------------------------------------------------------------------------------
def test_the_set_holds_the_single_files_bytes_whole_in_shards(files):
    one, s = FTWFile(files["single"]), FTWFile(files["set"])
    assert files["set"].name == "m-00001-of-00004.ftw"
    assert [p.name for p in s.shards] == [f"m-{k:05d}-of-00004.ftw" for k in range(1, 5)]
    assert _names(files["set"].parent) == [p.name for p in s.shards]  # nothing else left beside them
    assert s.tensors.keys() == one.tensors.keys() and s.records.keys() == one.records.keys()
    for name in one.tensors:
        np.testing.assert_array_equal(s.tensor_bytes(name), one.tensor_bytes(name))
    for key in one.records:
        np.testing.assert_array_equal(s.record_payload(*key), one.record_payload(*key))
    for i, part in enumerate(s._parts):
        held = [e for e in (*s.tensors.values(), *s.records.values()) if e.shard == i]
        assert held, f"shard {i + 1} holds nothing"
        end = max(e.offset + e.nbytes for e in held)
        assert end <= part.data_end and (end <= SHARD or len(held) == 1)  # the size is kept, nothing split
    # every shard names the set; only shard 1 holds the model's side and the table of the others
    ids = {part.index["shard"]["set"] for part in s._parts}
    assert len(ids) == 1 and ids != {FTWFile(files["other"]).index["shard"]["set"]}
    assert [("model_config" in p.index, "shards" in p.index) for p in s._parts] == [(True, True)] + [(False,
                                                                                                     False)] * 3
    assert "shard" not in one.index  # a whole model in one file is as before


def test_any_shard_and_the_written_name_open_the_set(files):
    d = files["set"].parent
    for path in (d / "m.ftw", d / "m", d / "m-00003-of-00004.ftw"):
        assert is_ftw(path)
        assert FTWFile(path).path == files["set"]
    assert not is_ftw(d) and not is_ftw(d / "n.ftw")


@pytest.mark.parametrize("kind", ["cpu", "emu"])
def test_a_sharded_set_gives_the_single_files_logits(files, kind):
    from freetoken.device import device_status

    if not device_status()[kind][0]:
        pytest.skip(f"{kind} unavailable: {device_status()[kind][1]}")
    want = load(files["single"], device=kind, ctx=64).logits(TOKENS)
    model = load(files["set"].parent / "m.ftw", device=kind, ctx=64)
    np.testing.assert_array_equal(model.logits(TOKENS), want)
    assert model.weight_files == FTWFile(files["set"]).shards  # the anchors' fingerprint covers every shard
    if kind == "cpu":
        np.testing.assert_array_equal(load(files["set"].parent / "m-00004-of-00004.ftw", device=kind,
                                           ctx=64).logits(TOKENS), want)


def test_a_mixed_format_plan_shards(tmp_path):
    src = open_source(None)
    plan = hot_cold_plan(np.random.default_rng(3).random((6, 16)), "fp8_block", "mxfp4", 0.25)
    single = write_ftw(src, tmp_path / "mixed.ftw", expert_plan=plan)
    (tmp_path / "set").mkdir()
    first = write_ftw(src, tmp_path / "set" / "mixed.ftw", expert_plan=plan, shard_bytes=2_000_000)
    s = FTWFile(first)
    assert len(s.shards) >= 3
    moe = sorted({layer for layer, _ in s.records})
    assert all(s.records[(layer, e)].fmt == plan[i][e] for i, layer in enumerate(moe) for e in range(16))
    want = load(single, device="cpu", ctx=64).logits(TOKENS)
    np.testing.assert_array_equal(load(first, device="cpu", ctx=64).logits(TOKENS), want)


def test_a_model_that_fits_one_shard_is_one_plain_file(tmp_path):
    out = write_ftw(open_source(None), tmp_path / "m.ftw", shard_bytes=1 << 30)
    assert out == tmp_path / "m.ftw" and _names(tmp_path) == ["m.ftw"]
    assert "shard" not in FTWFile(out).index


# ---- hostile sets ----------------------------------------------------------------------------------------------
def _refused(path, match, file):
    """Loading ``path`` fails with ``match``, naming ``file``."""
    with pytest.raises(LoadError, match=match) as e:
        load(path, device="cpu", ctx=64)
    assert e.value.file == str(file), str(e.value)


def _fix_table(first, k):
    """After shard ``k``'s index was rewritten, make shard 1's table describe it (a buggy writer, not a disk)."""
    path = first.with_name(first.name.replace("-00001-", f"-{k:05d}-"))
    _, _, _, _, index_sum, size, _ = _preamble(path)
    _rewrite_index(first, lambda ix: ix["shards"][k - 2].update(bytes=size, index_xxh3=index_sum.hex()))


def test_a_missing_shard_is_refused(copy):
    copy[3].unlink()
    _refused(copy[1], "missing: shard 3 of 4", copy[3])
    _refused(copy[2], "missing: shard 3 of 4", copy[3])  # opened from another shard, the same
    copy[1].unlink()
    _refused(copy[2], "missing: shard 1 of 4", copy[1])


def test_a_shard_of_another_conversion_is_refused(copy, files):
    shutil.copy(files["other"].with_name("m-00002-of-00004.ftw"), copy[2])  # same model, same sizes, other set
    _refused(copy[1], "not a shard of this set.*another conversion", copy[2])


def test_a_truncated_shard_is_refused(copy):
    os.truncate(copy[4], copy[4].stat().st_size - 4096)
    _refused(copy[1], "truncated", copy[4])


def test_a_flipped_byte_in_a_record_of_shard_2_names_the_record_and_the_shard(copy):
    ftw = FTWFile(copy[1])
    layer, expert = next(k for k, r in ftw.records.items() if r.shard == 1)
    _flip(copy[2], ftw.records[(layer, expert)].offset + RECORD_HEADER_BYTES + 300)
    _refused(copy[1], rf"expert record \(layer {layer}, expert {expert}\): checksum mismatch", copy[2])
    FTWFile(copy[1], verify="none").record_payload(layer, expert)  # not verified: read as it is


def test_a_rewritten_shard_index_is_refused(copy):
    """A shard's index changed (its size kept, its checksum made consistent) is not the shard the set was written
    with."""
    from freetoken.loaders.ftw_file import PREAMBLE, checksum

    magic, version, off, n, _, size, align = _preamble(copy[3])
    with open(copy[3], "r+b") as f:
        f.seek(off)
        raw = f.read(n).replace(b'"writer":"freetoken', b'"writer":"FREETOKEN')
        f.seek(off)
        f.write(raw)
        f.seek(0)
        f.write(PREAMBLE.pack(magic, version, off, n, bytes.fromhex(checksum(raw)), size, align))
    _refused(copy[1], "not the one shard 1's table names", copy[3])


def test_a_record_in_two_shards_is_refused(copy):
    ftw = FTWFile(copy[1])
    entry = next(r for r in ftw._parts[1].index["records"])
    _rewrite_index(copy[3], lambda ix: ix["records"].append(entry))
    _fix_table(copy[1], 3)
    _refused(copy[1], r"expert record \(layer \d+, expert \d+\) is in this shard and in m-00002-of-00004.ftw",
             copy[3])


def test_a_record_missing_from_every_shard_is_refused(copy):
    _rewrite_index(copy[3], lambda ix: ix["records"].pop(4))
    _fix_table(copy[1], 3)
    _refused(copy[1], r"MoE layer \d+ has 15 expert records for 16 experts", copy[1])


def test_a_record_running_past_its_shard_is_refused(copy):
    """No record or tensor continues in the next file: one whose bytes pass its shard's data is refused."""
    data_end = _preamble(copy[2])[2]

    def past(ix):
        ix["records"][-1]["offset"] = data_end - 4096

    _rewrite_index(copy[2], past)
    _fix_table(copy[1], 2)
    _refused(copy[1], r"expert record \(layer \d+, expert \d+\) .* runs past the data", copy[2])


def test_a_shard_under_another_name_is_refused(copy):
    lone = copy[2].with_name("lone.ftw")
    copy[2].rename(lone)
    _refused(copy[1], "missing: shard 2 of 4", copy[2])
    _refused(lone, "its index says shard 2 of 4 of a set, but it is not named", lone)


def test_two_sets_under_one_name_are_refused_by_that_name(copy, files, tmp_path):
    (tmp_path / "two").mkdir()
    two = write_ftw(open_source(files["single"]), tmp_path / "two" / "m.ftw", shard_bytes=8_000_000)
    for p in FTWFile(two).shards:
        shutil.copy(p, copy[1].parent / p.name)
    with pytest.raises(LoadError, match=r"names 2 sharded sets \(m-00001-of-00002.ftw, m-00001-of-00004.ftw\)"):
        FTWFile(copy[1].parent / "m.ftw")
    assert len(FTWFile(copy[1].parent / "m-00002-of-00002.ftw").shards) == 2  # each opens by its shards' names
    assert len(FTWFile(copy[3]).shards) == 4


# ---- conversion --------------------------------------------------------------------------------------------------
def test_a_failed_conversion_leaves_no_shard(files, tmp_path, monkeypatch):
    import freetoken.convert.ftw_export as fx

    real, calls = fx._write_layer, []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 5:  # after shards 1-2 are written
            raise OSError("disk full (test)")
        return real(*a, **kw)

    monkeypatch.setattr(fx, "_write_layer", failing)
    with pytest.raises(OSError, match="disk full"):
        write_ftw(open_source(files["single"]), tmp_path / "out.ftw", shard_bytes=SHARD)
    assert _names(tmp_path) == []


#: Converts argv[1] to argv[2] in 2 MB shards and stops in the fifth MoE layer (shards 1-3 written), having
#: touched argv[3], until it is signalled.
STOPPING = """
import pathlib, sys, time
import freetoken.convert.ftw_export as fx
from freetoken.cli import main

real, calls = fx._write_layer, []
def stopping(*a, **kw):
    calls.append(1)
    if len(calls) == 5:
        pathlib.Path(sys.argv[3]).touch()
        time.sleep(300)
    return real(*a, **kw)
fx._write_layer = stopping
sys.exit(main(["convert", sys.argv[1], sys.argv[2], "--shard-size", "2MB"]))
"""


def _stopped_conversion(src, out, marker):
    proc = subprocess.Popen([sys.executable, "-c", STOPPING, str(src), str(out), str(marker)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the conversion never reached its fifth layer"
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_an_interrupted_or_killed_conversion_leaves_no_shard(files, tmp_path, sig):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = _stopped_conversion(files["single"], out_dir / "m.ftw", tmp_path / "marker")
    assert len([n for n in _names(out_dir) if ".partial-" in n]) >= 3  # shards were being written
    proc.send_signal(sig)
    proc.wait(timeout=60)
    left = _names(out_dir)
    assert not [n for n in left if n.endswith(".ftw")], left  # no shard under its name, ever
    if sig == signal.SIGTERM:
        assert left == []
        return
    # SIGKILL cannot be caught: its temporary files stay until the next conversion to the name removes them
    assert left and all(".partial-" in n for n in left)
    assert main(["convert", str(files["single"]), str(out_dir / "m.ftw"), "--shard-size", "4MB"]) == 0
    assert _names(out_dir) == [f"m-{k:05d}-of-00004.ftw" for k in range(1, 5)]


def test_force_replaces_a_file_or_set_of_another_shape(files, tmp_path, capsys):
    src = str(files["single"])
    out = tmp_path / "m.ftw"
    assert main(["convert", src, str(out)]) == 0
    capsys.readouterr()
    assert main(["convert", src, str(out), "--shard-size", "4MB"]) == 2
    assert "m.ftw: exists; pass --force" in capsys.readouterr().err
    assert main(["convert", src, str(out), "--shard-size", "4MB", "--force"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("wrote 4 shards") and len(lines) == 5
    assert lines[1].startswith(f"  {tmp_path / 'm-00001-of-00004.ftw'}") and "expert records)" in lines[1]
    assert _names(tmp_path) == [f"m-{k:05d}-of-00004.ftw" for k in range(1, 5)]  # the single file went
    assert main(["convert", src, str(out), "--shard-size", "8MB"]) == 2
    assert "m-00001-of-00004.ftw: exists; pass --force" in capsys.readouterr().err
    assert main(["convert", src, str(out), "--shard-size", "8MB", "--force"]) == 0
    assert _names(tmp_path) == ["m-00001-of-00002.ftw", "m-00002-of-00002.ftw"]  # the 4-shard set went
    assert main(["run", "--model", str(out), "--device", "cpu", "--max-tokens", "2", "--temperature", "0",
                 "def f():"]) == 0


@pytest.mark.parametrize("value, expected", [
    ("5XB", "argument --shard-size: expected a size such as 2GiB, 512MiB or 1.5G, got '5XB'"),
    ("abc", "expected a size such as"),
    ("0", "expected a size such as"),
    ("-1GB", "expected a size such as"),
    ("5", "argument --shard-size: a shard of 5 bytes is too small (at least 1MiB; e.g. 5GB), got '5'"),
    ("1000KB", "a shard of 1000000 bytes is too small"),  # under 1 MiB
])
def test_bad_shard_sizes_are_refused(tmp_path, capsys, value, expected):
    assert main(["convert", str(tmp_path / "none"), str(tmp_path / "o.ftw"), f"--shard-size={value}"]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err
    assert _names(tmp_path) == []


def test_shard_size_is_for_ftw_outputs(tmp_path, capsys):
    from freetoken.engine.loading.load import DEFAULT_MODEL

    assert main(["convert", str(DEFAULT_MODEL), str(tmp_path / "o.gguf"), "--shard-size", "1GiB"]) == 2
    assert "--shard-size is for .ftw outputs" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least 8192 bytes"):
        write_ftw(open_source(None), tmp_path / "o.ftw", shard_bytes=100)
    assert _names(tmp_path) == []


def test_shard_sizes_take_the_usual_suffixes():
    from freetoken.cli.convert import _shard_size

    assert _shard_size("5GB") == 5 * 10**9 and _shard_size("4GiB") == 4 * 2**30
    assert _shard_size("500MB") == 500 * 10**6 and _shard_size("1.5gib") == int(1.5 * 2**30)
    assert _shard_size("2048KiB") == 2**21 and _shard_size("1MiB") == 2**20
