"""The package's folders are the layers of DESIGN.md, and imports only go down: a module may
import from its own layer or a lower one, never a higher one, and no two modules import each
other (directly or through others), at module level or inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import shardlib

ROOT = Path(shardlib.__file__).parent
# front ends (5) include the reference models their runs build; the command-line edges (6, where Hydra
# is composed: ``cli``, and the ``python -m shardlib.explain`` / ``shardlib.verify`` / ``shardlib.autoplan`` entry points) sit on top
LAYERS = {"errors": 0, "allocator": 0, "validate": 0, "algebra": 1, "quant": 1, "comm": 2, "planner": 3, "runtime": 4,
          "frontend": 5, "testing": 5, "models": 5, "cli": 6, "explain": 6, "verify": 6, "autoplan": 6, "calibrate": 6}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["shardlib"] + parts)


def _target(node: ast.ImportFrom, path: Path) -> str:
    """The module ``from X import ...`` in ``path`` imports from: X, a relative X resolved."""
    if not node.level:
        return node.module or ""
    mod = _module(path)
    pkg = (mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]).split(".")
    return ".".join(pkg[: len(pkg) - (node.level - 1)] + ([node.module] if node.module else []))


def _imports(path: Path) -> set[str]:
    """Every shardlib module ``path`` imports, anywhere in the file (lazy imports included)."""
    out = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", getattr(block.test, "attr", "")) == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)}   # annotations only, never run
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            target = _target(node, path)
            if not target.startswith("shardlib"):
                continue
            for alias in node.names:   # `from . import core` imports a module
                sub = f"{target}.{alias.name}"
                out.add(sub if (ROOT.parent / (sub.replace(".", "/") + ".py")).exists() else target)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("shardlib.")}
    return out


def _graph() -> dict[str, set[str]]:
    return {_module(p): _imports(p) - {_module(p)} for p in ROOT.rglob("*.py")}


def _layer(mod: str) -> int | None:
    parts = mod.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_module_belongs_to_a_layer():
    unplaced = sorted(m for m in _graph() if m != "shardlib" and _layer(m) is None)
    assert unplaced == [], f"modules outside the layer folders: {unplaced}"


def test_imports_only_go_down():
    bad = [f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
           for m, targets in _graph().items() if m != "shardlib"
           for t in targets if t != "shardlib" and _layer(t) is not None and _layer(t) > _layer(m)]
    assert bad == [], "\n".join(bad)


def test_no_import_cycles():
    graph = _graph()
    graph.pop("shardlib", None)
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if t not in graph:
                continue
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]) if t in stack else f"{m} -> {t}")
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def test_no_module_imports_another_modules_private_names():
    """A name with one leading underscore is its own module's: a module that needs another's helper
    imports it public (or the two share it from a third module). Tests may still reach in."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        mod = _module(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (target := _target(node, path)) != mod \
                    and (target == "shardlib" or target.startswith("shardlib.")):
                bad += [f"{mod} imports {a.name} from {target}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert bad == [], "private names imported across modules:\n" + "\n".join(bad)
