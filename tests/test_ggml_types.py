"""Our ggml type table against the pinned ggml itself, compiled and asked here."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from gguf.ggml_types import GGML_TYPES

PROGRAM = r"""
#include <stdio.h>
#include "ggml.h"
int main(void) {
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        printf("%d %lld %zu %s\n", t, (long long) ggml_blck_size((enum ggml_type) t),
               ggml_type_size((enum ggml_type) t), ggml_type_name((enum ggml_type) t));
    }
    return 0;
}
"""


def test_type_table_matches_the_pinned_ggml(pinned_build, tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "a C compiler is needed to build llama-server anyway"
    src = tmp_path / "types.c"
    src.write_text(PROGRAM)
    exe = tmp_path / "types"
    lib = pinned_build.layout.cmake_dir / "ggml" / "src" / "libggml-base.a"
    include = pinned_build.layout.source_dir / "ggml" / "include"
    subprocess.run(
        [compiler, str(src), f"-I{include}", str(lib), "-lm", "-lpthread", "-lstdc++", "-fopenmp", "-o", str(exe)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    rows = [
        line.split(maxsplit=3)
        for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()
    ]
    live = {int(t): (name, int(block), int(size)) for t, block, size, name in rows if int(block) > 0}
    ours = {t.id: (t.name.lower(), t.block_size, t.type_size) for t in GGML_TYPES.values()}
    assert {k: (n.lower(), b, s) for k, (n, b, s) in live.items()} == ours


@pytest.mark.parametrize("type_id", [4, 5, 31, 32, 33, 36, 37, 38])
def test_removed_types_are_not_in_the_table(type_id):
    assert type_id not in GGML_TYPES
