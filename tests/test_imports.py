"""No import circle in the package or the benchmarks: a module's imports (at the top or inside a function) never
lead back to it. The graph is read from the source (ast), so a lazy import that hides a circle counts too."""

import ast
from pathlib import Path

from conftest import REPO


def import_graph(package: str) -> dict[str, set[str]]:
    modules = {".".join(p.relative_to(REPO).with_suffix("").parts): p for p in (REPO / package).rglob("*.py")}
    modules = {m.removesuffix(".__init__"): p for m, p in modules.items()}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
                targets.update(n for n in names if n in modules)  # `from pkg import module`
                targets.add(node.module)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, done = [], set()

    def visit(node, path):
        for nxt in sorted(graph[node]):
            if nxt in path:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(node)

    for node in sorted(graph):
        if node not in done:
            visit(node, [node])
    return found


def test_the_checker_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    for package in ("ffcv_ddpm", "benchmarks", "tools"):
        graph = import_graph(package)
        assert len(graph) > 3, package
        assert cycles(graph) == [], f"import circle in {package}"
