"""Numba's on-disk kernel cache, in a directory keyed by every kernel source.

Numba's ``cache=True`` stamps a cached function with its own source file only. An edit to a helper imported from
another file (an ``inline="always"`` row kernel, an intrinsic, a constant frozen into the machine code) leaves the
caller's stamp unchanged, and the stale machine code keeps loading. freetoken therefore points Numba's cache at a
directory named by a hash of every source that can end up in a kernel, as the NVRTC and emu caches are keyed
(:mod:`freetoken.device.nvrtc`, :mod:`freetoken.device.emu_build`):

* every file of ``cpu_kernels/`` (``freetoken/cpu_kernels`` in a wheel, the top-level ``cpu_kernels/`` of a
  checkout: :func:`freetoken.paths.cpu_kernels_dir`);
* every freetoken module that imports numba, found by scanning the package (a new module is covered without a list
  to maintain);
* the freetoken modules those import at module level, transitively (their constants are compiled in);
* the numba and llvmlite versions (their ``_version.py``, read without importing them) and the Python version.

Any edit moves the cache to a fresh directory; old ones are pruned (the :data:`KEEP` most recently used stay, and
none used within the last :data:`MIN_AGE_S` seconds is removed, so concurrent processes of other checkouts keep
theirs). The key costs one read of ~100 small files: a few milliseconds at import.

Where: ``<freetoken cache>/numba/<key>`` (:func:`freetoken.paths.cache_dir`, ``FREETOKEN_CACHE_DIR``); when the user
set ``NUMBA_CACHE_DIR``, ``$NUMBA_CACHE_DIR/freetoken-<key>``.

When: ``freetoken/__init__.py`` calls :func:`configure` before any module defines a kernel. Numba fixes a function's
cache directory when its dispatcher enables caching (at decoration, ``numba.core.caching.CacheImpl`` asks its
locators, the first of which reads ``numba.config.CACHE_DIR``), and ``numba.config`` reads ``NUMBA_CACHE_DIR`` when
numba is first imported. :func:`configure` sets the environment variable, so ``import freetoken`` does not import
numba, and also ``numba.config.CACHE_DIR`` when numba was imported first. Child processes inherit the variable; a
freetoken child recognises its parent's setting (``FREETOKEN_NUMBA_CACHE_SET``) and keys its own.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from freetoken.paths import cache_dir, cpu_kernels_dir

#: Cache directories kept (the current one included) when stale siblings are pruned.
KEEP = 4
#: A sibling used (configured by a process) within this many seconds is never pruned.
MIN_AGE_S = 3600.0
#: Bumped when the key's recipe changes.
KEY_VERSION = "1"

_SET_VAR = "FREETOKEN_NUMBA_CACHE_SET"  # the NUMBA_CACHE_DIR freetoken set (so a child does not nest under it)
_USER_VAR = "FREETOKEN_NUMBA_CACHE_USER"  # the user's own NUMBA_CACHE_DIR that directory is nested under
_KEY_NAME = re.compile(r"[0-9a-f]{16}")
_USER_NAME = re.compile(r"freetoken-[0-9a-f]{16}")

_IMPORTS_NUMBA = re.compile(rb"^[ \t]*(?:import|from)[ \t]+(?:numba|llvmlite)\b", re.M)
# module-level imports only (column 0): what a kernel can see as a global
_TOP_IMPORT = re.compile(rb"^(?:from[ \t]+([\w.]+)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)|import[ \t]+([^\n]+))", re.M)
_COMMENT = re.compile(rb"#[^\n]*")

_configured: Path | None = None


def _walk(root: str, prefix: str, modules: dict[str, str], files: list[str] | None, skip: str) -> None:
    """Map the ``.py`` files under ``root`` to their dotted module names (``prefix`` for ``root`` itself);
    ``files`` collects every file (all but bytecode). ``skip``: a directory not to enter."""
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x != "__pycache__" and os.path.join(d, x) != skip]
        rel = os.path.relpath(d, root)
        pkg = prefix if rel == "." else prefix + "." + rel.replace(os.sep, ".")
        for n in names:
            path = os.path.join(d, n)
            if files is not None and not n.endswith((".pyc", ".pyo")):
                files.append(path)
            if n.endswith(".py"):
                modules[pkg if n == "__init__.py" else pkg + "." + n[:-3]] = path


def _imported_modules(name: str, is_pkg: bool, text: bytes) -> list[str]:
    """Dotted names a module imports at module level (``from a.b import c`` names ``a.b`` and ``a.b.c``)."""
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    out = []
    for m in _TOP_IMPORT.finditer(text):
        if m.group(3) is not None:  # import a.b[ as c], d
            out += [n.split()[0] for n in _COMMENT.sub(b"", m.group(3)).decode().split(",") if n.strip()]
            continue
        mod = m.group(1).decode()
        level = len(mod) - len(mod.lstrip("."))
        if level:
            base = here[:len(here) - (level - 1)]
            mod = ".".join(base + [p for p in mod[level:].split(".") if p])
        out.append(mod)
        names = _COMMENT.sub(b"", m.group(2)).decode().strip("() \t\n").replace("\n", " ").split(",")
        out += [mod + "." + n.split()[0] for n in names if n.strip() and n.strip() != "*"]
    return out


def kernel_sources() -> dict[str, Path]:
    """Every source the Numba kernels are keyed by, as ``{label: path}``. Labels are the module names, the same in a
    wheel and in a checkout (``freetoken.cpu_kernels.gemv``, ``freetoken.trace.policies``, ``freetoken.ops.__init__``
    for a package), or ``freetoken/cpu_kernels/<name>`` for a file of ``cpu_kernels/`` that is not a module."""
    pkg = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    kernels = str(cpu_kernels_dir())
    modules: dict[str, str] = {}
    kernel_files: list[str] = []
    _walk(pkg, "freetoken", modules, None, kernels)
    _walk(kernels, "freetoken.cpu_kernels", modules, kernel_files, "")
    by_path = {p: m for m, p in modules.items()}
    texts: dict[str, bytes] = {}

    def read(p: str) -> bytes:
        if p not in texts:
            with open(p, "rb") as f:
                texts[p] = f.read()
        return texts[p]

    chosen = set(kernel_files)
    for p in modules.values():
        text = read(p)
        if (b"numba" in text or b"llvmlite" in text) and _IMPORTS_NUMBA.search(text):
            chosen.add(p)
    todo = [p for p in chosen if p in by_path]
    while todo:  # the freetoken modules they import, transitively
        p = todo.pop()
        for mod in _imported_modules(by_path[p], p.endswith("__init__.py"), read(p)):
            q = modules.get(mod)
            if q is not None and q not in chosen:
                chosen.add(q)
                todo.append(q)
    out = {}
    for p in chosen:
        if p in by_path:
            label = by_path[p] + (".__init__" if p.endswith("__init__.py") else "")
        else:
            label = "freetoken/cpu_kernels/" + Path(os.path.relpath(p, kernels)).as_posix()
        out[label] = Path(p)
    return dict(sorted(out.items()))


def _version_file(package: str) -> bytes:
    """The ``_version.py`` of ``package`` (numba, llvmlite), found without importing it; empty if absent."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return b""
    for loc in spec.submodule_search_locations:
        f = Path(loc) / "_version.py"
        if f.is_file():
            return f.read_bytes()
    return b""


def source_key(sources: Mapping[str, Path]) -> str:
    """16 hex digits of SHA-256 over the sources (labels and contents), numba's and llvmlite's versions and the
    Python version."""
    h = hashlib.sha256()
    for part in (b"freetoken-numba-cache", KEY_VERSION.encode(), sys.implementation.cache_tag.encode(),
                 _version_file("numba"), _version_file("llvmlite")):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    for label, path in sorted(sources.items()):
        data = Path(path).read_bytes()
        h.update(label.encode() + b"\0" + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def prune(base: Path, pattern: re.Pattern, current: Path, keep: int = KEEP, min_age_s: float = MIN_AGE_S) -> list[Path]:
    """Remove the sibling cache directories of ``current`` in ``base`` (names matching ``pattern``) beyond the
    ``keep`` most recently used, those not used for ``min_age_s`` seconds; returns the removed ones."""
    now = time.time()
    others = []
    with os.scandir(base) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False) and pattern.fullmatch(entry.name) and entry.name != current.name:
                try:
                    others.append((entry.stat(follow_symlinks=False).st_mtime, Path(entry.path)))
                except OSError:
                    pass
    others.sort(reverse=True)
    removed = []
    for mtime, path in others[max(keep - 1, 0):]:
        if now - mtime > min_age_s:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def configure(sources: Mapping[str, Path] | Iterable[Path] | None = None, keep: int = KEEP) -> Path | None:
    """Point Numba's cache at the directory keyed by ``sources`` (default :func:`kernel_sources`): set
    ``NUMBA_CACHE_DIR``, and ``numba.config.CACHE_DIR`` when numba is already imported; prune stale siblings.

    Only functions decorated afterwards use it. Returns the directory, or None when the sources cannot be read or the
    directory cannot be created (then Numba's own default applies)."""
    global _configured
    try:
        if sources is None:
            sources = kernel_sources()
        elif not isinstance(sources, Mapping):
            sources = {str(Path(p).resolve()): Path(p) for p in sources}
        key = source_key(sources)
        env = os.environ.get("NUMBA_CACHE_DIR", "")
        user = os.environ.get(_USER_VAR, "") if env and env == os.environ.get(_SET_VAR) else env
        if user:
            base, path, pattern = Path(user), Path(user) / f"freetoken-{key}", _USER_NAME
        else:
            base = cache_dir() / "numba"
            path, pattern = base / key, _KEY_NAME
        path.mkdir(parents=True, exist_ok=True)
        os.utime(path)  # last use, for pruning
        prune(base, pattern, path, keep=keep)
    except (OSError, RuntimeError, ValueError):  # RuntimeError: Path.home() without a home directory
        return None
    os.environ["NUMBA_CACHE_DIR"] = str(path)
    os.environ[_SET_VAR] = str(path)
    if user:
        os.environ[_USER_VAR] = user
    else:
        os.environ.pop(_USER_VAR, None)
    config = sys.modules.get("numba.core.config")
    if config is not None:  # numba was imported first: it has read the environment already
        config.CACHE_DIR = str(path)
    _configured = path
    return path


def configured_dir() -> Path | None:
    """The directory the last :func:`configure` chose (None before, or when it failed)."""
    return _configured
