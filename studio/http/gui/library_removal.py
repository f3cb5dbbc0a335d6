"""A model removed from the library by an API client: the studio page's ``DELETE /api/models/{name}`` and
Ollama's ``DELETE /api/delete`` alike.

What goes is what ``ggstudio rm`` takes (``studio.library.removal``: the model's shards, a projector no
other model pairs with, its Hugging Face cache entry through huggingface_hub's API); here it is also
checked against what the studio holds, so a model in use is never deleted under its llama-server.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog

from studio.errors import ModelNotResidentError, ModelResidentError
from studio.library.removal import find_entry, plan_removal, remove
from studio.residency.manager import ModelManager

log = structlog.get_logger("studio.library")


async def remove_from_library(
    manager: ModelManager, name: str, *, force: bool, dry_run: bool = False, instead: str = "or remove it with force"
) -> dict[str, Any]:
    """Remove the library model ``name`` (a name or the path of one of its files); what was removed, or with
    ``dry_run`` what would be. ``instead`` ends the refusal of a resident model: what the client can do.

    Raises:
        ModelResidentError: the model is resident or loading (409) and ``force`` is not given; with it, it is
            unloaded first.
        ModelNotFoundError: no library model has that name (404).
        PathNotAllowedError: a path that is not a library model's file (403).
    """
    catalog = manager.catalog
    entry, library = await asyncio.to_thread(find_entry, name, catalog.folders, catalog.hf_cache)
    removal = await asyncio.to_thread(plan_removal, entry, library)
    if dry_run:
        return {**removal.to_json(), "removed": False}
    files = {p.resolve() for p in removal.files}
    using = [r.name for r in manager.residents if r.settings.path.resolve() in files]
    using += [load.entry.name for load in manager.loads if load.entry.path.resolve() in files]
    if using and not force:
        raise ModelResidentError(
            f"{entry.name} is resident ({', '.join(sorted(set(using)))}): unload it first, {instead}",
            param="model",
        )
    for resident in sorted(set(using)):
        with contextlib.suppress(ModelNotResidentError):  # gone meanwhile: that is what was wanted
            await manager.unload(resident)
    await asyncio.to_thread(remove, removal, catalog.hf_cache)
    log.info("model_removed", model=entry.name, source=removal.source, files=len(removal.files), size=removal.size)
    return {**removal.to_json(), "removed": True}
