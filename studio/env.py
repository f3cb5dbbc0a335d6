"""The one rule for a yes/no environment variable, for the studio's own variables and huggingface_hub's.

``1``, ``true``, ``yes`` and ``on`` in any case (huggingface_hub's own set, so
``HF_HUB_OFFLINE`` means to the studio what it means to the library) say yes;
anything else set says no; an empty variable counts as unset, as every other
setting in ``studio.settings`` does.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["TRUE", "env_flag", "is_true"]

TRUE = frozenset({"1", "true", "yes", "on"})


def is_true(text: str) -> bool:
    """Return whether ``text`` says yes (``TRUE``, any case, around spaces)."""
    return text.strip().lower() in TRUE


def env_flag(env: Mapping[str, str], *names: str) -> bool | None:
    """Return what the first of ``names`` set (non-empty) in ``env`` says, or None when none is."""
    text = next((env[name] for name in names if env.get(name)), None)
    return None if text is None else is_true(text)
