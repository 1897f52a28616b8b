"""Scans of the source with ``ast``, for the house tests: what imports what, how long each function is, and
where a test sleeps a fixed fraction of a second."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("ar_service", "dit_service", "services", "shared")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_sources(root: Path = ROOT) -> dict[str, Path]:
    """Every product module by its dotted name (a package by its own, for its ``__init__.py``)."""
    return {module_name(path, root): path for package in PRODUCT for path in sorted((root / package).rglob("*.py"))}


def imported(tree: ast.Module, module: str, is_package: bool, known: Iterable[str]) -> set[str]:
    """The modules of ``known`` that ``module``'s source imports, wherever the import stands (a function's
    body, ``if TYPE_CHECKING:``): a circle of type imports ties modules together as much as one at run time.
    ``from a import b`` is an import of module ``a.b`` when there is one, else of ``a``. A module's parent
    packages, which Python imports first, are left out: a package's ``__init__`` that gathers its modules'
    names would otherwise put every module in a circle with it."""
    known = set(known)
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return (found & known) - {module}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    sources = product_sources(root)
    return {
        module: imported(ast.parse(path.read_text()), module, path.name == "__init__.py", sources)
        for module, path in sources.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def circle_path(graph: dict[str, set[str]], circle: list[str]) -> str:
    """A shortest way round ``circle`` from its first module, as ``a → b → a``: the imports to cut are among
    these."""
    members, start = set(circle), circle[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth first: inside a strongly connected component every module leads back to start
        following = []
        for node in frontier:
            for successor in sorted(graph[node] & members):
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return " → ".join([*reversed(path), start])
                if successor not in came_from:
                    came_from[successor] = node
                    following.append(successor)
        frontier = following
    raise ValueError(f"{circle} is not a circle of {graph}")


@dataclass(frozen=True)
class Function:
    path: Path
    name: str  # qualified: Class.method, outer.<locals>.inner
    lines: int  # from ``def`` to its last line; decorators not counted

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}: {self.name} ({self.lines} lines)"


def functions(tree: ast.Module, path: Path) -> Iterator[Function]:
    def walk(node: ast.AST, prefix: str) -> Iterator[Function]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                assert child.end_lineno is not None
                yield Function(path, name, child.end_lineno - child.lineno + 1)
                yield from walk(child, f"{name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def product_functions(root: Path = ROOT) -> Iterator[Function]:
    for path in product_sources(root).values():
        yield from functions(ast.parse(path.read_text()), path)


SLEEPERS = {"time", "asyncio", "anyio"}


@dataclass(frozen=True)
class Sleep:
    path: str  # from the repository's root
    function: str  # the enclosing function's qualified name; "" at module level
    code: str  # the line, stripped
    line: int  # where it is now, for the message only: allowlist entries do not move with it

    @property
    def key(self) -> tuple[str, str, str]:
        return self.path, self.function, self.code

    def __str__(self) -> str:
        return f"{self.path}:{self.line} in {self.function or '<module>'}: {self.code}"


def fixed_sleeps(source: str, path: str) -> list[Sleep]:
    """Calls of ``time.sleep``, ``asyncio.sleep`` or ``anyio.sleep`` (also imported by name) with a number
    written out between 0 and 1 second. ``sleep(0)`` is left out: it yields to the event loop once, it does
    not wait for time to pass; so is a sleep of a name or an expression (a bound the test is about, named)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    aliases = {}  # local name → what it stands for: "time", "time.sleep"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name in SLEEPERS})
        elif isinstance(node, ast.ImportFrom) and node.module in SLEEPERS:
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names if a.name == "sleep"})

    def is_sleep(call: ast.Call) -> bool:
        func = call.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            return func.attr == "sleep" and aliases.get(func.value.id) in SLEEPERS
        return isinstance(func, ast.Name) and aliases.get(func.id, "").endswith(".sleep")

    def fixed(call: ast.Call) -> bool:
        seconds = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "delay"), None)
        if not isinstance(seconds, ast.Constant) or isinstance(seconds.value, bool):
            return False
        return isinstance(seconds.value, int | float) and 0 < seconds.value < 1

    found: list[Sleep] = []

    def walk(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                walk(child, f"{function}.{child.name}" if function else child.name)
                continue
            if isinstance(child, ast.ClassDef):
                walk(child, f"{function}.{child.name}" if function else child.name)
                continue
            if isinstance(child, ast.Call) and is_sleep(child) and fixed(child):
                found.append(Sleep(path, function, lines[child.lineno - 1].strip(), child.lineno))
            walk(child, function)

    walk(tree, "")
    return found


def sleeps_in_tests(root: Path = ROOT) -> list[Sleep]:
    found = []
    for path in sorted((root / "tests").rglob("*.py")):
        found += fixed_sleeps(path.read_text(), str(path.relative_to(root)))
    return found
