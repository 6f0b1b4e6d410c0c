"""The package tree follows the processes: every import points down the layers, and no module imports itself back.

Layers, lowest first (a module may import its own package and any lower layer, never a higher one):
    leaves    files, signals, allocator, child,     plain helpers, no a3po imports
              startup, machine, intervals, episode_end
    algo      the algorithm as pure functions, and every variant's name; metrics, every key it and the
              rest of a run log (below config, whose docs.py renders them)
    config    the schema, its loader and generated docs; devices resolves its choices to torch objects
    records   data, models, trajectories            what flows between processes
    envs      environments, agents, reward services, the chat protocol: beside the rollout workers
    process   rollout, sync, trainer                one process kind each (sync: between them)
    launch    starting those processes, locally or on Ray
    pipeline  the run: admission, the worker pool, the loop, evaluation, logs
    entry     bench, cli, heldout (`a3po eval`), export (`a3po export`), serve (`a3po serve`)
"""

from __future__ import annotations

import ast
from pathlib import Path

import a3po

ROOT = Path(a3po.__file__).parent
LAYERS = [
    {"files", "signals", "allocator", "child", "startup", "machine", "intervals", "episode_end", "__init__"},
    {"algo", "metrics"},
    {"config", "devices"},
    {"data", "models", "trajectories"},
    {"envs", "agents", "services", "serving"},
    {"rollout", "sync", "trainer"},
    {"launch"},
    {"pipeline"},
    {"bench", "cli", "export", "heldout", "serve"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every a3po module `path` imports, at the top or inside a function (both run in some process)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("a3po"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("a3po"))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_has_a_layer():
    assert {_top(m) for m in _graph()} <= set(RANK), "a new package or top-level module needs a layer in LAYERS"


def test_imports_never_run_up_the_layers():
    upward = sorted(f"{m} -> {i}" for m, deps in _graph().items() for i in deps
                    if RANK[_top(i)] > RANK[_top(m)])
    assert upward == []


def test_no_import_cycle_between_modules():
    graph = _graph()
    done, on_path, cycles = set(), [], []

    def visit(m: str) -> None:
        if m in on_path:
            cycles.append(" -> ".join(on_path[on_path.index(m):] + [m]))
            return
        if m in done:
            return
        on_path.append(m)
        for dep in sorted(graph[m]):
            # a package's __init__ re-exporting its own modules is not a cycle a reader has to follow
            if not (dep.startswith(m + ".") and (ROOT.parent / m.replace(".", "/") / "__init__.py").exists()):
                visit(dep)
        on_path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
    assert cycles == []
