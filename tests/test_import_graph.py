"""pdserve.engine's module-level imports form no cycle, and the layer seam points one way.

The graph is read from the source with `ast` (nothing is imported): an edge for every
module-level `import` / `from ... import` of a pdserve.engine module, to the most specific
module that exists (`from pkg import mod` names the submodule), plus the packages Python
runs on the way (importing a.b.c runs a/__init__ and a/b/__init__), except the importer's
own ancestors, which are already running (named outright, as `from a.b import X` in a.b.c,
they are edges: a package whose __init__ imports a.b.c would be a loop). Imports inside
functions are the lazy ones the registry and the backends rely on, so they are not edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parent.parent / "pdserve" / "engine"
PREFIX = "pdserve.engine"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ENGINE.rglob("*.py"):
        parts = list(path.relative_to(ENGINE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join([PREFIX, *parts])] = path
    return mods


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]  # pdserve.engine and below


def _targets(node: ast.stmt, importer: str, is_pkg: bool, mods: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: resolve against the importer's package
        pkg = importer if is_pkg else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        base = f"{pkg}.{base}" if base else pkg
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        own = set(_ancestors(name)) | {name}
        for node in ast.parse(path.read_text()).body:  # module level only
            for target in _targets(node, name, is_pkg, mods):
                if not target.startswith(PREFIX):
                    continue
                while target not in mods:  # `import a.b.name` of an attribute
                    target = target.rpartition(".")[0]
                if target != name:  # named outright, even an ancestor: a real edge
                    graph[name].add(target)
                graph[name].update(t for t in _ancestors(target) if t in mods and t not in own)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_engine_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 30 and graph["pdserve.engine.llama"]  # the walk found the engine
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_walk_finds_a_cycle_when_there_is_one():
    # the detector itself: an edge back from a kernel to the model closes a loop
    graph = import_graph()
    graph["pdserve.engine.layers.norm"].add("pdserve.engine.llama")
    assert find_cycle(graph) is not None


@pytest.mark.parametrize("module,forbidden", [
    # a kernel never imports the model (its reference lives in the layer file)
    ("pdserve.engine.kernels.rms_norm", "pdserve.engine.llama"),
    ("pdserve.engine.kernels.rotary", "pdserve.engine.llama"),
    # a backend never imports the registry back
    ("pdserve.engine.attention.cpu_backend", "pdserve.engine.layers.registry"),
    ("pdserve.engine.attention.torch_backend", "pdserve.engine.layers.registry"),
    ("pdserve.engine.attention.triton_backend", "pdserve.engine.layers.registry"),
    ("pdserve.engine.cpu_kernels.layer_ops", "pdserve.engine.layers.registry"),
    # the layer files and the registry import no fast path at module level
    ("pdserve.engine.layers.registry", "pdserve.engine.cpu_kernels.library"),
    ("pdserve.engine.layers.registry", "pdserve.engine.kernels.common"),
    ("pdserve.engine.layers.registry", "pdserve.engine.attention.cpu_backend"),
])
def test_dependency_points_one_way(module, forbidden):
    graph = import_graph()
    seen, todo = set(), [module]
    while todo:  # everything `module` imports, transitively
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    assert forbidden not in seen
