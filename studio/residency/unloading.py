"""Unloads and lifetimes: an unload by any name, a TTL, a pin, the shutdown.

An unload cancels the model's load in progress first, then gives its requests in flight a grace;
one model is one thing to unload, its embedding instance included (as in Ollama). The shutdown
cancels the preload before anything else: still running, it would start its next model again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from studio.errors import BadRequestError, ModelNotResidentError
from studio.residency.lookup import Lookup
from studio.residency.requests import EMBEDDINGS_SUFFIX, embedding_name
from studio.residency.resident import ResidentModel
from studio.residency.transaction import Key, Load
from studio.settings import ResidencySettings


class Unloading:
    """Unloads, TTLs, pins and the shutdown; ``ModelManager`` owns the state they change."""

    residency: ResidencySettings
    lookup: Lookup
    _residents: dict[Key, ResidentModel]
    _loads: dict[Key, Load]
    _closing: bool
    _preloading: asyncio.Task[None] | None
    _rebalancing: asyncio.Task[None] | None
    find: Callable[[str], ResidentModel | None]

    async def unload(self, model: str | None = None, *, grace: float | None = None) -> None:
        """Unload ``model`` (every model when None): requests in flight get ``grace`` s, then an error.

        A load of the model in progress (or waiting for memory) is cancelled first: its llama-server is
        stopped, its waiters get an error saying it was unloaded, and nothing of it stays resident.

        Raises:
            ModelNotResidentError: ``model`` is neither resident nor loading.
        """
        grace = self.residency.unload_grace if grace is None else grace
        names = None if model is None else self._instance_names(await self._known_as(model))
        loads = [load for load in self._loads.values() if names is None or any(load.names(n) for n in names)]
        targets = list(self._residents.values()) if names is None else [r for n in names if (r := self.find(n))]
        if model is not None and not loads and not targets:
            self._resident_named(model)  # raises: there is nothing to unload
        await self._cancel(loads, "{} was unloaded while it was loading")
        await asyncio.gather(
            *(r.unload(grace=grace, reason=f"{r.name} was unloaded while this request ran") for r in targets)
        )

    def _instance_names(self, model: str) -> tuple[str, ...]:
        """The instances an unload of ``model`` ends: the one it names and, when it names a model, that model's
        embedding instance too (one model is one thing to unload, as in Ollama); an embedding instance's own
        name names it alone."""
        if model.endswith(EMBEDDINGS_SUFFIX):
            return (model,)
        found = self.find(model)
        return (model, embedding_name(found.name if found is not None else model))

    async def _known_as(self, model: str) -> str:
        """The name ``model``'s instance goes by: ``model`` when a resident or a load goes by it, else its
        model's name in the catalog (``model`` names another link to its file, an alias, a path), else ``model``."""
        if self.find(model) is not None or any(load.names(model) for load in self._loads.values()):
            return model
        return await self.lookup.model_name(model)

    async def _cancel(self, loads: Sequence[Load], why: str) -> None:
        for load in loads:
            load.cancel(why.format(load.entry.name))
        await asyncio.gather(*(load.ended() for load in loads))

    def set_ttl(self, model: str, ttl: float) -> None:
        """Set a resident model's idle TTL in seconds (0: never)."""
        if ttl < 0:
            raise BadRequestError("ttl must be 0 (never) or a number of seconds", param="ttl")
        self._resident_named(model).set_ttl(ttl)

    def set_pinned(self, model: str, pinned: bool) -> None:
        """Pin a resident model (never evicted, no TTL) or unpin it."""
        self._resident_named(model).set_pinned(pinned)

    def _resident_named(self, model: str) -> ResidentModel:
        found = self.find(model)
        if found is None:
            resident = ", ".join(r.name for r in sorted(self._residents.values(), key=lambda r: r.created)) or "none"
            raise ModelNotResidentError(f"{model!r} is not resident (resident: {resident})")
        return found

    async def aclose(self) -> None:
        """Cancel the preload and the loads in progress, then unload every model now (at shutdown no request waits).

        The preload first: still running, it would start its next model again after this stopped the last one.
        """
        if self._preloading is not None:
            self._preloading.cancel()
            await asyncio.gather(self._preloading, return_exceptions=True)
        self._closing = True
        if self._rebalancing is not None:  # a restart with a share of the cores: its new instance is unloaded below
            self._rebalancing.cancel()
            await asyncio.gather(self._rebalancing, return_exceptions=True)
        await self._cancel(list(self._loads.values()), "the studio is shutting down while {} was loading")
        await asyncio.gather(
            *(
                r.unload(grace=0, reason="the studio is shutting down", why="shutdown")
                for r in list(self._residents.values())
            ),
            return_exceptions=True,
        )

    def close_now(self) -> None:
        """Stop every llama-server from any thread, without the event loop (a last resort at exit)."""
        for r in list(self._residents.values()):
            r.supervisor.close()
            r.command.cleanup()
