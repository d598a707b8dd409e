"""The package's layers (CONTRIBUTING.md, 'Layers'), checked on its source with `ast`: every module
imports only from its own layer or the layers below, no modules import each other in a cycle, no
module imports another module's private (underscore) names, and only the framework adapters
import torch or JAX."""

from __future__ import annotations

import ast
import pathlib

import pytest

CHECKOUT = pathlib.Path(__file__).resolve().parent.parent

# Top to bottom; a module may import from its own layer and any layer below it. The first prefix
# that matches a module's name gives its layer.
LAYERS = (
    ("tools", ("cuflash2.cli", "cuflash2.__main__", "cuflash2.bench", "cuflash2.checks")),
    ("api", ("cuflash2.api", "cuflash2.varlen", "cuflash2.kvcache")),
    ("frameworks", ("cuflash2.frameworks",)),
    ("core", ("cuflash2.core",)),
    ("families", ("cuflash2.families",)),
    ("problem", ("cuflash2.problem",)),
    ("runtime", ("cuflash2.runtime",)),
    ("leaves", ("cuflash2.dropout", "cuflash2.reference", "cuflash2.materialize")),
)
PACKAGE_ROOT = "cuflash2"  # the package's own __init__: the public names (api layer)
FRAMEWORK_MODULES = ("torch", "jax", "jaxlib")
FRAMEWORK_LAYERS = ("frameworks", "tools")  # the CLI's benchmarks time torch's own attention too


def layer_of(module: str) -> str:
    if module == PACKAGE_ROOT:
        return "api"
    for layer, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return layer
    raise AssertionError(f"{module}: no layer (add it to LAYERS in tests/test_architecture.py)")


def rank(layer: str) -> int:
    return [name for name, _ in LAYERS].index(layer)


# ---- the checker (pure: a module graph in, violations out) -------------------------------------------

def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
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
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def violations(imports: dict[str, list[tuple[str, str | None, int]]], layer_of=layer_of) -> list[str]:
    """imports: module -> [(imported module, imported name or None, line)], names resolved (a name
    that is a module is listed as that module). Returns one line per upward import, private name
    taken from another module, and import cycle."""
    found = []
    graph: dict[str, set[str]] = {module: set() for module in imports}
    for module, entries in sorted(imports.items()):
        for target, name, line in entries:
            if target == module:
                continue
            graph[module].add(target)
            if rank(layer_of(target)) < rank(layer_of(module)):
                found.append(f"{module}:{line}: imports {target} ({layer_of(target)}) from the lower layer "
                             f"{layer_of(module)}")
            if name is not None and name.startswith("_") and not name.startswith("__"):
                found.append(f"{module}:{line}: takes the private name {name} of {target}")
    found += [f"import cycle: {' -> '.join(cycle)}" for cycle in find_cycles(graph)]
    return found


# ---- the package's import graph ---------------------------------------------------------------------

def package_modules() -> dict[str, pathlib.Path]:
    """Module name -> file of every module of the package (cli/ is installed as cuflash2.cli)."""
    modules = {}
    for root, prefix in ((CHECKOUT / "cuflash2", "cuflash2"), (CHECKOUT / "cli", "cuflash2.cli")):
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([prefix, *parts])] = path
    return modules


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level:
        base = base[:len(base) - (level - 1)]
        return ".".join(base + ([target] if target else []))
    return target or ""


def imports_of(module: str, path: pathlib.Path, known: set[str]) -> list[tuple[str, str | None, int]]:
    """The package modules `module` imports (anywhere in it, functions included), with the names it
    takes from them, and its attribute reads of private names through an imported module."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    entries, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE_ROOT and alias.name in known:
                    entries.append((alias.name, None, node.lineno))
                    aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, is_package, node.level, node.module)
            if source.split(".")[0] != PACKAGE_ROOT:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in known:  # `from . import x` with x a module
                    entries.append((submodule, None, node.lineno))
                    aliases[alias.asname or alias.name] = submodule
                else:
                    entries.append((source, alias.name, node.lineno))
    for node in ast.walk(tree):  # `launcher._slots`: a private name read through a module alias
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            entries.append((aliases[node.value.id], node.attr, node.lineno))
    return entries


def third_party_imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


# ---- the tests ----------------------------------------------------------------------------------------

def test_the_package_imports_only_downward_without_cycles_or_private_names():
    modules = package_modules()
    known = set(modules)
    graph = {module: imports_of(module, path, known) for module, path in modules.items()}
    assert violations(graph) == []


def test_every_module_has_a_layer():
    for module in package_modules():
        layer_of(module)


def test_only_the_adapters_import_torch_or_jax():
    for module, path in package_modules().items():
        if layer_of(module) not in FRAMEWORK_LAYERS:
            assert not third_party_imports(path) & set(FRAMEWORK_MODULES), module


def test_the_checker_reports_upward_imports_cycles_and_private_names():
    layers = {"app.top": "api", "app.entry": "api", "app.mid": "core", "app.low": "runtime", "app.other": "core"}
    graph = {
        "app.top": [("app.mid", None, 1), ("app.low", "_private", 7)],  # downward: fine; a private name
        "app.entry": [],
        "app.mid": [("app.low", "helper", 2), ("app.other", None, 3)],
        "app.other": [("app.mid", None, 4)],  # a cycle inside one layer
        "app.low": [("app.entry", "run", 5), ("app.low", "_self", 6)],  # upward (and its own name: fine)
    }
    found = violations(graph, layers.__getitem__)
    assert any("app.low:5: imports app.entry" in v for v in found), found
    assert any("app.top:7: takes the private name _private" in v for v in found), found
    assert any(v == "import cycle: app.mid -> app.other" for v in found), found
    assert len(found) == 3, found


def test_the_checker_reads_relative_imports_and_module_aliases(tmp_path):
    path = tmp_path / "ops.py"
    path.write_text("from ..runtime import launcher\nfrom . import replay\nfrom .replay import _hidden\n"
                    "def f():\n    return launcher._slots\n")
    known = {"cuflash2.core.ops", "cuflash2.core.replay", "cuflash2.runtime.launcher", "cuflash2.runtime"}
    entries = imports_of("cuflash2.core.ops", path, known)
    assert ("cuflash2.runtime.launcher", None, 1) in entries
    assert ("cuflash2.core.replay", None, 2) in entries
    assert ("cuflash2.core.replay", "_hidden", 3) in entries
    assert ("cuflash2.runtime.launcher", "_slots", 5) in entries


@pytest.mark.parametrize("module", ["cuflash2.frameworks.torch_adapter", "cuflash2.core.replay",
                                    "cuflash2.families.mma_sync.launches", "cuflash2.runtime.compiler"])
def test_layers_are_assigned_by_package(module):
    assert layer_of(module) == module.split(".")[1]
