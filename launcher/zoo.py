"""The tiny-architecture zoo: one random-weight GGUF per architecture the pinned
llama.cpp can save, written by its ``test-llama-archs -o DIR`` tool.

The zoo checks the GGUF reader's facts and the memory estimator across every
layout (MLA, SWA, hybrid/recurrent, MoE, plain GQA). It is generated once per
pin into the studio home; a marker written last makes later calls free.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from launcher.build import BuildResult
from launcher.errors import BuildError

MARKER = ".zoo-complete"


def ensure_zoo(build: BuildResult, home: Path) -> Path:
    """Return the zoo folder for ``build``'s pin, generating it on first use."""
    out = home / "zoo" / build.layout.tag
    if (out / MARKER).is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [str(build.test_llama_archs), "-o", str(out)], capture_output=True, text=True, timeout=900
    )
    models = sorted(out.glob("*.gguf"))
    if proc.returncode != 0 or not models:
        raise BuildError(
            f"test-llama-archs could not write the architecture zoo to {out} (exit {proc.returncode})",
            log_tail="\n".join((proc.stdout + proc.stderr).splitlines()[-20:]),
        )
    (out / MARKER).write_text("\n".join(m.name for m in models) + "\n")
    return out
