"""The code's layering rules, read from the source with ``ast``: who may know what, and who may import whom."""

from __future__ import annotations

import ast
from pathlib import Path

from gguf.arch_traits import KNOWN_ARCHITECTURES, TRAITS

ROOT = Path(__file__).resolve().parents[1]


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _architecture_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every architecture name written out, and every ``.architecture`` read outside an f-string."""
    printed = {id(v.value) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
               for v in node.values if isinstance(v, ast.FormattedValue)}
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
    offenders = [f"{path.relative_to(ROOT)}:{line}: {what}" for path in _sources("launcher")
                 for line, what in _architecture_uses(ast.parse(path.read_text()))]
    assert offenders == []


def test_the_architecture_check_finds_names_comparisons_and_lookups():
    code = '''
if facts.architecture == "qwen35" or facts.architecture in SOME_SET or "grok" in x: pass
table[facts.architecture]
print(f"not on {facts.architecture}'s graph")
'''
    assert sorted(line for line, _ in _architecture_uses(ast.parse(code))) == [2, 2, 2, 2, 3]
