"""The package's import structure: no import from a lower layer to a higher one, and no import cycle.

Every module of ``src/partialvfl`` is read with :mod:`ast` (not imported), and every import statement counts, at
module level or inside a function (a lazy import is still a dependency), as does ``importlib.import_module`` with a
literal name.  An import names its target module: ``from a.b import c`` is ``a.b.c`` when that is a module, else
``a.b``; relative imports are resolved.  Importing ``a.b.c`` also runs ``a/__init__.py`` and ``a/b/__init__.py``,
but those implicit edges are not counted (a package's ``__init__`` re-exporting its submodules would otherwise be a
cycle with each of them).

Layers, low to high (docs/architecture.md's Layout table; :func:`test_the_architecture_table_lists_these_layers` keeps
it in step with :data:`LAYERS`): ``utils`` < ``data``, ``nn`` < ``federation`` < ``methods`` < ``orchestration``,
``privacy`` < ``bench``, ``serving`` < ``cli`` (``privacy``: the attacks that measure what crosses a party
boundary; bench and tests reuse them; ``serving``: the prediction service).
``data`` and ``nn`` are on the same level and import neither each other (they do not today: the data model is numpy,
the network blocks are torch).  The package face ``partialvfl/__init__.py`` sits just above ``data`` (it re-exports
the data model); ``partialvfl/__main__.py`` (``python -m partialvfl``) belongs to ``cli``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "partialvfl"

# rank of each layer; same rank = may not import each other
# ``serving`` (the prediction service) sits beside ``bench``: both use the library below, neither the other
LAYERS = {"utils": 0, "data": 1, "nn": 1, "": 2, "federation": 3, "methods": 4, "orchestration": 5, "privacy": 5,
          "bench": 6, "serving": 6, "cli": 7}
# ``federation``'s sub-packages by job, low to high (docs/architecture.md's second table): the wire core imports no
# privacy, trust or deployment code; the gRPC deployment sits on everything else
FEDERATION_LAYERS = {"wire": 0, "dp": 1, "trust": 2, "runtime": 3, "grpc": 4}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    file: Path
    line: int

    def where(self) -> str:
        return f"{self.file.relative_to(SRC.parent)}:{self.line}"


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(module: str, path: Path, level: int, name: str | None) -> str:
    """The absolute module name of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its longest prefix that is a module of the package (``None`` outside the package)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    edges = []

    def add(name: str, line: int) -> None:
        target = _target(name, modules)
        if target is not None and target != module:
            edges.append(Edge(module, target, path, line))

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path, node.level, node.module)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in modules else base, node.lineno)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname == "import_module" and isinstance(node.args[0].value, str):
                add(node.args[0].value, node.lineno)
    return edges


def all_edges() -> list[Edge]:
    modules = module_files()
    return [e for m, p in modules.items() for e in imports_of(m, p, modules)]


def layer_of(module: str) -> str:
    """The layer's name (``""``: the package face); ``python -m partialvfl`` is the command line."""
    parts = module.split(".")
    layer = parts[1] if len(parts) > 1 else ""
    return "cli" if layer == "__main__" else layer


def upward_imports(edges: list[Edge]) -> list[str]:
    bad = []
    for e in edges:
        src, dst = layer_of(e.source), layer_of(e.target)
        if src not in LAYERS or dst not in LAYERS:
            bad.append(f"{e.where()}: {e.source} -> {e.target}: module outside the known layers {sorted(LAYERS)}")
        elif src != dst and LAYERS[dst] >= LAYERS[src]:
            how = "a higher" if LAYERS[dst] > LAYERS[src] else "a same-level"
            bad.append(f"{e.where()}: {e.source} ({src or 'package face'}) imports {e.target}, {how} layer "
                       f"({dst or 'package face'})")
    return bad


def import_cycles(edges: list[Edge]) -> list[list[str]]:
    """One cycle (a list of modules, first == last) per strongly connected component with more than one module."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm (the graph is small: recursion is fine)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(comp, graph) for comp in components]


def _cycle_in(comp: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected component (breadth-first search)."""
    start = min(comp)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in {comp}")


def _describe_cycle(cycle: list[str], edges: list[Edge]) -> str:
    hops = []
    for a, b in zip(cycle, cycle[1:]):
        e = next(e for e in edges if e.source == a and e.target == b)
        hops.append(f"{a} -> {b} ({e.where()})")
    return "import cycle: " + "; ".join(hops)


# ---------------------------------------------------------------------- the checks
def test_the_walker_sees_the_package() -> None:
    modules = module_files()
    assert {"partialvfl", "partialvfl.cli", "partialvfl.methods.base", "partialvfl.bench.runner"} <= set(modules)
    edges = all_edges()
    assert any(e.source == "partialvfl.methods.base" and e.target == "partialvfl.federation.runtime.coordinator"
               for e in edges)


def test_the_walker_resolves_relative_lazy_and_dynamic_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "partialvfl"
    (pkg / "bench").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "bench" / "__init__.py").write_text("from . import a\n")
    (pkg / "bench" / "a.py").write_text("def f():\n    from .b import g\n    from ..bench import b\n")
    (pkg / "bench" / "b.py").write_text("import importlib\nimportlib.import_module('partialvfl.bench.a')\n")
    modules = {"partialvfl": pkg / "__init__.py", "partialvfl.bench": pkg / "bench" / "__init__.py",
               "partialvfl.bench.a": pkg / "bench" / "a.py", "partialvfl.bench.b": pkg / "bench" / "b.py"}
    got = {(e.source, e.target, e.line) for m, p in modules.items() for e in imports_of(m, p, modules)}
    assert got == {("partialvfl.bench", "partialvfl.bench.a", 1), ("partialvfl.bench.a", "partialvfl.bench.b", 2),
                   ("partialvfl.bench.a", "partialvfl.bench.b", 3), ("partialvfl.bench.b", "partialvfl.bench.a", 2)}
    edges = [e for m, p in modules.items() for e in imports_of(m, p, modules)]
    assert import_cycles(edges) == [["partialvfl.bench.a", "partialvfl.bench.b", "partialvfl.bench.a"]]


def test_the_checks_name_an_upward_import() -> None:
    e = Edge("partialvfl.federation.x", "partialvfl.methods.base", SRC / "partialvfl" / "federation" / "x.py", 7)
    (msg,) = upward_imports([e])
    assert "src/partialvfl/federation/x.py:7" in msg and "partialvfl.methods.base" in msg
    same = Edge("partialvfl.data.x", "partialvfl.nn.blocks", SRC / "partialvfl" / "data" / "x.py", 3)
    assert "same-level" in upward_imports([same])[0]


def test_no_import_from_a_lower_layer_to_a_higher_one() -> None:
    bad = upward_imports(all_edges())
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_import_cycle() -> None:
    edges = all_edges()
    cycles = import_cycles(edges)
    assert not cycles, "\n".join(_describe_cycle(c, edges) for c in cycles)


@pytest.mark.parametrize("layer", sorted(k for k in LAYERS if k))
def test_every_layer_exists(layer: str) -> None:
    assert (SRC / PACKAGE / layer).is_dir(), f"layer {layer!r} has no package"


def federation_layer_of(module: str) -> str | None:
    """The sub-package of a module under ``partialvfl.federation`` (``None``: not under federation, or its face)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "federation" else None


def federation_upward_imports(edges: list[Edge]) -> list[str]:
    bad = []
    for e in edges:
        src, dst = federation_layer_of(e.source), federation_layer_of(e.target)
        if src is None or dst is None:
            continue
        if src not in FEDERATION_LAYERS or dst not in FEDERATION_LAYERS:
            bad.append(f"{e.where()}: {e.source} -> {e.target}: module outside federation's sub-packages "
                       f"{sorted(FEDERATION_LAYERS)}")
        elif src != dst and FEDERATION_LAYERS[dst] > FEDERATION_LAYERS[src]:
            bad.append(f"{e.where()}: {e.source} (federation.{src}) imports {e.target}, a higher sub-package "
                       f"(federation.{dst})")
    return bad


def test_federation_sub_packages_import_only_lower_ones() -> None:
    modules = module_files()
    loose = sorted(m for m, path in modules.items() if path.parent.name == "federation" and path.name != "__init__.py")
    assert not loose, f"modules of federation outside its sub-packages {sorted(FEDERATION_LAYERS)}: {loose}"
    assert {m.split(".")[2] for m in modules if federation_layer_of(m)} == set(FEDERATION_LAYERS)
    bad = federation_upward_imports(all_edges())
    assert not bad, "imports against federation's sub-package order:\n" + "\n".join(bad)


def test_the_federation_check_names_an_upward_import() -> None:
    e = Edge("partialvfl.federation.wire.x", "partialvfl.federation.trust.policy",
             SRC / "partialvfl" / "federation" / "wire" / "x.py", 4)
    (msg,) = federation_upward_imports([e])
    assert "federation/wire/x.py:4" in msg and "higher sub-package (federation.trust)" in msg
    assert not federation_upward_imports([Edge(e.target, e.source, e.file, 4)])


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def architecture_layers() -> dict[str, int]:
    """docs/architecture.md's Layout table as ``{layer: level}`` (the package face as ``""``), read from its level and
    package columns."""
    text = ARCHITECTURE.read_text()
    table = text[text.index("## Layout"):].split("\n\n")[1]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    out = {}
    for level, _name, package, *_ in rows:
        module = package.strip("`")
        layer = module.removeprefix(PACKAGE).removeprefix(".")
        assert layer not in out, f"the layer table lists {module} twice"
        out[layer] = int(level)
    return out


def test_the_architecture_table_lists_these_layers() -> None:
    assert architecture_layers() == LAYERS, ("docs/architecture.md's Layout table and LAYERS above disagree: update "
                                             "one to the other")


def test_the_architecture_page_lists_federations_sub_packages() -> None:
    text = ARCHITECTURE.read_text()
    table = text[text.index("### federation's sub-packages"):].split("\n\n")[1]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    listed = {package.strip("`").removeprefix(f"{PACKAGE}.federation."): int(level) for level, package, *_ in rows}
    assert listed == FEDERATION_LAYERS, "docs/architecture.md's federation table and FEDERATION_LAYERS disagree"
