"""The README's examples work: every ```python block runs (in a subprocess with this interpreter, from an empty
directory), and every `freetoken ...` command in a ```bash block parses, as does `--help` of every subcommand the
command table names."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
SHELL_OPERATORS = {"&&", "||", "|", ";", "&", ">", ">>", "<", "2>", "2>&1", "(", ")"}
TIMEOUT_S = 600  # one block, cold kernel caches on a loaded 2-core machine included


def blocks(lang: str) -> list[tuple[int, str]]:
    """(line number of the opening fence, body) of every ```lang block in the README."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in BLOCK.finditer(text) if m.group(1) == lang]


def _first_line(code: str) -> str:
    return next((line.strip() for line in code.splitlines() if line.strip()), "")


def freetoken_commands() -> list[tuple[int, str, list[str]]]:
    """(README line, the shell line, argv after `freetoken`) of every freetoken call in the ```bash blocks."""
    found = []
    for start, body in blocks("bash"):
        for offset, line in enumerate(body.splitlines(), start=1):
            lex = shlex.shlex(line, posix=True, punctuation_chars=True)
            lex.whitespace_split = True
            lex.commenters = "#"
            tokens = list(lex)
            for i, tok in enumerate(tokens):
                if Path(tok).name == "freetoken":
                    argv = []
                    for t in tokens[i + 1:]:
                        if t in SHELL_OPERATORS:
                            break
                        argv.append(t)
                    found.append((start + offset, line.strip(), argv))
    return found


def table_subcommands() -> list[list[str]]:
    """Every subcommand the README's command table names: `run [...]` -> [run]; `trace synth|simulate|info` ->
    [trace, synth], [trace, simulate], [trace, info]."""
    text = README.read_text().replace("\\|", "|")  # pipes inside table cells are escaped
    table = re.search(r"^\| command \|.*?\n\n", text, re.MULTILINE | re.DOTALL)
    assert table, "README.md has no `| command | ... |` table"
    names = []
    for m in re.finditer(r"^\| `([a-z][\w-]*)((?: [a-z][\w|-]*)?)", table.group(0), re.MULTILINE):
        command, second = m.group(1), m.group(2).strip()
        names += [[command, s] for s in second.split("|")] if second else [[command]]
    return names


def _parse(argv: list[str]) -> tuple[int, str]:
    """(exit status, stderr) of the freetoken argument parser on ``argv``; 0 where it parses without exiting."""
    from freetoken.cli import build_parser
    from freetoken.cli.args import UsageError

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version
        return int(e.code or 0), err.getvalue()
    except UsageError as e:  # what main() prints as one line and exit code 2
        return 2, f"{e.prog}: error: {e}"
    return 0, err.getvalue()


PYTHON_BLOCKS = blocks("python")


def test_readme_has_examples():
    assert PYTHON_BLOCKS, "README.md has no ```python block"
    assert freetoken_commands() and table_subcommands()


@pytest.mark.parametrize("start, code", PYTHON_BLOCKS, ids=[f"line{s}" for s, _ in PYTHON_BLOCKS])
def test_python_block_runs(start, code, tmp_path):
    script = tmp_path / f"readme_line{start}.py"
    script.write_text(code)
    first = _first_line(code)
    try:
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"README.md line {start}, the ```python block starting {first!r}: still running after "
                    f"{TIMEOUT_S} s", pytrace=False)
    if proc.returncode != 0:
        pytest.fail(f"README.md line {start}, the ```python block starting {first!r}, exited {proc.returncode}:\n"
                    f"{proc.stderr[-4000:]}", pytrace=False)


def test_freetoken_commands_parse():
    """Each `freetoken ...` line in a ```bash block names existing subcommands and options (parsed, not run)."""
    bad = []
    for line_no, line, argv in freetoken_commands():
        code, err = _parse(argv)
        if code != 0:
            bad.append(f"README.md line {line_no}: {line}\n    {err.strip().splitlines()[-1] if err else code}")
    assert not bad, "commands the README shows that freetoken does not parse:\n" + "\n".join(bad)


def test_table_subcommands_have_help():
    bad = []
    for names in table_subcommands():
        code, err = _parse([*names, "--help"])
        if code != 0:
            bad.append(f"freetoken {' '.join(names)} --help: exit {code}: {err.strip()}")
    assert not bad, "\n".join(bad)
