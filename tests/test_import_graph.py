"""Package layout. The engine's subpackages and top-level modules import one another without a
cycle, counting every import (function-local and TYPE_CHECKING ones too): each layer only looks
down. The SDK stands alone."""
from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "engine"
PREFIX = "specserve.engine"


def _node(module: str) -> str:
    """specserve.engine.scheduler.policy -> "scheduler"; specserve.engine.api -> "api"."""
    parts = module.split(".")[2:]
    return parts[0] if parts else "__init__"


def _is_module(name: str) -> bool:
    return (ENGINE / f"{name}.py").exists() or (ENGINE / name).is_dir()


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PREFIX):
            if node.module == PREFIX:  # from specserve.engine import x: a module, or a name
                found.update(f"{PREFIX}.{a.name}" if _is_module(a.name) else PREFIX for a in node.names)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(PREFIX))
    return found


def engine_import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ENGINE.rglob("*.py"):
        rel = path.relative_to(ENGINE).with_suffix("")
        source = _node(".".join((PREFIX, *rel.parts)))
        targets = {_node(m) for m in _imports(path)}
        if source == "__init__" or rel.name == "__init__":
            targets = {t for t in targets if t != source}  # a package re-exporting its own parts
        graph.setdefault(source, set()).update(t for t in targets if t != source)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_engine_packages_form_no_cycle():
    graph = engine_import_graph()
    assert {"scheduler", "runtime", "spec", "attention", "api"} <= set(graph)
    cycle = find_cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_the_sdk_imports_neither_server_nor_engine():
    """`import specserve.clients` is all a client machine needs: no server, engine or torch."""
    import subprocess
    import sys

    code = ("import sys, specserve.clients, specserve.clients.demo, specserve.clients.healthcheck; "
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in "
            "(['specserve', 'server'], ['specserve', 'engine']) or m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_ray_stays_outside_the_engine_and_the_single_engine_server():
    """Ray is the optional `ray` extra: the engine never imports it, and neither does the server
    until --data-parallel (server/cluster/ray_replicas.py is the one module that does)."""
    import subprocess
    import sys

    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "ray" for n in names), path
    code = "import sys, specserve.cli, specserve.server.app; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
