"""The command line: help, info (text and JSON), run's context and memory lines and --prompt-file, and
bench/gpu_check run through the emulator."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken.cli import main
from freetoken.device import device_status

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "info" in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "usage: freetoken" in capsys.readouterr().out


def test_info_text(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for section in ("Devices", "GPU", "CPU", "SIMD:", "transparent huge pages:", "Libraries", "numba", "nvrtc",
                    "Cache directory"):
        assert section in out
    assert "cpu  yes" in out


def test_info_json(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["devices"]["cpu"]["usable"] is True
    assert info["cpu"]["logical_cores"] >= 1
    assert isinstance(info["cpu"]["simd"], list)
    assert info["cpu"]["transparent_hugepages"] in ("always", "madvise", "never", None)
    assert info["libraries"]["numpy"]


def test_run_prompt_file_context_and_memory_lines(tmp_path, capsys):
    prompt = tmp_path / "prompt.py"
    prompt.write_text("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    argv = ["run", "--device", "cpu", "--temperature", "0", "--max-tokens", "3", "--prompt-file", str(prompt)]
    assert main([*argv, "--ctx", "256", "--kv-dtype", "fp8", "--prefill-chunk", "8", "--verbose"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(prompt.read_text())
    lines = err.splitlines()
    assert "[cpu] context 256 tokens (--ctx); KV pool fp8" in lines[0] and "prefill chunk 8 tokens" in lines[0]
    memory = [line for line in lines if "] memory: " in line]
    assert len(memory) == 1 and re.search(r"weights [\d.]+ MiB, expert slots 0.0 MiB, KV pool [\d.]+ MiB \(fp8, "
                                          r"\d+/256 tokens\), peak host RSS [\d.]+ [GM]iB", memory[0]), memory
    assert any("memory breakdown: embedding (host)" in line and "expert banks (host)" in line for line in lines)
    assert any("] weights by type: experts (host) bf16 " in line for line in lines)
    assert main(argv[:-2] + ["def add(a, b):"]) == 0
    err = capsys.readouterr().err
    assert "context 32768 tokens (the model's max_position_embeddings); KV pool bf16" in err
    assert "] memory: " in err and "memory breakdown" not in err


def test_chat_reports_context_and_memory(capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("def add(a, b):\n"))
    assert main(["chat", "--device", "cpu", "--temperature", "0", "--max-tokens", "3", "--kv-memory", "1MiB"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "context 448 tokens (max_position_embeddings 32768 capped by the KV budget: --kv-memory 1.0 MiB)" in err[0]
    assert "] memory: " in err[-2] and "(bf16, " in err[-2]
    assert "] weights by type: experts (host) bf16 " in err[-1] and "embedding (host) float32 " in err[-1]


def test_console_script_runs():
    proc = subprocess.run([sys.executable, "-m", "freetoken", "info"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Devices" in proc.stdout


@pytest.mark.skipif(device_status()["gpu"][0], reason="a GPU is present")
def test_gpu_check_says_no_gpu():
    script = ROOT / "bench" / "gpu_check.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert "no gpu device on this machine" in proc.stdout and "nothing was checked" in proc.stdout
    proc = subprocess.run([sys.executable, str(script), "--require-gpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1


# the script on the emulator: one case of each op (test_kernel_parity runs every case on emu; running them all again
# here cost ~130 s of the suite) plus the bundled model per mode. When the caches are cold gpu_check compiles every
# source for every NVRTC target and for the emulator first, in two processes (test_nvrtc then finds them cached)
@pytest.mark.slow
@pytest.mark.skipif(not device_status()["emu"][0], reason="emu device unavailable")
def test_gpu_check_table_on_emu():
    from freetoken.testing.cases import CASES

    first = {}  # op -> its first case (the cpu int8 path's cases are cpu-only: no CUDA kernel computes them)
    for case in CASES:
        if not case.cpu_only:
            first.setdefault(case.op, case)
    cases = list(first.values())
    only = "^(" + "|".join(re.escape(c.name) for c in cases) + ")$"
    script = ROOT / "bench" / "gpu_check.py"
    proc = subprocess.run([sys.executable, str(script), "--device", "emu", "--reps", "2", "--model-check",
                           "--jobs", "2", "--only", only], capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compiled " in proc.stdout and "sm_120 and emu" in proc.stdout  # every source for every target first
    for case in cases:
        line = next(line for line in proc.stdout.splitlines() if line.startswith(case.name + " "))
        assert " ok " in line, line
    assert f"{len(cases)}/{len(cases)} kernels match" in proc.stdout
    # the end-to-end half: the bundled model on the emulated device against the cpu device, decode per mode
    assert "logits vs cpu: NMSE" in proc.stdout and "  ok  " in proc.stdout
    for mode in ("gpu", "hybrid", "cpu"):
        assert f"  {mode} " in proc.stdout


def test_chat_anchor_and_rollback(capsys, monkeypatch):
    import io

    lines = "".join(f"{line}\n" for line in ("def add(a, b):", "/rollback", "/anchor one", "def sub(a, b):", "/anchors",
                                              "/rollback one", "/rollback two", "def mul(a, b):"))
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    assert main(["chat", "--device", "cpu", "--temperature", "0", "--max-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert "error: no anchor to roll back to: /anchor makes one" in err
    assert re.search(r"\(anchor one: \d+ tokens of the conversation\)", err)
    assert re.search(r"  one: \d+ tokens, device, id [0-9a-f]{16}", err)
    assert "(rolled back to one: 2 messages" in err and "error: no anchor named 'two' (have: one)" in err
    stats = [line for line in err.splitlines() if "cached tokens reused" in line]
    assert len(stats) == 3 and not stats[2].startswith("[cpu] prefill 0 ")
