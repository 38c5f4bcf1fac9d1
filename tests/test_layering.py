"""The package's import graph: no cycles between its packages, every import points down the layering of
docs/design.md, the model holds math only (it never reaches policy, the cache or the engine), and no module imports
another package's private (underscore) names. Every ``import`` counts, the lazy ones inside functions too."""

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Bottom to top: a package may import only packages listed before it.
LAYERS = ["version", "paths", "default_model", "device", "info", "formats", "cpu_kernels", "ops", "cache", "loaders",
          "trace", "policy", "sim", "models", "convert", "engine", "testing", "serve", "cli", "__main__"]
#: The engine's rooms, bottom to top (a room may import only those before it): what a load is told, the expert
#: runners, KV reuse (prefix cache, anchors, state snapshots), one sequence's decoding (sampling, grammars, the text
#: of a token stream, what a generation returns), the batching step loop (scheduler and sequences), the generation
#: front (the loaded Model, a client of the step loop; chat templates), loading (files -> decoder + runner -> Model).
ENGINE_ROOMS = ["options", "experts", "reuse", "decoding", "batching", "generation", "loading"]
#: The model's blocks compute with ops on a device; which experts are resident, how misses are served and what a
#: run reports belong to the engine's expert runner.
MODELS_MAY_IMPORT = {"paths", "device", "formats", "ops", "loaders", "models"}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted((ROOT / "freetoken").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted((ROOT / "cpu_kernels").glob("*.py")):  # installed as freetoken.cpu_kernels
        mods["freetoken.cpu_kernels" + ("" if path.stem == "__init__" else "." + path.stem)] = path
    return mods


MODULES = _modules()


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(root)"


def _imports(module: str, path: Path):
    """(target module, imported name or None, line) of every freetoken import in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("freetoken"):
                    yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                node.module.startswith("freetoken"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in MODULES:  # `from freetoken import ops`: the subpackage itself
                    yield sub, None, node.lineno
                else:
                    yield node.module, a.name, node.lineno


def _edges():
    edges = defaultdict(list)  # (from package, to package) -> [where]
    for module, path in MODULES.items():
        src = _package(module)
        for target, _, line in _imports(module, path):
            dst = _package(target)
            if dst != src:
                edges[(src, dst)].append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return edges


EDGES = _edges()


def test_every_package_is_placed():
    packages = {_package(m) for m in MODULES} - {"(root)"}
    assert packages <= set(LAYERS), f"place these packages in LAYERS: {sorted(packages - set(LAYERS))}"


def test_no_package_cycles():
    graph = defaultdict(set)
    for src, dst in EDGES:
        graph[src].add(dst)
    # Tarjan's strongly connected components: a component of more than one package is a cycle
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"package cycles: {cycles}"


@pytest.mark.parametrize("edge", sorted(EDGES), ids=lambda e: f"{e[0]}->{e[1]}")
def test_imports_point_down(edge):
    src, dst = edge
    if "(root)" in edge:
        # the facade (freetoken.load, get_device, __version__) imports lazily downward; only the top may use it
        assert src != "(root)" or dst in ("device", "engine", "version"), EDGES[edge]
        assert dst != "(root)" or src in ("cli", "testing"), EDGES[edge]
        return
    assert LAYERS.index(dst) < LAYERS.index(src), f"{src} is below {dst}: {EDGES[edge][:3]}"
    if src == "models":
        assert dst in MODELS_MAY_IMPORT, f"the model holds math only, yet: {EDGES[edge][:3]}"


def _room(module: str) -> str | None:
    """The engine room of ``module`` (None: outside the engine, or the engine package itself)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "engine" else None


def _engine_edges():
    edges = defaultdict(list)
    for module, path in MODULES.items():
        src = _room(module)
        for target, _, line in _imports(module, path):
            dst = _room(target)
            if src is not None and dst is not None and dst != src:
                edges[(src, dst)].append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return edges


ENGINE_EDGES = _engine_edges()


def test_every_engine_module_is_in_a_room():
    rooms = {_room(m) for m in MODULES} - {None}
    assert rooms == set(ENGINE_ROOMS), f"place these in ENGINE_ROOMS: {sorted(rooms - set(ENGINE_ROOMS))}"
    loose = [m for m in MODULES if m.startswith("freetoken.engine.") and m.count(".") == 2
             and _room(m) not in ENGINE_ROOMS]
    assert not loose, loose


@pytest.mark.parametrize("edge", sorted(ENGINE_EDGES), ids=lambda e: f"{e[0]}->{e[1]}")
def test_engine_rooms_import_down(edge):
    src, dst = edge
    assert ENGINE_ROOMS.index(dst) < ENGINE_ROOMS.index(src), f"{src} is below {dst}: {ENGINE_EDGES[edge][:3]}"


def test_no_private_names_across_packages():
    bad = []
    for module, path in MODULES.items():
        for target, name, line in _imports(module, path):
            parts = [name or ""] + target.split(".")[1:]
            private = any(p.startswith("_") and not p.startswith("__") for p in parts)  # dunders are public
            if private and _package(target) != _package(module):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}{'.' + name if name else ''}")
    assert not bad, bad
