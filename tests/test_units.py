"""The one way sizes are written for a person (``launcher.units``), and that nothing else writes MiB by hand."""

from __future__ import annotations

import ast
from pathlib import Path

from launcher.units import GIB, MIB, format_gib, format_mib, format_size

ROOT = Path(__file__).resolve().parents[1]


def test_sizes_are_written_in_mib_with_separators_and_in_gib_from_10_gib():
    assert format_mib(1234 * MIB) == "1,234 MiB"
    assert format_mib(3.254 * MIB, decimals=2) == "3.25 MiB"
    assert format_gib(12.5 * GIB) == "12.5 GiB"
    assert format_size(10 * GIB - MIB) == "10,239 MiB"
    assert format_size(10 * GIB) == "10.0 GiB"
    assert format_size(3 * MIB + MIB // 4, fine=True) == "3.25 MiB"
    assert format_size(3 * MIB + MIB // 4) == "3 MiB"


def _hand_written_sizes(tree: ast.AST) -> list[int]:
    """Lines of f-strings that print a computed or formatted number followed by `` MiB``/`` GiB`` themselves
    (``f"{n / MIB:,.0f} MiB"``); a regex's ``rf"{_NUM} MiB"`` and a setting's ``f"{mb} MiB"`` are not sizes in bytes."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            for before, after in zip(node.values, node.values[1:], strict=False):
                if (
                    isinstance(before, ast.FormattedValue)
                    and isinstance(after, ast.Constant)
                    and str(after.value).startswith((" MiB", " GiB"))
                    and (before.format_spec is not None or isinstance(before.value, ast.BinOp))
                ):
                    found.append(node.lineno)
    return found


def test_no_module_but_launcher_units_formats_mib_or_gib_itself():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}"
        for package in ("gguf", "launcher", "studio")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != ROOT / "launcher" / "units.py"
        for line in _hand_written_sizes(ast.parse(path.read_text()))
    ]
    assert offenders == []


def test_the_size_check_sees_a_hand_written_mib():
    assert _hand_written_sizes(ast.parse('x = f"{n / 2**20:,.0f} MiB free"\ny = f"{n} tokens"')) == [1]
