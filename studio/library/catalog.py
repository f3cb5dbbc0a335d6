"""Which models the studio can serve, by name: GGUF files in the model folders.

A model's name is its file name without ``.gguf`` (and without the
``-00001-of-0000N`` suffix for split models). A request may also name a path
to a ``.gguf`` file directly. Projector files are not models; each entry carries
the projector the library paired with it (``studio.library.scan``: same folder or
Hugging Face snapshot, matching width), or None.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from studio.errors import BadRequestError, ModelNotFoundError
from studio.library.projectors import is_projector_file
from studio.library.scan import Library, model_name, projector_for


@dataclass(frozen=True)
class CatalogEntry:
    """A servable model: its name, the file to load (the first shard if split) and its paired projector."""

    name: str
    path: Path
    mmproj: Path | None = None  # the multimodal projector found beside it, width checked
    alias_of: str | None = None  # an ``[aliases]`` name of the listed model so named (listings fold it in there)


def names_by_model(entries: list[CatalogEntry]) -> dict[str, list[str]]:
    """Every name a client may send for each of ``entries`` that is no alias, sorted: its own and its aliases."""
    found = {e.name: [e.name] for e in entries if e.alias_of is None}
    for e in entries:
        if e.alias_of is not None and e.alias_of in found:
            found[e.alias_of].append(e.name)
    return {name: sorted(names) for name, names in found.items()}


class Catalog:
    """The GGUF files in ``folders`` and, by ``owner/repo:VARIANT``, in the Hugging Face cache.

    Scanned on every call: folders change while the studio runs.
    """

    def __init__(
        self, folders: list[Path], *, hf_cache: Path | None = None, aliases: Mapping[str, str] | None = None
    ) -> None:
        self.folders = folders
        self.hf_cache = hf_cache
        self.aliases = dict(aliases or {})  # extra name -> a model name, path or repo:VARIANT
        # one Library per folder (None: the HF cache), kept for its facts
        self._libraries: dict[Path | None, Library] = {}

    def _library(self, folder: Path | None) -> Library:
        """The library scanning ``folder`` (or the HF cache): kept, so a file's header facts are read once per
        version of it (stat-keyed), not on every scan."""
        found = self._libraries.get(folder)
        if found is None:
            found = self._libraries[folder] = Library([folder]) if folder is not None else Library([], self.hf_cache)
        return found

    def entries(self) -> list[CatalogEntry]:
        """Every servable model, sorted by name; the first folder holding a name wins, then the HF cache.

        A folder's unreadable file stays listed (loading it names the problem); a cache entry with one is left out.
        """
        found: dict[str, CatalogEntry] = {}
        for folder in self.folders:
            for entry in self._library(folder).scan():
                found.setdefault(entry.name, CatalogEntry(entry.name, entry.path, entry.mmproj))
        if self.hf_cache is not None:
            for entry in self._library(None).scan():
                if entry.error is None:
                    found.setdefault(entry.name, CatalogEntry(entry.name, entry.path, entry.mmproj))
        for alias, target in self.aliases.items():
            if target in found:
                named = found[target]
                found.setdefault(alias, CatalogEntry(alias, named.path, named.mmproj, named.alias_of or target))
            elif Path(target).expanduser().is_file():
                found.setdefault(alias, CatalogEntry(alias, Path(target).expanduser().resolve()))
        return sorted(found.values(), key=lambda e: e.name)

    def resolve(self, name_or_path: str) -> CatalogEntry:
        """Return the entry for a model name or a path to a .gguf file.

        Raises:
            ModelNotFoundError: neither a known name nor an existing file.
        """
        for entry in self.entries():
            if entry.name == name_or_path:
                return entry
        path = Path(name_or_path).expanduser()
        if path.is_file():
            if is_projector_file(path):
                raise BadRequestError(
                    f"{name_or_path!r} is a multimodal projector, not a model: load the model it "
                    "belongs to (the library pairs the projector beside it) or pass it as `mmproj`",
                    param="model",
                    code="projector_not_model",
                )
            # paired beside the path as given: a Hugging Face snapshot link resolves into blobs/, projector-less
            return CatalogEntry(model_name(path), path.resolve(), projector_for(path.absolute()))
        if name_or_path in self.aliases:
            raise ModelNotFoundError(
                f"alias {name_or_path!r} points at {self.aliases[name_or_path]!r}, which is not a known model or file",
                param="model",
                code="model_not_found",
            )
        known = ", ".join(e.name for e in self.entries()) or "none"
        raise ModelNotFoundError(
            f"model {name_or_path!r} not found: not a file, and not one of the known models ({known})",
            param="model",
            code="model_not_found",
        )
