"""One contract per op: ``freetoken.ops.OPS`` is complete and every part it names exists."""

import ast
import inspect
from importlib import import_module
from pathlib import Path

import numpy as np
import pytest

from freetoken import formats, ops
from freetoken.formats import RecordLayout
from freetoken.ops import OPS
from freetoken.paths import cuda_dir
from freetoken.testing import random_record
from freetoken.testing.cases import CASES, MODULES

ROOT = Path(__file__).resolve().parents[1]


def _resolve(path: str):
    module, _, attr = path.partition(":")
    mod = import_module(module)
    return getattr(mod, attr) if attr else mod


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_parts_exist(name):
    op = OPS[name]
    assert op.name == name and op.function.__name__ == name
    assert getattr(ops, name) is op.function, f"freetoken.ops.{name} is not the op's function"
    for src in op.cuda:
        assert (cuda_dir() / src).is_file(), f"{name}: cuda/{src} missing"
    assert op.function.__module__ == op.launcher, f"{name} is defined in {op.function.__module__}, not its launcher"
    import_module(op.launcher)
    for kernel in op.numba:
        assert kernel.startswith("freetoken.cpu_kernels."), kernel
        assert callable(_resolve(kernel)), kernel
    if not op.numba:
        assert op.cpu != "numba", f"{name} names no Numba kernel and no cpu implementation"
    assert callable(_resolve(op.reference))
    cases = [c for c in _resolve(op.cases).CASES if c.op == name]
    assert cases, f"{name} has no parity case in {op.cases}"
    assert all(c.source in op.cuda for c in cases)


def test_every_case_belongs_to_an_op():
    assert {c.op for c in CASES} <= set(OPS)
    assert len({c.name for c in CASES}) == len(CASES), "case names must be unique"
    assert {op.cases.rsplit(".", 1)[1] for op in OPS.values()} == set(MODULES)


def test_every_cuda_source_belongs_to_an_op():
    owned = {src for op in OPS.values() for src in op.cuda}
    assert {p.name for p in cuda_dir().glob("*.cu")} == owned


def test_every_exported_function_is_an_op():
    exported = {n for n in ops.__all__ if inspect.isfunction(getattr(ops, n))}
    assert exported == set(OPS)


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append(node.module or "")
    return out


def test_package_does_not_import_testing():
    """Only tests/ and bench/ import freetoken.testing: the package and the Numba kernels never do."""
    for base in (ROOT / "freetoken", ROOT / "cpu_kernels"):
        for path in base.rglob("*.py"):
            if "testing" not in path.relative_to(ROOT).parts:
                assert not any(n.startswith("freetoken.testing") for n in _imports(path)), path


def test_ops_do_not_import_models():
    """Layering: ops (and the Numba kernels) sit below models."""
    for base in (ROOT / "freetoken" / "ops", ROOT / "cpu_kernels"):
        for path in base.rglob("*.py"):
            assert not any(n.startswith("freetoken.models") for n in _imports(path)), path


def test_readme_call_form():
    """``freetoken.ops.moe_experts(x, ids, weights, banks, layout)`` as the README shows it."""
    layout = RecordLayout(formats.get("bf16"), 32, 32)
    banks = random_record(layout, 3, seed=1)
    x = np.random.default_rng(0).standard_normal((2, 32)).astype(np.float32)
    ids = np.array([[0, 2], [1, 0]], np.int32)
    w = np.full((2, 2), 0.5, np.float32)
    y = ops.moe_experts(x, ids, w, banks, layout, device="cpu")
    assert y.shape == (2, 32) and np.isfinite(y).all()
    from freetoken.ops.moe_experts import MoeWorkspace, moe_experts  # the launcher module stays importable

    assert moe_experts is ops.moe_experts and MoeWorkspace is ops.MoeWorkspace
