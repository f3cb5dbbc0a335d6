"""A stand-in for ``studio.residency.manager.ModelManager`` whose one model is the replay upstream.

The proxy and ``/api/chat`` reach llama-server only through ``await manager.acquire(model)``
and the ``LoadedModel`` it returns (``.name``, ``.url``, ``.auth_headers``, ``.n_ctx``,
``.template``); this gives them a model with those attributes that lives at
``tests.replay_upstream.ReplayUpstream``'s URL, so the real proxy code runs against
recorded answers without a model load. It imitates a manager with one model loaded
and counts requests in flight as the real one does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gguf.templates import TemplateCapabilities


@dataclass(frozen=True)
class StandInModel:
    """The attributes of ``LoadedModel`` the request path reads."""

    name: str
    url: str
    n_ctx: int = 4096
    template: TemplateCapabilities | None = None
    auth_headers: dict[str, str] = field(default_factory=dict)


class StandInManager:
    """``acquire`` returns the one model; ``in_flight`` shows requests not yet released."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.in_flight = 0
        self.catalog = _NoCatalog()

    @property
    def loaded(self) -> Any:
        return self.model

    async def acquire(self, model: str | None) -> tuple[Any, Callable[[], Awaitable[None]]]:
        self.in_flight += 1
        released = False

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1

        return self.model, release

    def status(self) -> dict[str, Any]:
        return {"state": "ready", "model": self.model.name}

    async def aclose(self) -> None:
        pass


class _NoCatalog:
    def entries(self) -> list[Any]:
        return []
