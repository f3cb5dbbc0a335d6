"""The code's layering rules, read from the source with ``ast``: who may know what, and who may import whom."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

from gguf.arch_traits import KNOWN_ARCHITECTURES, TRAITS

ROOT = Path(__file__).resolve().parents[1]
#: The packages, lowest first: a module may import its own package and the ones before it, never one after.
PACKAGES = ("gguf", "launcher", "studio")


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _architecture_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every architecture name written out, and every ``.architecture`` read outside an f-string."""
    printed = {
        id(v.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.JoinedStr)
        for v in node.values
        if isinstance(v, ast.FormattedValue)
    }
    names = KNOWN_ARCHITECTURES | set(TRAITS)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.append((node.lineno, f"the architecture name {node.value!r}"))
        elif isinstance(node, ast.Attribute) and node.attr == "architecture" and id(node) not in printed:
            found.append((node.lineno, f"{ast.unparse(node)} used for more than a message"))
    return found


def test_the_launcher_names_no_architecture():
    """The launcher asks ``ModelFacts.traits`` (``gguf.arch_traits``); it may print a model's architecture only."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in _sources("launcher")
        for line, what in _architecture_uses(ast.parse(path.read_text()))
    ]
    assert offenders == []


def test_the_architecture_check_finds_names_comparisons_and_lookups():
    code = """
if facts.architecture == "qwen35" or facts.architecture in SOME_SET or "grok" in x: pass
table[facts.architecture]
print(f"not on {facts.architecture}'s graph")
"""
    assert sorted(line for line, _ in _architecture_uses(ast.parse(code))) == [2, 2, 2, 2, 3]


def _module_names() -> dict[str, Path]:
    """Dotted name -> source file of every module of the three packages."""
    out = {}
    for package in PACKAGES:
        for path in _sources(package):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(tree: ast.AST, modules: Mapping[str, Path]) -> Iterator[tuple[int, str]]:
    """(line, module) of every import of one of ``modules`` anywhere in ``tree``: at the top, inside a function or
    under ``TYPE_CHECKING`` alike, since each is a dependency the design has to answer for."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module in modules:
            for a in node.names:  # ``from pkg import submodule`` depends on the submodule
                yield node.lineno, f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module


def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {imported module: line} over gguf, launcher and studio (compiled extensions are leaves)."""
    modules = _module_names()
    return {
        name: {target: line for line, target in _imports(ast.parse(path.read_text()), modules) if target != name}
        for name, path in modules.items()
    }


def circles(graph: Mapping[str, Mapping[str, int]]) -> list[frozenset[str]]:
    """The strongly connected groups of more than one module (Tarjan), each a set of modules importing in a ring."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while (w := stack.pop()) != v:
                group.add(w)
            if group:
                found.append(frozenset({v, *group}))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_only_go_down_studio_launcher_gguf():
    rank = {package: i for i, package in enumerate(PACKAGES)}
    graph = import_graph()
    upward = [
        f"{_module_names()[a].relative_to(ROOT)}:{line}: {a} imports {b}"
        for a, targets in graph.items()
        for b, line in targets.items()
        if rank[b.split(".")[0]] > rank[a.split(".")[0]]
    ]
    assert upward == []


def test_no_two_modules_import_each_other_even_through_others():
    """Over gguf, launcher and studio alike: no module reaches itself through its imports."""
    assert circles(import_graph()) == []


def test_the_circle_finder_sees_rings_through_lazy_and_type_checking_imports():
    code = {
        "a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from b import X\n",
        "b": "def f():\n    import c\n",
        "c": "from a import Y\nimport d\n",
        "d": "",
    }
    modules = {name: Path(name) for name in code}
    graph = {name: {t: line for line, t in _imports(ast.parse(text), modules)} for name, text in code.items()}
    assert circles(graph) == [frozenset({"a", "b", "c"})]
