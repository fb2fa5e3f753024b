"""The packages are layers that import one way: traces -> cache_core -> feather_gym -> trainer ->
deploy, with the command-line layer (feather_cli) on top of all of them.

Every import counts, at module level or inside a function: no module imports a package above
its own, no two modules import each other (directly or through a longer circle), and only
deploy/ touches vLLM's v1 internals.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("traces", "cache_core", "feather_gym", "trainer", "deploy", "feather_cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, name: str, *, is_package: bool = False) -> set[str]:
    """Every project module that the source of module ``name`` imports, anywhere in it (inside
    functions too), as dotted names; ``from pkg import x`` counts ``pkg`` and ``pkg.x``."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {m for m in found if m.split(".")[0] in LAYERS}


def project_graph() -> dict[str, set[str]]:
    files = [p for layer in LAYERS for p in (ROOT / layer).rglob("*.py")]
    modules = {module_name(p): p for p in files}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_modules(path.read_text(), name, is_package=path.name == "__init__.py"):
            while imported and imported not in modules:     # `from pkg.mod import Name` -> pkg.mod
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


GRAPH = project_graph()


def layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def test_the_graph_sees_every_package():
    assert {module.split(".")[0] for module in GRAPH} == set(LAYERS)
    assert {"trainer.config", "trainer.train"} <= GRAPH["feather_cli.train"]   # at module level and in a function


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_import_runs_back_up(module):
    upward = sorted(target for target in GRAPH[module] if layer(target) > layer(module))
    assert not upward, f"{module} imports a layer above its own: {upward}"


def test_no_module_circle():
    """Tarjan's strongly connected components: every one is a single module."""
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    assert not circles, f"modules that import each other: {circles}"


def test_only_deploy_touches_vllm_v1():
    offenders = []
    for module, path in ((m, ROOT / Path(*m.split("."))) for m in GRAPH):
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if module.startswith("deploy"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{module}: {n}" for n in names if n.startswith("vllm.v1")]
    assert not offenders


def test_the_checker_sees_imports_inside_functions_and_relative_ones():
    """A checker that cannot fail proves nothing: an upward import inside a function, and a
    relative one, are both found."""
    source = "def f():\n    from trainer.config import TrainConfig\n    from .model import CostModel\n"
    found = imported_modules(source, "feather_gym.costmodel.fit")
    assert {"trainer.config", "feather_gym.costmodel.model"} <= found
    assert layer("trainer.config") > layer("feather_gym.costmodel.fit")
