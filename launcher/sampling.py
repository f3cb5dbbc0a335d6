"""The sampling defaults and the answer limit a llama-server starts with.

llama-server takes every request's sampling fields over its own start-up defaults (``--temp``,
``--top-p``, ... ``--n-predict``), and those over the GGUF's ``general.sampling.*`` keys, which it
reads only for what its command line left out (b11434 ``common/common.cpp``, ``user_sampling_config``).
So a model's configured defaults go on its command line, and one launch serves them to every route
and every dialect alike; a request's own values still win. A field left ``None`` is not passed, which
keeps the GGUF's value (or llama-server's default) in force.

``max_tokens`` is never unset: a generation without a limit of its own stops at the studio's default
(``DEFAULT_MAX_TOKENS``), never past the context, so an answer that loops ends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType

#: An answer's token limit when neither the request nor the model's config sets one: long enough that
#: nobody notices it in a chat, short enough that a runaway ends in minutes on a CPU.
DEFAULT_MAX_TOKENS = 4096
#: The wall-clock limit of one generation, in seconds, as the reference backend keeps it (600 s).
DEFAULT_GENERATION_SECONDS = 600.0

#: Each sampling default: the llama-server flag that sets it, its ``general.sampling.*`` key in a GGUF, and
#: llama-server's own default (b11434 ``common/common.h``).
FLAGS: Mapping[str, tuple[str, str, float]] = MappingProxyType(
    {
        "temperature": ("--temp", "temp", 0.8),
        "top_p": ("--top-p", "top_p", 0.95),
        "top_k": ("--top-k", "top_k", 40),
        "min_p": ("--min-p", "min_p", 0.05),
        "repeat_penalty": ("--repeat-penalty", "penalty_repeat", 1.0),
    }
)


@dataclass(frozen=True)
class Sampling:
    """A model's sampling defaults; ``None``: the GGUF's own value, else llama-server's default. Their names,
    bounds and help are the studio's load options (``studio.load_options``)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    max_tokens: int | None = None  # None: DEFAULT_MAX_TOKENS
    #: the wall-clock limit of one generation (llama-server's per-request ``t_max_predict_ms``, which the
    #: studio adds to each generating request); None: DEFAULT_GENERATION_SECONDS; 0: none
    max_seconds: float | None = None

    def over(self, fallback: Sampling) -> Sampling:
        """These values, each one left ``None`` taken from ``fallback``."""
        unset = [f.name for f in fields(self) if getattr(self, f.name) is None]
        return replace(self, **{name: getattr(fallback, name) for name in unset})

    def answer_limit(self, n_ctx: int) -> int:
        """Tokens an answer may take when its request names no limit: the default, never past the context."""
        return min(self.max_tokens or DEFAULT_MAX_TOKENS, n_ctx)

    @property
    def max_predict_ms(self) -> int | None:
        """llama-server's ``t_max_predict_ms`` for a generation; None: no limit."""
        seconds = DEFAULT_GENERATION_SECONDS if self.max_seconds is None else self.max_seconds
        return int(seconds * 1000) if seconds > 0 else None

    def argv(self, n_ctx: int) -> list[str]:
        """llama-server's flags for these defaults, the answer limit always among them."""
        out = ["--n-predict", str(self.answer_limit(n_ctx))]
        for name, (flag, _key, _default) in FLAGS.items():
            value = getattr(self, name)
            if value is not None:
                out += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
        return out

    def as_dict(self) -> dict[str, float | int]:
        """The fields that are set, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def in_force(
    configured: Sampling, from_file: tuple[tuple[str, float], ...], n_ctx: int | None = None
) -> dict[str, dict[str, object]]:
    """Each default a request without its own value gets, with where it comes from: ``config`` (the model's
    table or the studio's), ``model file`` (its ``general.sampling.*`` keys) or ``llama-server``."""
    in_file = dict(from_file)
    out: dict[str, dict[str, object]] = {}
    for name, (_flag, key, default) in FLAGS.items():
        value = getattr(configured, name)
        if value is not None:
            out[name] = {"value": value, "source": "config"}
        elif key in in_file:
            out[name] = {"value": int(in_file[key]) if name == "top_k" else in_file[key], "source": "model file"}
        else:
            out[name] = {"value": default, "source": "llama-server"}
    limit = configured.max_tokens or DEFAULT_MAX_TOKENS
    out["max_tokens"] = {
        "value": min(limit, n_ctx) if n_ctx else limit,
        "source": "config" if configured.max_tokens else "studio",
    }
    out["max_seconds"] = {
        "value": DEFAULT_GENERATION_SECONDS if configured.max_seconds is None else configured.max_seconds,
        "source": "studio" if configured.max_seconds is None else "config",
    }
    return out
