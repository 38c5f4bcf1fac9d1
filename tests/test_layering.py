"""Layering of the policy core: trace format -> policy -> simulators (freetoken.trace, freetoken.policy,
freetoken.sim). A package imports only those below it, and no module imports a private (underscore) name or module
of another package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "freetoken"
ORDER = ("trace", "policy", "sim")  # bottom to top


def _imports(path: Path):
    """(line, imported module, names) of every freetoken import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text())
    pkg = path.relative_to(ROOT.parent).with_suffix("").parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("freetoken."):
                    yield node.lineno, a.name, []
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(pkg[: len(pkg) - node.level + 1] + ((mod,) if mod else ()))
            if mod == "freetoken" or mod.startswith("freetoken."):
                yield node.lineno, mod, [a.name for a in node.names]


def _modules():
    for name in ORDER:
        for path in sorted((ROOT / name).glob("*.py")):
            yield name, path


@pytest.mark.parametrize(("package", "path"), list(_modules()), ids=lambda v: getattr(v, "name", v))
def test_policy_core_layering(package, path):
    rank = ORDER.index(package)
    for line, mod, names in _imports(path):
        parts = mod.split(".")
        targets = [parts[1]] if len(parts) > 1 else list(names)  # "from freetoken import policy"
        target = targets[0] if targets else ""
        where = f"{path.relative_to(ROOT.parent)}:{line} imports {mod}"
        for t in targets:
            if t in ORDER:
                assert ORDER.index(t) <= rank, f"{where}: {t} is above {package}"
        if target != package:
            assert not any(p.startswith("_") for p in parts[2:]), f"{where}: a private module of another package"
            private = [n for n in names if n.startswith("_")]
            assert not private, f"{where}: private names {private} of another package"
