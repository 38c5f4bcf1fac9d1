"""The suite's own rules (tests/conftest.py, freetoken.testing.oracles), checked on a scratch test directory run by
a child pytest: a module that collects no test is an error; a missing oracle skips with its reason locally and
fails in CI, whether asked through need() or pytest.importorskip; tests that need no oracle still run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MODULES = {
    "test_empty.py": "import pytest\n",
    "test_module_oracle.py": "from freetoken.testing.oracles import need\n\nneed('no_such_oracle_module')\n\n\n"
                             "def test_needs_it():\n    pass\n",
    "test_inner_oracle.py": "import pytest\n\nfrom freetoken.testing.oracles import need\n\n\n"
                            "def test_need():\n    need('no_such_oracle_module')\n\n\n"
                            "def test_importorskip():\n    pytest.importorskip('no_such_oracle_module')\n\n\n"
                            "def test_plain():\n    pass\n",
}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("hygiene")
    shutil.copy(Path(__file__).with_name("conftest.py"), root / "conftest.py")
    for name, text in MODULES.items():
        (root / name).write_text(text)
    return root


def _pytest(root: Path, ci: str) -> str:
    env = {**os.environ, "CI": ci, "COLUMNS": "300"}  # summary lines are cut at the terminal's width otherwise
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-ra", "-p", "no:cacheprovider", "--rootdir", str(root),
                           "--continue-on-collection-errors", str(root)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0  # test_empty.py alone makes the run fail
    return proc.stdout


def test_locally_missing_oracles_skip_with_their_reason(scratch):
    out = _pytest(scratch, "")
    assert "ERROR test_empty.py - test_empty.py collected no tests" in out
    # the module-level skip and the two in-test skips are listed with the caller's line and the reason
    assert "SKIPPED [1] test_module_oracle.py:3: test oracle 'no_such_oracle_module' is not importable" in out
    assert "SKIPPED [1] test_inner_oracle.py:7: test oracle 'no_such_oracle_module' is not importable" in out
    assert "SKIPPED [1] test_inner_oracle.py:11: could not import 'no_such_oracle_module'" in out
    assert "1 passed, 3 skipped, 1 error" in out


def test_in_ci_missing_oracles_fail(scratch):
    out = _pytest(scratch, "true")
    assert "ERROR test_empty.py - test_empty.py collected no tests" in out
    assert "ERROR test_module_oracle.py - Failed: test oracle 'no_such_oracle_module' is not importable" in out
    assert "FAILED test_inner_oracle.py::test_need - Failed: test oracle 'no_such_oracle_module'" in out
    assert "FAILED test_inner_oracle.py::test_importorskip - Failed: test oracle 'no_such_oracle_module'" in out
    assert "2 failed, 1 passed, 2 errors" in out
