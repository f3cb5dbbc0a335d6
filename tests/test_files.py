"""Atomic writes: a reader sees the old file or the new one, never half of one, and a failed write leaves no trace."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gguf.files import replacing, write_atomically


def test_write_atomically_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    target = tmp_path / "index.json"
    target.write_text("old")
    write_atomically(target, '{"new": true}')
    write_atomically(tmp_path / "blob.bin", b"\x00\x01")
    assert target.read_text() == '{"new": true}' and (tmp_path / "blob.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blob.bin", "index.json"]


def test_a_write_that_fails_half_way_keeps_the_old_file_and_removes_the_temporary_one(tmp_path):
    target = tmp_path / "model.gguf"
    target.write_bytes(b"old model")
    with pytest.raises(OSError, match="disk full"), replacing(target) as tmp:
        tmp.write_bytes(b"half a mod")
        raise OSError("disk full")
    assert target.read_bytes() == b"old model"
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


def test_the_temporary_file_is_never_what_readers_look_for(tmp_path):
    target = tmp_path / "model.gguf"
    with replacing(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".") and not tmp.name.endswith(".gguf")
        assert not target.exists()  # until the block ends
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new"


def test_a_fixed_temporary_name_is_used_as_given(tmp_path):
    target, partial = tmp_path / "m.gguf", tmp_path / "m.gguf.partial"
    partial.write_bytes(b"left by a killed fetch")
    with replacing(target, temporary=partial) as tmp:
        assert tmp == partial
        tmp.write_bytes(b"fetched")
    assert target.read_bytes() == b"fetched" and not partial.exists()


def _renames(tree: ast.AST) -> list[int]:
    """Lines calling ``os.replace`` / ``os.rename``: a hand-made tmp-then-rename write."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("replace", "rename")
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "os"
    ]


def test_only_gguf_files_renames_a_temporary_file_into_place():
    """Regression: seven modules each wrote a sibling and ``os.replace``d it, with their own cleanup."""
    root = Path(__file__).resolve().parents[1]
    offenders = [
        f"{path.relative_to(root)}:{line}"
        for package in ("gguf", "launcher", "studio")
        for path in sorted((root / package).rglob("*.py"))
        if path != root / "gguf" / "files.py"
        for line in _renames(ast.parse(path.read_text()))
    ]
    assert offenders == []
    assert _renames(ast.parse("import os\nos.replace(tmp, path)\n")) == [2]
