"""Which model file a name means: the catalog, and a Hub download when a name is an uncached repo variant.

Every name that reaches one file (a link under another name, an alias, a path) resolves to its
model's entry, so that its instances go by the model's name; catalog reads run off the event loop
with a time limit (``studio.blocking``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from studio.blocking import run_blocking
from studio.errors import ModelNotFoundError, StudioError
from studio.library.catalog import Catalog, CatalogEntry
from studio.library.downloads import DownloadManager, is_repo_spec
from studio.residency.requests import EMBEDDINGS_SUFFIX, base_name, embedding_name


@dataclass
class Lookup:
    """Finds the catalog entry a request's name means."""

    catalog: Catalog
    downloads: DownloadManager | None  # fetches an uncached owner/repo:VARIANT when its auto_download is on
    work_timeout: float

    async def entry(self, model: str) -> CatalogEntry:
        """The catalog entry of ``model``; an uncached ``owner/repo:VARIANT`` is downloaded first when allowed.

        Another name of a model (a link to its file, an alias) gives the model's own entry: its instances go
        by the model's name. An embedding instance's name gives its model's entry under the instance's name.
        """
        if model.endswith(EMBEDDINGS_SUFFIX):
            entry = await self.entry(base_name(model))
            return replace(entry, name=embedding_name(entry.name))
        try:
            entry = await self._resolve(model)
            return replace(entry, name=entry.model, alias_of=None)
        except ModelNotFoundError:
            if self.downloads is None or not is_repo_spec(model):
                raise
        path = await self.downloads.ensure_available(model)  # a 404 saying how to pull, when not allowed
        return replace(await self._resolve(str(path)), name=model)

    async def model_name(self, model: str) -> str:
        """The name ``model``'s model goes by in the catalog (``model`` may name another link to its file, an
        alias, a path), or ``model`` itself when the catalog does not know it (any more)."""
        try:
            entry = await self._resolve(base_name(model))
        except StudioError:
            return model
        return embedding_name(entry.model) if model.endswith(EMBEDDINGS_SUFFIX) else entry.model

    async def smaller_variant(self, model: str, largest: int) -> str | None:
        """For a Hub model, the largest variant of its repo whose weights are at most ``largest`` bytes."""
        if self.downloads is None or not is_repo_spec(model):
            return None

        def fits(size: int, label: str) -> bool:
            return size <= largest

        try:
            return await run_blocking(
                self.downloads.suggest_variant,
                model,
                fits,
                timeout=self.work_timeout,
                what=f"listing the variants of {model}",
            )
        except (StudioError, OSError):  # offline, or the Hub is unreachable: the advice just goes without it
            return None

    async def _resolve(self, model: str) -> CatalogEntry:
        return await run_blocking(self.catalog.resolve, model, timeout=self.work_timeout, what=f"finding {model}")
