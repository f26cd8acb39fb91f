"""No import cycle in specforest: every module's imports, at module level and inside functions, form a DAG.

An import under ``if TYPE_CHECKING:`` is not an import at run time and does not count. The
checker is tested on small made-up packages, with a cycle and without, so that a checker that
finds nothing cannot pass for a package that has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import specforest

ROOT = Path(specforest.__file__).parent


def _modules(root: Path) -> dict:
    """``{dotted name: (path, is package)}`` of every module under the package directory ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        if package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, package)
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every ``import``/``from`` statement of ``tree`` at any depth (functions, classes, branches),
    but those only under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            for other in node.orelse:
                yield from _imports(ast.Module(body=[other], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def import_graph(root: Path) -> dict:
    """``{module: {imported module: line}}`` for the modules of the package directory ``root``.

    ``from P import N`` depends on the module ``P.N`` where that is a module, else on ``P``
    (a package's ``__init__`` for a name it defines or re-exports); ``import P.N`` on ``P.N``.
    """
    modules = _modules(root)
    graph: dict = {}
    for name, (path, package) in modules.items():
        here = name if package else name.rpartition(".")[0]
        edges: dict = {}
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def find_cycles(graph: dict) -> list:
    """The strongly connected components of ``graph`` with more than one module (or a module that
    imports itself), each as a cycle ``[a, b, ..., a]`` through it; empty for a DAG."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    on_stack: set = set()
    components: list = []

    def visit(v) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
            if len(comp) > 1 or v in graph.get(v, ()):
                components.append(set(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(graph, comp) for comp in components]


def _cycle_through(graph: dict, comp: set) -> list:
    """A shortest cycle inside the strongly connected ``comp``, from its first module back to it."""
    start = min(comp)
    parent: dict = {}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph.get(v, ())):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if w in comp and w not in parent and w != start:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"{comp} is not strongly connected")


def _described(graph: dict, cycle: list) -> str:
    steps = zip(cycle[:-1], cycle[1:], strict=True)
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in steps) + f" -> {cycle[-1]}"


def test_specforest_has_no_import_cycle():
    graph = import_graph(ROOT)
    assert len(graph) > 50 and "specforest.latency.tuner" in graph  # every module read, the package's too
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(_described(graph, c) for c in cycles)


def test_planning_uses_the_tuner_and_the_tuner_reads_acceptance_on_its_own():
    graph = import_graph(ROOT)
    assert "specforest.latency" in graph["specforest.planning"]
    latency = [m for m in graph if m == "specforest.latency" or m.startswith("specforest.latency.")]
    assert all("specforest.planning" not in graph[m] for m in latency)
    assert "specforest.acceptance" in graph["specforest.planning"]
    assert "specforest.acceptance" in graph["specforest.latency.calibration"]


def test_the_checker_finds_cycles_through_any_number_of_modules():
    assert find_cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) == []
    assert find_cycles({"a": {"b": 1}, "b": {"a": 1}}) == [["a", "b", "a"]]
    cycle = find_cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}})
    assert cycle == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"a": 1}}) == [["a", "a"]]
    two = find_cycles({"a": {"b": 1}, "b": {"a": 1}, "x": {"y": 1}, "y": {"x": 1, "a": 1}})
    assert sorted(two) == [["a", "b", "a"], ["x", "y", "x"]]


def _package(tmp_path: Path, files: dict) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def test_the_checker_counts_imports_inside_functions_and_not_under_type_checking(tmp_path):
    """A cycle closed by an import inside a function is found, in every spelling of the import;
    one closed only under ``if TYPE_CHECKING:`` is not."""
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from .b import f\n",
            "b.py": "def f():\n    from .sub.c import g\n    return g\n",
            "sub/__init__.py": "",
            "sub/c.py": "def g():\n    if True:\n        from .. import a\n",
            "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .e import E\nelse:\n    import os\n",
            "e.py": "import pkg.d\n",
            "f.py": "class F:\n    def m(self):\n        import pkg.g as g\n",
            "g.py": "from pkg.f import F\n",
        },
    )
    graph = import_graph(root)
    assert graph["pkg.sub.c"] == {"pkg.a": 3} and graph["pkg.d"] == {} and graph["pkg.e"] == {"pkg.d": 1}
    assert sorted(find_cycles(graph)) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"], ["pkg.f", "pkg.g", "pkg.f"]]
