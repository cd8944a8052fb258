"""The project's layering, read from the source: which package may import which.

    device_model  <-  lowering  <-  spyre_jax (user surface)
                             ^--  torch_bridge
    spyre_jax.tools (CLI, coverage, differential testing) may use all of them.

Imports are read with ``ast``, at module level and inside functions alike (an import inside a
function is still an arrow); imports under ``if TYPE_CHECKING:`` are annotations, not arrows.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("device_model", "lowering", "spyre_jax", "torch_bridge")
MAX_LINES = 800
MAX_FUNCTION_LINES = 120
MAX_LAZY_PROJECT_IMPORTS = 10


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = p
    return mods


MODULES = _modules()


def _is_package(mod: str) -> bool:
    return MODULES.get(mod, Path()).name == "__init__.py"


def _resolve(mod: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The project modules an import statement in ``mod`` loads."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = mod.split(".") if _is_package(mod) else mod.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            target = ".".join([*base, node.module] if node.module else base)
        else:
            target = node.module or ""
        names = []
        for a in node.names:
            sub = f"{target}.{a.name}"
            names.append(sub if sub in MODULES else target)
    out = []
    for n in names:
        # the longest project module that the dotted name starts with
        parts = n.split(".")
        for k in range(len(parts), 0, -1):
            cand = ".".join(parts[:k])
            if cand in MODULES:
                out.append(cand)
                break
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(mod: str) -> list[tuple[str, bool, int]]:
    """(imported project module, inside a function?, line) for every import in ``mod``."""
    tree = ast.parse(MODULES[mod].read_text())
    found = []

    def walk(node: ast.AST, in_fn: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                for t in _resolve(mod, child):
                    if t != mod:
                        found.append((t, in_fn, child.lineno))
            fn = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            walk(child, in_fn or fn)

    walk(tree, False)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def _pkg(mod: str) -> str:
    return mod.split(".")[0]


def _layer(mod: str) -> str:
    """The layer a module belongs to; spyre_jax's tools and CLI entry are their own layer."""
    if mod.startswith("spyre_jax.tools") or mod == "spyre_jax.__main__":
        return "tools"
    return _pkg(mod)


ALLOWED = {
    "device_model": {"device_model"},
    "lowering": {"lowering", "device_model"},
    "torch_bridge": {"torch_bridge", "lowering", "device_model"},
    "spyre_jax": {"spyre_jax", "lowering", "device_model"},
    "tools": {"tools", "spyre_jax", "torch_bridge", "lowering", "device_model"},
}


def test_the_graph_is_read():
    # the reader sees the arrows we know are there (a reader that saw none would pass anything)
    assert ("device_model.runtime", False) in {(t, f) for t, f, _ in GRAPH["spyre_jax.runtime"]}
    assert any(t == "torch_bridge.storage" for t, _, _ in GRAPH["torch_bridge.eager"])
    assert any(t == "lowering.from_fx" for t, _, _ in GRAPH["torch_bridge.backend"])
    assert len(MODULES) > 30


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_imports_follow_the_layers(mod):
    bad = [
        f"{mod}:{line} imports {t}" + (" (inside a function)" if fn else "")
        for t, fn, line in GRAPH[mod]
        if _layer(t) not in ALLOWED[_layer(mod)]
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = {m: sorted({t for t, _, _ in GRAPH[m]}) for m in MODULES}
    # a package's __init__ importing its own submodules is how packages work; not a cycle
    for m in graph:
        if _is_package(m):
            graph[m] = [t for t in graph[m] if not t.startswith(m + ".")]
    color: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        color[m] = 1
        for t in graph[m]:
            if color.get(t) == 1:
                cycles.append(" -> ".join([*path[path.index(t) :], t]))
            elif t not in color:
                visit(t, [*path, t])
        color[m] = 2

    for m in graph:
        if m not in color:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_lazy_project_imports_are_few():
    lazy = sorted({f"{m}:{line} -> {t}" for m in MODULES for t, fn, line in GRAPH[m] if fn})
    assert len(lazy) <= MAX_LAZY_PROJECT_IMPORTS, "\n".join(lazy)


def test_no_source_file_is_too_long():
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in MODULES.values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, "\n".join(long)


def _long_functions(tree: ast.AST, where: str) -> list[str]:
    return [
        f"{where}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1} lines"
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES
    ]


def test_no_function_is_too_long():
    long = []
    for p in MODULES.values():
        long += _long_functions(ast.parse(p.read_text()), str(p.relative_to(ROOT)))
    assert not long, "\n".join(long)
    planted = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    assert _long_functions(ast.parse(planted), "planted")


def _private_imports(tree: ast.AST) -> list[str]:
    """Names starting with one underscore that a module imports from one of ours."""
    out = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.ImportFrom):
            continue
        ours = n.level > 0 or (n.module or "").split(".")[0] in PACKAGES
        if ours:
            out += [a.name for a in n.names if a.name.startswith("_") and a.name[1:2] != "_"]
    return out


def test_no_module_imports_another_modules_private_names():
    # each module's public names are its interface (the tilers share lowering.tiling's)
    found = []
    for mod, p in MODULES.items():
        found += [f"{mod}: {name}" for name in _private_imports(ast.parse(p.read_text()))]
    assert not found, "\n".join(found)
    assert _private_imports(ast.parse("from .tiling import _Ctx, step_tables")) == ["_Ctx"]
    assert _private_imports(ast.parse("from torch.utils import _pytree")) == []


def test_a_planted_arrow_is_caught(tmp_path):
    # the rule table itself: device_model may not import lowering, lowering may not import
    # torch_bridge, torch_bridge and spyre_jax's surface may not import each other
    assert "lowering" not in ALLOWED["device_model"]
    assert "torch_bridge" not in ALLOWED["lowering"]
    assert "spyre_jax" not in ALLOWED["torch_bridge"]
    assert "torch_bridge" not in ALLOWED["spyre_jax"]
    node = ast.parse("from spyre_jax.api import jit").body[0]
    assert _resolve("torch_bridge.eager", node) == ["spyre_jax.api"]
    node = ast.parse("from . import storage").body[0]
    assert _resolve("torch_bridge.eager", node) == ["torch_bridge.storage"]
    node = ast.parse("from .kernel import Kernel").body[0]
    assert _resolve("device_model.runtime", node) == ["device_model.kernel"]
