"""The import graph of ``jddp/``: no cycle, counting the imports made inside functions."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "jddp"


def module_names() -> dict[str, Path]:
    """``{"jddp.config": path, ...}`` for every module of the package (a package is its
    ``__init__.py``)."""
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The jddp modules that ``name`` imports anywhere in its file (top level, inside functions
    or classes): ``from a.b import c`` counts as ``a.b.c`` where that is a module, else ``a.b``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # an attribute of a module: the module
                target = target.rpartition(".")[0]
            if target:
                found.add(target)
                break
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    """``{module: modules it imports}`` over ``jddp``."""
    names = module_names()
    return {name: imported_modules(name, path, set(names)) for name, path in names.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_import_graph_is_read():
    """The parser sees top-level, function-level and ``from pkg import module`` imports."""
    graph = import_graph()
    assert "jddp.config" in graph["jddp.train"]  # from jddp import config as config_lib
    assert "jddp.comm" in graph["jddp.step"]
    assert "jddp.data.loader" in graph["jddp.run.loop"]


def test_no_import_cycle():
    """No module of jddp reaches itself through imports, lazy ones included: the package can be
    read bottom-up, and a lazy import never hides a loop."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` with each module collapsed to its top-level unit of jddp (``jddp.run.hooks`` is
    ``jddp.run``, ``jddp.step`` stays), imports within a unit dropped; the ``jddp`` facade (its
    lazy exports name everything) left out."""

    def unit(name: str) -> str:
        return ".".join(name.split(".")[:2])

    out: dict[str, set[str]] = {}
    for name, deps in graph.items():
        if name == "jddp":
            continue
        out.setdefault(unit(name), set()).update(
            unit(d) for d in deps if unit(d) != unit(name) and d != "jddp"
        )
    for deps in list(out.values()):
        for d in deps:
            out.setdefault(d, set())
    return out


def test_no_import_climbs_between_packages():
    """Packages and top-level modules form a layered graph too: no package imports one that
    imports it back (``jddp.step -> jddp.run -> jddp.step`` was one), so the folder listing reads
    bottom-up as the data flow."""
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, "packages import each other: " + " -> ".join(cycle)


def test_package_graph_collapses_modules():
    graph = {"jddp.step": {"jddp.run.stop"}, "jddp.run.loop": {"jddp.step"}, "jddp.run.stop": set()}
    assert find_cycle(package_graph(graph)) == ["jddp.run", "jddp.step", "jddp.run"]


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
