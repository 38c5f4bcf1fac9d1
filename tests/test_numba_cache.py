"""Numba's on-disk cache is keyed by every kernel source (freetoken/device/numba_cache.py), so an edit to a helper in
one file reaches a cached caller in another."""

import ast
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from freetoken.device import numba_cache
from freetoken.paths import cpu_kernels_dir

ROOT = Path(__file__).resolve().parents[1]
PKG = Path(numba_cache.__file__).resolve().parents[1]

HELPER = "import numba\n\n\n@numba.njit\ndef helper(x):\n    return x + {inc}\n"
CALLER = textwrap.dedent("""
    import numba

    from ftnc_pkg.helper import helper


    @numba.njit(cache=True)
    def caller(x):
        return 2 * helper(x)
""")
# Run in a fresh process: key the cache by both files of the package ("keyed") or leave freetoken's own key, which
# does not cover them: a fixed cache directory, where Numba stamps the caller by its own file only ("fixed").
PROBE = textwrap.dedent("""
    import sys
    from pathlib import Path

    sys.path.insert(0, sys.argv[1])
    from freetoken.device import numba_cache

    if sys.argv[2] == "keyed":
        pkg = Path(sys.argv[1]) / "ftnc_pkg"
        numba_cache.configure({p.name: p for p in sorted(pkg.glob("*.py"))})
    from ftnc_pkg.caller import caller

    print(caller(1), sum(caller.stats.cache_hits.values()))
""")


def _run(tmp_path: Path, mode: str) -> tuple[int, int]:
    env = {**os.environ, "FREETOKEN_CACHE_DIR": str(tmp_path / "cache")}
    for var in ("NUMBA_CACHE_DIR", "FREETOKEN_NUMBA_CACHE_SET", "FREETOKEN_NUMBA_CACHE_USER"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "src"), mode], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    value, hits = proc.stdout.split()
    return int(value), int(hits)


def test_edit_to_helper_in_another_file_reaches_cached_caller(tmp_path):
    pkg = tmp_path / "src" / "ftnc_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text(HELPER.format(inc=1))
    (pkg / "caller.py").write_text(CALLER)
    assert _run(tmp_path, "keyed") == (4, 0)  # compiled and saved
    assert _run(tmp_path, "keyed") == (4, 1)  # loaded from the cache
    assert _run(tmp_path, "fixed") == (4, 0)
    (pkg / "helper.py").write_text(HELPER.format(inc=2))  # the same size; the caller's file is untouched
    assert _run(tmp_path, "keyed") == (6, 0)  # a new key: compiled afresh with the new helper
    assert _run(tmp_path, "fixed") == (4, 1)  # what Numba alone does: the stale machine code loads


def _imports_numba(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(n.split(".")[0] in ("numba", "llvmlite") for n in names):
            return True
    return False


def test_key_covers_every_numba_module_and_what_it_imports():
    sources = {p.resolve() for p in numba_cache.kernel_sources().values()}
    kernels = cpu_kernels_dir().resolve()
    for f in kernels.rglob("*"):
        if f.is_file() and "__pycache__" not in f.parts:
            assert f.resolve() in sources, f"{f} (cpu_kernels/) is not in the Numba cache key"
    files = [*PKG.rglob("*.py"), *kernels.rglob("*.py")]
    numba_modules = [f for f in files if _imports_numba(ast.parse(f.read_bytes()))]
    assert len(numba_modules) >= 10
    for f in numba_modules:
        assert f.resolve() in sources, f"{f} imports numba but is not in the Numba cache key"
        for node in ast.parse(f.read_bytes()).body:  # module-level freetoken imports: constants compiled in
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("freetoken."):
                parts = node.module.split(".")[1:]
                base = kernels if parts[0] == "cpu_kernels" else PKG
                rest = parts[1:] if parts[0] == "cpu_kernels" else parts
                cands = [base.joinpath(*rest).with_suffix(".py"), base.joinpath(*rest, "__init__.py")]
                target = next((c for c in cands if c.is_file()), None)
                assert target is not None and target.resolve() in sources, f"{f} imports {node.module}: not keyed"
    assert PKG / "device" / "constants.py" in sources  # the activation constants of the CPU expert kernels


def test_key_follows_every_byte(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 2\n")
    key = numba_cache.source_key({"a": a, "b": b})
    assert numba_cache.source_key({"a": a, "b": b}) == key
    b.write_text("y = 3\n")
    assert numba_cache.source_key({"a": a, "b": b}) != key
    assert numba_cache.source_key({"a": a}) != numba_cache.source_key({"c": a})  # names count too


def test_freetoken_kernels_are_cached_in_the_keyed_directory(tmp_path):
    """Every cached dispatcher of every freetoken module that imports numba, defined after a fresh ``import
    freetoken``, saves under the keyed directory; a user's NUMBA_CACHE_DIR holds it; a child process does not nest."""
    probe = textwrap.dedent("""
        import importlib, os, subprocess, sys
        import freetoken
        from freetoken.device import numba_cache

        d = numba_cache.configured_dir()
        assert d is not None and os.environ["NUMBA_CACHE_DIR"] == str(d)
        assert d == __import__("pathlib").Path(sys.argv[1]) / ("freetoken-" + d.name[-16:]), d
        n = 0
        for label in numba_cache.kernel_sources():
            if not label.startswith("freetoken.") or label.endswith(".__init__"):
                continue
            mod = importlib.import_module(label)
            for obj in vars(mod).values():
                cache = getattr(obj, "_cache", None)
                if getattr(cache, "cache_path", None) is not None:
                    assert cache.cache_path.startswith(str(d) + os.sep), (label, obj, cache.cache_path)
                    n += 1
        import numba
        assert numba.config.CACHE_DIR == str(d)
        child = subprocess.run([sys.executable, "-c", "import freetoken, os; print(os.environ['NUMBA_CACHE_DIR'])"],
                               capture_output=True, text=True, check=True)
        assert child.stdout.strip() == str(d), child.stdout
        print(n)
    """)
    user = tmp_path / "user-numba"
    env = {**os.environ, "FREETOKEN_CACHE_DIR": str(tmp_path / "cache"), "NUMBA_CACHE_DIR": str(user)}
    for var in ("FREETOKEN_NUMBA_CACHE_SET", "FREETOKEN_NUMBA_CACHE_USER"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", probe, str(user)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) >= 20  # every cached kernel was checked


def test_numba_imported_first_and_default_location(tmp_path, monkeypatch):
    """In this process numba is imported: configure sets numba.config.CACHE_DIR too; without a user NUMBA_CACHE_DIR
    the directory is <freetoken cache>/numba/<key>."""
    from numba.core import config

    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("NUMBA_CACHE_DIR", "FREETOKEN_NUMBA_CACHE_SET", "FREETOKEN_NUMBA_CACHE_USER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(config, "CACHE_DIR", config.CACHE_DIR)
    monkeypatch.setattr(numba_cache, "_configured", numba_cache._configured)
    src = tmp_path / "k.py"
    src.write_text("import numba\n")
    d = numba_cache.configure({"k": src})
    assert d == tmp_path / "cache" / "numba" / numba_cache.source_key({"k": src})
    assert d.is_dir() and config.CACHE_DIR == str(d) == os.environ["NUMBA_CACHE_DIR"]
    assert numba_cache.configure({"k": src}) == d  # inherited by a child: the same directory, not nested


def test_prune_keeps_the_recent_ones(tmp_path):
    now = time.time()
    ages = {"0000000000000001": 10, "0000000000000002": 1800, "0000000000000003": 8000, "0000000000000004": 9000,
            "0000000000000005": 60, "0000000000000006": 10000}
    for name, age in ages.items():
        (tmp_path / name / "sub").mkdir(parents=True)
        os.utime(tmp_path / name, (now - age, now - age))
    (tmp_path / "not-a-key").mkdir()
    os.utime(tmp_path / "not-a-key", (now - 1e6, now - 1e6))
    current = tmp_path / "00000000000000ff"
    current.mkdir()
    removed = numba_cache.prune(tmp_path, numba_cache._KEY_NAME, current, keep=3, min_age_s=3600)
    # kept: the current one and the 2 most recently used others; beyond those, only the ones unused for an hour go
    assert sorted(p.name for p in removed) == ["0000000000000003", "0000000000000004", "0000000000000006"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000000000000001", "0000000000000002",
                                                          "0000000000000005", "00000000000000ff", "not-a-key"]


def test_kernel_dir_found():
    assert (cpu_kernels_dir() / "moe_experts.py").is_file()
    assert numba_cache.kernel_sources()["freetoken.cpu_kernels.moe_experts"] == cpu_kernels_dir() / "moe_experts.py"


# A parallel kernel, its serial copy (serial_copy), and the old way of making one: njit over the kernel's py_func.
KERNELS = textwrap.dedent("""
    import numba as nb

    from freetoken.cpu_kernels.serial_copy import serial_copy


    @nb.njit(parallel=True, cache=True)
    def total(a):
        s = 0.0
        for i in nb.prange(a.size):
            s += a[i]
        return s


    total_serial = serial_copy(total)
    total_shared = nb.njit(cache=True)(total.py_func)
""")
# Call the named dispatchers in order; per call: cache hits, whether the loaded code has parfors (its reload hook
# starts the threads), whether the threads have started.
SERIAL_PROBE = textwrap.dedent("""
    import sys

    import numba
    import numpy as np

    sys.path.insert(0, sys.argv[1])
    import ftnc_kernels as m

    a = np.ones(64)
    for name in sys.argv[2:]:
        f = getattr(m, name)
        assert f(a) == 64.0
        cres = next(iter(f.overloads.values()))
        parfors = any(getattr(h, "__name__", "") == "_reload_parfors" for h in cres.reload_init)
        try:
            numba.threading_layer()
            started = True
        except ValueError:
            started = False
        print(name, sum(f.stats.cache_hits.values()), int(parfors), int(started))
""")


def test_serial_copy_has_its_own_cache_files(tmp_path):
    """Numba names cache files by module, qualname and line and keys entries by signature, machine and bytecode: not
    by ``parallel``. A serial copy made from the kernel's own ``py_func`` shares the kernel's entries (and loads its
    threaded code); :func:`serial_copy`'s renamed copy gets files of its own and loads single-threaded code."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "ftnc_kernels.py").write_text(KERNELS)
    env = {**os.environ, "FREETOKEN_CACHE_DIR": str(tmp_path / "cache"), "NUMBA_NUM_THREADS": "2"}
    for var in ("NUMBA_CACHE_DIR", "FREETOKEN_NUMBA_CACHE_SET", "FREETOKEN_NUMBA_CACHE_USER"):
        env.pop(var, None)

    def run(*names: str) -> dict[str, tuple[int, int, int]]:
        proc = subprocess.run([sys.executable, "-c", SERIAL_PROBE, str(src), *names], capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        rows = [line.split() for line in proc.stdout.splitlines()]
        return {r[0]: (int(r[1]), int(r[2]), int(r[3])) for r in rows}

    first = run("total", "total_serial", "total_shared")
    assert first["total"][:2] == (0, 1)  # compiled, with parfors
    assert first["total_serial"][:2] == (0, 0)  # compiled: its own entry, no parfors
    assert first["total_shared"][:2] == (1, 1)  # the old way: the kernel's entry, loaded without compiling
    index = sorted(p.name.split("-")[0] for p in (tmp_path / "cache").rglob("ftnc_kernels.*.nbi"))
    assert index == ["ftnc_kernels.total", "ftnc_kernels.total_serial"]
    fresh = run("total_serial", "total_shared", "total")  # a later process, the serial ones first
    assert fresh["total_serial"] == (1, 0, 0)  # from the cache, single-threaded: no threads started
    assert fresh["total_shared"] == (1, 1, 1)  # the old way runs the threaded code
    assert fresh["total"] == (1, 1, 1)


def test_cached_kernels_have_distinct_cache_files():
    """No two cached dispatchers of freetoken's Numba modules share an index file, and each serial copy has its
    kernel's options but ``parallel``."""
    import importlib

    from freetoken.cpu_kernels.serial_copy import SUFFIX

    seen: dict[str, str] = {}
    serial = 0
    for label in numba_cache.kernel_sources():
        if not label.startswith("freetoken.") or label.endswith(".__init__"):
            continue
        mod = importlib.import_module(label)
        for attr, obj in vars(mod).items():
            cache_file = getattr(getattr(obj, "_cache", None), "_cache_file", None)
            if cache_file is None or getattr(obj, "__module__", None) != mod.__name__:
                continue
            where = f"{label}.{attr}"
            other = seen.setdefault(cache_file._index_path, where)
            assert other == where, f"{where} and {other} share the cache index {cache_file._index_path}"
            name = obj.py_func.__name__
            if name.endswith(SUFFIX):
                kernel = getattr(mod, name[:-len(SUFFIX)])
                assert kernel.targetoptions.get("parallel") and not obj.targetoptions.get("parallel"), where
                assert obj.targetoptions == {k: v for k, v in kernel.targetoptions.items() if k != "parallel"}
                serial += 1
    assert serial >= 5
