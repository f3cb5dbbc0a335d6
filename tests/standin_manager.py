"""A stand-in for ``studio.residency.manager.ModelManager`` whose one model is the replay upstream.

The proxy and ``/api/chat`` reach llama-server only through ``await manager.acquire(model)`` (or
``acquire_now``, for a streamed request),
the ``LoadedModel`` it returns (``.name``, ``.url``, ``.auth_headers``, ``.n_ctx``,
``.template``, ``.plan.rpc_workers``, and ``.plan.model.projector`` / ``.path`` for the media
checks, ``.settings`` for the chat history) and its ``Lease`` (awaited to release; ``.interruption``
when the model went away), once
the path rule and the media preflight have asked ``find``, ``work_timeout``, ``catalog`` and
``model_defaults``, and ``/metrics`` has subscribed to ``listeners``; this gives them a model with
those attributes that lives at ``tests.replay_upstream.ReplayUpstream``'s URL, so the real proxy code runs against
recorded answers without a model load. It imitates a manager with one model resident
that is never unloaded under a request, and counts requests in flight as the real one does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf.templates import TemplateCapabilities
from studio.errors import ModelNotFoundError
from studio.load_options import OptionValues
from studio.residency.requests import LoadSettings


@dataclass(frozen=True)
class _TextOnly:
    """A plan's model without a projector, whose file is nowhere (so no TTS vocabulary to find)."""

    projector: None = None
    path: Path = Path("/nonexistent/stand-in.gguf")


@dataclass(frozen=True)
class _NoWorkers:
    rpc_workers: tuple[str, ...] = ()
    model: _TextOnly = field(default_factory=_TextOnly)


@dataclass(frozen=True)
class _OwnTemplate:
    """A model's facts as the request path reads them: a chat template of its own (no borrowed turn markers)."""

    chat_template: str | None = "{{ messages }}"
    sampling: tuple[tuple[str, float], ...] = ()


class _NoBudget:
    memory_budget = None


@dataclass(frozen=True)
class StandInModel:
    """The attributes of ``LoadedModel`` the request path reads."""

    name: str
    url: str
    n_ctx: int = 4096
    template: TemplateCapabilities | None = None
    auth_headers: dict[str, str] = field(default_factory=dict)
    plan: _NoWorkers = field(default_factory=_NoWorkers)
    settings: LoadSettings = LoadSettings(_TextOnly.path, OptionValues(n_ctx=4096, n_parallel=1))
    facts: _OwnTemplate = field(default_factory=_OwnTemplate)


class StandInLease:
    """A ``Lease``: awaiting it releases the request once; the model never goes away under it."""

    interruption = None

    def __init__(self, manager: StandInManager) -> None:
        self._manager = manager
        self._released = False

    async def __call__(self) -> None:
        if not self._released:
            self._released = True
            self._manager.in_flight -= 1

    async def died(self, within: float) -> str | None:
        """Its stand-in llama-server never dies: a failure is always another."""
        return None


class StandInManager:
    """``acquire`` returns the one model; ``in_flight`` shows requests not yet released, ``acquired`` how many
    requests asked for it (each would be a load for a model not resident)."""

    work_timeout = 30.0  # seconds the HTTP layer gives a path check, as the real manager's
    # what ``/api/status`` reads: no resident model (the replay one is not one), nothing waiting, no budget
    default = None
    resolving = None
    waiting = 0
    residency = _NoBudget()

    def __init__(self, model: Any) -> None:
        self.model = model
        self.in_flight = 0
        self.acquired = 0
        self.catalog = _NoCatalog()
        self.model_defaults: dict[str, Any] = {}
        self.downloads = None
        self.build = {"backend": None, "path": None, "why": "a stand-in: no llama-server runs", "install": None}
        self.listeners: list[Any] = []  # /metrics' subscription to loads and evictions (this one has none)
        self.admission_listeners: list[Any] = []  # /metrics' subscription to admissions (this one has none)

    async def warm(self, loaded: Any, body: Any) -> None:
        """Restores no saved slot: the replay upstream keeps none."""

    def start_preload(self, requests: Any) -> None:
        """Its one model is ready from the start: nothing to preload."""

    def find(self, model: str) -> Any:
        """The resident model ``model`` names: the one model, by its name."""
        return self.model if model == self.model.name else None

    @property
    def loaded(self) -> Any:
        return self.model

    @property
    def residents(self) -> list[Any]:
        return []

    def acquire_now(self, model: str | None, *, embeddings: bool = False) -> tuple[Any, StandInLease]:
        """The one model is always ready, for chat and embeddings alike: no request waits for a load."""
        self.in_flight += 1
        self.acquired += 1
        return self.model, StandInLease(self)

    async def acquire(
        self, model: str | None, *, embeddings: bool = False, waits: Any = None
    ) -> tuple[Any, StandInLease]:
        """As ``acquire_now``: a request never waits, so ``waits`` is never asked (as on the real ready path)."""
        return self.acquire_now(model, embeddings=embeddings)

    def status(self) -> dict[str, Any]:
        return {"state": "ready", "model": self.model.name}

    async def aclose(self) -> None:
        pass


class _NoCatalog:
    folders: list[Any] = []  # no model folders and no Hugging Face cache: the path rule refuses every file
    hf_cache = None

    def entries(self) -> list[Any]:
        return []

    def resolve(self, name: str) -> Any:
        raise ModelNotFoundError(f"model {name!r} not found", param="model", code="model_not_found")
