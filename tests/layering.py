"""The import direction of docs/design.md §1 as a checker over source text (used by test_layering).

Every ``import`` / ``from … import`` statement counts wherever it stands: module level, inside a
function, or under ``if TYPE_CHECKING:`` (a type-only import still ties the two modules), and so
does ``importlib.import_module("literal")``. Components, each importable by those to its right::

    eviction <- cache <- engine <- server <- cli
    kernels  <- model <- engine

``radixkv.arg_types``, ``radixkv.config``, ``radixkv.errors``, ``radixkv.log`` and
``radixkv._kernels_name`` (and the bare ``radixkv`` package, which imports the last) are base modules that any component may import; they themselves import only other base modules
and ``radixkv.eviction``. ``model`` may import ``radixkv.eviction.cost_model`` and nothing else
of the eviction package. Only ``radixkv.cli`` imports ``server`` and ``tools``; ``tools`` sits
beside ``server`` (engine and below). ``bench`` may import anything; nothing imports ``bench``.
``cache`` and ``eviction`` import no torch (nor triton).

Module length is a review guideline, not a rule: ``long_modules`` lists modules over
``REVIEW_MODULE_LINES`` for test_layering to print as a warning. Split a module where it holds two
things that change apart, never to get under the number (a class owns its state in one place).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Folder -> the dotted package it is installed as (pyproject's package-dir mapping).
SOURCE_ROOTS = {"radixkv": "radixkv", "kernels": "radixkv.kernels",
                "eviction": "radixkv.eviction", "bench": "bench"}
BASE_MODULES = frozenset({"radixkv", "radixkv.arg_types", "radixkv.config", "radixkv.errors", "radixkv.log",
                          "radixkv._kernels_name"})
#: Past this many lines test_layering warns (a prompt to look at the module, not a failure).
REVIEW_MODULE_LINES = 400

_LOWER = {
    "eviction": set(),
    "kernels": set(),
    "base": {"eviction"},
    "cache": {"eviction"},
    "model": {"kernels"},  # + radixkv.eviction.cost_model, checked apart
    "engine": {"eviction", "cache", "kernels", "model"},
    "server": {"eviction", "cache", "kernels", "model", "engine"},
    "tools": {"eviction", "cache", "kernels", "model", "engine"},
    "cli": {"eviction", "cache", "kernels", "model", "engine", "server", "tools"},
    "bench": {"eviction", "cache", "kernels", "model", "engine", "server", "tools", "cli"},
}
_TORCH_FREE = {"cache", "eviction"}


@dataclass(frozen=True)
class Violation:
    kind: str  # "upward", "cycle", "torch"
    module: str
    detail: str


def read_sources(repo: Path = REPO) -> dict[str, str]:
    """Return ``{dotted module name: source}`` for every module under the source roots."""
    sources: dict[str, str] = {}
    for folder, package in SOURCE_ROOTS.items():
        for path in sorted((repo / folder).rglob("*.py")):
            rel = path.relative_to(repo / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            sources[".".join([package, *parts])] = path.read_text(encoding="utf-8")
    return sources


def component(module: str) -> str:
    if module in BASE_MODULES:
        return "base"
    parts = module.split(".")
    if parts[0] == "bench":
        return "bench"
    return parts[1] if parts[1] in _LOWER else "base?"


def _is_package(module: str, sources: dict[str, str]) -> bool:
    return any(name.startswith(module + ".") for name in sources)


def _relative(package: str, level: int, name: str) -> str:
    base = package.split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _dynamic_import(node: ast.Call, package: str) -> str | None:
    """The module a call ``importlib.import_module("m"[, "pkg"])`` / ``import_module(...)`` (any
    alias of it) / ``__import__("m")`` names with a literal, or None for any other call."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return None
    target = first.value
    if target.startswith("."):  # import_module("..x", "pkg"): relative to the given package
        anchor = node.args[1] if len(node.args) > 1 else None
        anchor_name = anchor.value if isinstance(anchor, ast.Constant) else package
        level = len(target) - len(target.lstrip("."))
        return _relative(str(anchor_name), level, target.lstrip("."))
    return target


def imports_of(module: str, source: str, sources: dict[str, str]) -> set[str]:
    """Return every module name ``source`` imports (first-party resolved to known modules).

    Counts ``import``, ``from … import`` (relative too) and literal dynamic imports:
    ``importlib.import_module``, a bare or aliased ``import_module`` and ``__import__``.
    """
    found: set[str] = set()
    package = module if _is_package(module, sources) else module.rpartition(".")[0]
    aliases: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = _relative(package, node.level, node.module or "")
            else:
                target = node.module or ""
            found.add(target)
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one.
            found.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in sources)
            if target == "importlib":
                aliases.update(a.asname for a in node.names if a.name == "import_module" and a.asname)
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in aliases:
                node = ast.Call(func=ast.Name(id="import_module"), args=node.args, keywords=[])
            target = _dynamic_import(node, package)
            if target is not None:
                found.add(target)
    return found


def _first_party(name: str, sources: dict[str, str]) -> str | None:
    """The longest known module that ``name`` is or lies in (None for third-party names).

    A source root without an ``__init__`` (``bench``) still counts as first-party.
    """
    while name:
        if name in sources or name in SOURCE_ROOTS.values():
            return name
        name = name.rpartition(".")[0]
    return None


def check(sources: dict[str, str]) -> list[Violation]:
    """Every layering, cycle and torch violation among ``sources``."""
    problems: list[Violation] = []
    graph: dict[str, set[str]] = {}
    for module, source in sources.items():
        comp = component(module)
        edges = graph.setdefault(module, set())
        for name in sorted(imports_of(module, source, sources)):
            root = name.split(".")[0]
            if root in ("torch", "triton") and comp in _TORCH_FREE:
                problems.append(Violation("torch", module, f"imports {name}"))
            target = _first_party(name, sources)
            if target is None or target == module:
                continue
            edges.add(target)
            tcomp = component(target)
            if tcomp == comp or (comp == "bench"):
                continue
            allowed = tcomp == "base" and comp != "base" or tcomp in _LOWER.get(comp, set())
            if comp == "model" and target == "radixkv.eviction.cost_model":
                allowed = True
            if comp == "base" and tcomp == "base":
                allowed = True
            if not allowed:
                problems.append(Violation("upward", module, f"imports {target} ({comp} -> {tcomp})"))
    problems.extend(Violation("cycle", min(c), " -> ".join(sorted(c))) for c in _cycles(graph))
    return problems


def long_modules(sources: dict[str, str], limit: int = REVIEW_MODULE_LINES) -> list[tuple[str, int]]:
    """``(module, line count)`` for each module longer than ``limit`` lines, longest first."""
    sizes = ((module, len(source.splitlines())) for module, source in sources.items())
    return sorted((m for m in sizes if m[1] > limit), key=lambda m: (-m[1], m[0]))


#: ``# type: ignore[code, …]  # reason``: what mypy is told to skip, and why.
_EXPLAINED_IGNORE = re.compile(r"#\s*type:\s*ignore\[[a-z-]+(?:,\s*[a-z-]+)*\]\s+#\s*\S")


def unexplained_ignores(sources: dict[str, str]) -> list[str]:
    """``module:line`` of each ``# type: ignore`` in the type-checked packages (``radixkv``,
    with eviction and kernels) that lacks an error code or a reason comment after it."""
    found = []
    for module, source in sources.items():
        if module.split(".")[0] != "radixkv":
            continue
        for number, line in enumerate(source.splitlines(), 1):
            if re.search(r"#\s*type:\s*ignore", line) and not _EXPLAINED_IGNORE.search(line):
                found.append(f"{module}:{number}")
    return found


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[set[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component_nodes = set()
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component_nodes.add(top)
                    if top == node:
                        break
                if len(component_nodes) > 1:
                    found.append(component_nodes)
    return found
