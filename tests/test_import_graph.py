"""Package layout. The engine's subpackages and top-level modules import one another without a
cycle, counting every import (function-local and TYPE_CHECKING ones too): each layer only looks
down. The server's modules import one another without a cycle too, and its rooms (fronts/grpc,
fronts/openai, text, ops, the core at server/'s top, cluster) import only what their rules allow
(docs/architecture.md, "The server's rooms"). The SDK stands alone."""
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


SERVER = Path(__file__).resolve().parents[1] / "server"
SERVER_PREFIX = "specserve.server"


def _server_module(module: str) -> str:
    """specserve.server.text.validation -> "text.validation"; specserve.server -> "__init__"."""
    return "__init__" if module == SERVER_PREFIX else module[len(SERVER_PREFIX) + 1:]


def _is_server_module(dotted: str) -> bool:
    path = SERVER.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or path.is_dir()


def server_import_graph() -> dict[str, set[str]]:
    """Module -> the server modules it imports, every import counted (function-local and
    TYPE_CHECKING ones too); `from pkg import name` counts pkg.name where that is a module."""
    graph: dict[str, set[str]] = {}
    for path in SERVER.rglob("*.py"):
        rel = path.relative_to(SERVER).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        source = ".".join(parts) or "__init__"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and (
                    node.module == SERVER_PREFIX or node.module.startswith(SERVER_PREFIX + ".")):
                base = _server_module(node.module)
                for alias in node.names:
                    sub = alias.name if base == "__init__" else f"{base}.{alias.name}"
                    targets.add(sub if _is_server_module(sub) else base)
            elif isinstance(node, ast.Import):
                targets.update(_server_module(a.name) for a in node.names
                               if a.name.startswith(SERVER_PREFIX + "."))
        # A package re-exporting its own parts (cluster/__init__.py) is no edge back to it.
        graph.setdefault(source, set()).update(t for t in targets if t != source)
    return graph


def server_room(module: str) -> str:
    """The room a server module lives in: "fronts.grpc", "fronts.openai", "text", "ops",
    "cluster", or (the core at server/'s top) the module itself: "generation", "config", ..."""
    parts = module.split(".")
    if parts[0] == "fronts" and len(parts) > 1:
        return "fronts." + parts[1]
    return parts[0]


CORE = {"app", "config", "engine_client", "errors", "generation", "output_router", "preflight",
        "request_record"}
# What a front (or a core module other than the base ones) may import: all but the fronts and app.
BELOW_FRONTS = (CORE - {"app"}) | {"cluster", "ops", "text", "workers"}
# Room -> the rooms it may import (besides itself). The text pipeline and ops sit below the core
# and never see a front; config.py asks text/ whether a parser name exists (in __post_init__), and
# text/validation.py reads config's DEFAULT_MAX_NEW_TOKENS, so config is the one core module both
# ways (module by module there is no cycle). Nothing imports app.py, the wiring.
SERVER_ROOM_RULES: dict[str, set[str]] = {
    "text": {"config", "errors"},
    # The text worker processes (detokenizer, tokenizer pool): the text pipeline run elsewhere;
    # the core starts them and routes their results, so they never import the core.
    "workers": {"config", "errors", "text"},
    "ops": {"config", "errors", "request_record"},
    "config": {"text"},
    "errors": set(),
    "request_record": set(),
    "preflight": {"config"},
    "output_router": BELOW_FRONTS,
    "engine_client": BELOW_FRONTS,
    "generation": BELOW_FRONTS,
    "cluster": BELOW_FRONTS,
    "fronts.grpc": BELOW_FRONTS,
    "fronts.openai": BELOW_FRONTS,
    "app": BELOW_FRONTS | {"fronts.grpc", "fronts.openai"},
    "__init__": set(),
    "fronts": set(),  # fronts/__init__.py
}


def test_server_modules_form_no_cycle():
    graph = server_import_graph()
    assert {"text.validation", "text.chat_template", "errors", "fronts.grpc.servicer",
            "fronts.openai.routes", "ops.metrics", "generation", "app"} <= set(graph)
    cycle = find_cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_server_rooms_import_only_what_their_rules_allow():
    graph = server_import_graph()
    broken = []
    for source, targets in sorted(graph.items()):
        room = server_room(source)
        assert room in SERVER_ROOM_RULES, f"server/{source}: in no room of SERVER_ROOM_RULES"
        for target in sorted(targets):
            target_room = server_room(target)
            if target_room != room and target_room not in SERVER_ROOM_RULES[room]:
                broken.append(f"{source} ({room}) imports {target} ({target_room})")
    assert not broken, "\n".join(broken)


def test_the_room_rules_keep_fronts_on_top():
    """What the rules table promises, whatever it grows into: no room but app imports a front
    (text/ and ops/ in particular), so the fronts do not import each other; nothing imports app."""
    for room, allowed in SERVER_ROOM_RULES.items():
        fronts = {r for r in allowed if r.startswith("fronts.")}
        assert not fronts or room == "app", (room, fronts)
        assert "app" not in allowed, room
    assert set(SERVER_ROOM_RULES) >= CORE | {"text", "ops", "cluster", "fronts.grpc",
                                             "fronts.openai"}


def test_the_engine_imports_no_server_module():
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith(SERVER_PREFIX) for n in names), path


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
