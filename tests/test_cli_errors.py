"""Bad input on the command line: one clear line on stderr and exit code 2, never a traceback; the converter never
loses data (its inputs, an existing output) and leaves no files behind."""

import io
import json
import os
import shutil

import pytest

from freetoken.cli import main
from freetoken.device import device_status
from freetoken.engine.loading.load import DEFAULT_MODEL

RUN = ["run", "--device", "cpu", "--max-tokens", "2"]


def _one_error_line(capsys, rc, *expected):
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("argv, expected", [
    (["--max-tokens", "-1", "hi"], "argument --max-tokens: must be >= 1, got -1"),
    (["--temperature", "nan", "hi"], "argument --temperature: must be a finite number >= 0, got nan"),
    (["--seed", "-1", "hi"], "argument --seed: must be >= 0, got -1"),
    (["--top-p", "0", "hi"], "argument --top-p"),
    (["--cache-slots", "x", "hi"], "argument --cache-slots: expected a whole number, got 'x'"),
    ([""], "the prompt is empty"),
    (["bad \udcff byte"], "the prompt is not valid UTF-8"),
    (["--record-trace", "/nonexistent-dir/t.npz", "hi"], "the directory /nonexistent-dir does not exist"),
])
def test_run_rejects_bad_input(capsys, argv, expected):
    _one_error_line(capsys, main([*RUN, *argv]), "freetoken run: error:", expected)


def test_prompt_past_the_context(capsys):
    _one_error_line(capsys, main([*RUN, "x y " * 50_000]), "tokens; the context holds 32768")
    _one_error_line(capsys, main([*RUN, "--ctx", "64", "x y " * 40]), "the prompt is 81 tokens; the context holds 64")


@pytest.mark.parametrize("argv, expected", [
    (["--kv-dtype", "int4", "hi"], "argument --kv-dtype: invalid choice: 'int4'"),
    (["--kv-memory", "2XB", "hi"], "argument --kv-memory: expected a size such as 2GiB, 512MiB or 1.5G, got '2XB'"),
    (["--kv-memory", "0GiB", "hi"], "argument --kv-memory: expected a size"),
    (["--ctx", "0", "hi"], "argument --ctx: must be >= 1, got 0"),
    (["--prefill-chunk", "x", "hi"], "argument --prefill-chunk: expected a whole number, got 'x'"),
    (["--ctx", "1000", "--kv-memory", "1MiB", "hi"], "--ctx 1000 needs a KV pool of"),
    (["--kv-memory", "1KiB", "hi"], "holds no block of 64 tokens"),
    ([], "give the prompt as an argument or with --prompt-file PATH"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file /nonexistent/prompt.txt: no such file"),
    (["--prompt-file", "/", "hi"], "give the prompt as an argument or with --prompt-file PATH (one of the two)"),
])
def test_run_rejects_bad_context_flags(capsys, argv, expected):
    _one_error_line(capsys, main([*RUN, *argv]), "freetoken run: error:", expected)


def test_prompt_file_errors(capsys, tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9\n")
    _one_error_line(capsys, main([*RUN, "--prompt-file", str(bad)]), f"--prompt-file {bad} is not valid UTF-8 (byte 3)")
    _one_error_line(capsys, main([*RUN, "--prompt-file", str(tmp_path)]), f"--prompt-file {tmp_path}: is a directory")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _one_error_line(capsys, main([*RUN, "--prompt-file", str(empty)]), f"the prompt is empty (--prompt-file {empty})")


def test_chat_past_the_context_is_a_message(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("x y " * 40 + "\nhi\n"))
    rc = main(["chat", "--device", "cpu", "--temperature", "0", "--max-tokens", "2", "--ctx", "64"])
    out, err = capsys.readouterr()
    assert rc == 0 and "Traceback" not in err, err
    assert "freetoken chat: error: the conversation is" in err and "the context holds 64: reset it to go on" in err
    assert "prefill" in err  # the session went on: the next message got a reply


@pytest.mark.skipif(device_status()["gpu"][0], reason="a GPU is present")
@pytest.mark.parametrize("command", [["run", "hi"], ["chat"]])
def test_gpu_without_a_gpu(capsys, monkeypatch, command):
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    _one_error_line(capsys, main([command[0], "--device", "gpu", *command[1:]]), "the gpu device is unavailable")


def test_chat_rejects_bad_utf8(capsys, monkeypatch):
    _one_error_line(capsys, main(["chat", "--device", "cpu", "--system", "\udcff"]), "--system is not valid UTF-8")

    class Stdin(io.StringIO):
        buffer = io.BytesIO(b"ok\n\xff\xfe broken\n")

        def isatty(self):
            return False

    monkeypatch.setattr("sys.stdin", Stdin())
    rc = main(["chat", "--device", "cpu", "--temperature", "0", "--max-tokens", "2"])
    out, err = capsys.readouterr()
    assert rc == 2 and "freetoken chat: error: an input line is not valid UTF-8" in err, err
    assert "Traceback" not in err


def test_debug_shows_the_traceback(capsys):
    with pytest.raises(ValueError, match="the prompt is empty"):
        main(["--debug", *RUN, ""])


# ---- the converter ---------------------------------------------------------------------------------------------
@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, path, ignore=shutil.ignore_patterns("__*", "*.py"))
    return path


def test_convert_never_writes_onto_its_inputs(checkpoint, capsys):
    config = (checkpoint / "config.json").read_bytes()
    for force in ([], ["--force"]):
        rc = main(["convert", str(checkpoint), str(checkpoint / "config.json"), *force])
        _one_error_line(capsys, rc, "is a file of the checkpoint")
        assert (checkpoint / "config.json").read_bytes() == config


def test_convert_replaces_only_with_force(checkpoint, tmp_path, capsys):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"precious")
    _one_error_line(capsys, main(["convert", str(checkpoint), str(out)]), "exists; pass --force")
    assert out.read_bytes() == b"precious"
    stale = tmp_path / ".out.gguf.partial-999999999"  # what a SIGKILLed run leaves: its process is gone
    stale.write_bytes(b"half")
    assert main(["convert", str(checkpoint), str(out), "--force"]) == 0
    assert out.read_bytes()[:4] == b"GGUF" and not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out.gguf"]


def test_convert_checks_the_output_directory_first(checkpoint, tmp_path, capsys):
    rc = main(["convert", str(checkpoint), str(tmp_path / "missing" / "out.gguf")])
    _one_error_line(capsys, rc, "does not exist")
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("field, value", [("num_attention_heads", 0), ("hidden_size", 1e12)])
def test_convert_bad_config_is_one_line_and_leaves_nothing(checkpoint, tmp_path, capsys, field, value):
    cfg = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**cfg, field: value}))
    before = sorted(os.listdir(tmp_path))
    out = tmp_path / "new" / "out.gguf"  # a missing directory is not created either
    _one_error_line(capsys, main(["convert", str(checkpoint), str(tmp_path / "out.gguf")]), field)
    _one_error_line(capsys, main(["convert", str(checkpoint), str(out)]), "does not exist")
    assert sorted(os.listdir(tmp_path)) == before
