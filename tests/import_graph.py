"""The import graph of meshlm's two packages, read from the source with `ast` (every import,
module-level or inside a function), and what the architecture tests ask of it: no circles, each
folder importing only the folders below it, no command importing another command.

    python tests/import_graph.py   # modules per folder, import floors, circles, longest chain
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lm", "sharding")
# The commands a user runs (`python -m lm.X`): doors onto the library, never libraries themselves.
COMMANDS = ("train", "prepare", "generate", "convert", "bench", "layout", "plan", "calibrate", "numerics", "launch", "evaluate")
# lm's folders from the bottom up: a module may import its own floor and those below, never above.
# `lm` alone is the package's __init__ (environment set-up, cache_home) and errors.
FLOORS = (
    ("lm", "lm.errors", "sharding"),
    ("lm.hardware", "lm.paths", "lm.progress"),
    ("lm.model",),
    ("lm.config", "lm.config_checks", "lm.recipe"),
    ("lm.data",),
    ("lm.compiler",),
    ("lm.program",),
    ("lm.hf",),
    ("lm.evaluation",),
    ("lm.training", "lm.planner"),
    ("lm.cli",),
    tuple(f"lm.{c}" for c in COMMANDS),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imports(path: Path, known: set[str]) -> set[str]:
    """The meshlm modules `path` imports: `from a.b import c` is `a.b.c` where that is a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module for alias in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return found


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, set(found)) - {name} for name, path in found.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def floor(module: str) -> int:
    """The floor of a module: that of the longest prefix FLOORS names (`lm` itself only exactly)."""
    best = None
    for i, names in enumerate(FLOORS):
        for name in names:
            if (module == name or (name != "lm" and module.startswith(name + "."))) and (best is None or len(name) > len(best[1])):
                best = (i, name)
    if best is None:
        raise KeyError(f"{module} is on no floor: add its folder to FLOORS")
    return best[0]


def upward(g: dict[str, set[str]]) -> list[str]:
    """Imports that reach a higher floor (or one command importing another)."""
    return [f"{a} -> {b}" for a, targets in sorted(g.items()) for b in sorted(targets)
            if floor(b) > floor(a) or (floor(a) == floor(b) == len(FLOORS) - 1)]


def depth(g: dict[str, set[str]]) -> dict[str, int]:
    """Each module's import floor: 0 for a module importing no other, else 1 + its imports' deepest."""
    memo: dict[str, int] = {}

    def d(v: str) -> int:
        if v not in memo:
            memo[v] = 0
            memo[v] = 1 + max((d(w) for w in g[v]), default=-1)
        return memo[v]

    return {v: d(v) for v in g}


def longest_chain(g: dict[str, set[str]], start: str) -> list[str]:
    depths = depth(g)
    chain = [start]
    while g[chain[-1]]:
        chain.append(max(sorted(g[chain[-1]]), key=depths.get))
    return chain


def facts() -> dict:
    g = graph()
    folders: dict[str, int] = {}
    for path in modules().values():
        folder = ".".join(path.parent.relative_to(ROOT).parts)
        folders[folder] = folders.get(folder, 0) + 1
    depths = depth(g)
    command = max((f"lm.{c}" for c in COMMANDS), key=depths.get)
    return {
        "modules": len(g),
        "modules_per_folder": dict(sorted(folders.items())),
        "import_floors": 1 + max(depths.values()),
        "circles": circles(g),
        "upward_imports": upward(g),
        "longest_command_chain": longest_chain(g, command),
    }


if __name__ == "__main__":
    print(json.dumps(facts(), indent=1))
