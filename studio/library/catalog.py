"""Which models the studio can serve, by name: GGUF files in the model folders.

A model's name is its file name without ``.gguf`` (and without the
``-00001-of-0000N`` suffix for split models). A request may also name a path
to a ``.gguf`` file directly. Projector files are not models; each entry carries
the projector the library paired with it (``studio.library.scan``: same folder or
Hugging Face snapshot, matching width), or None.

One file is one model, however it is reached (``model_identity``: the same device and inode, links
followed, or the same resolved path; and the same paired projector, since another one launches it
otherwise): a symlink under another name in a model folder (how people share one file between LM Studio,
Ollama and the studio), a hard link, a file two folders hold, one blob two Hugging Face cache names point
at, or a path to any of them. The first name found is the model's (``entries``' order, the file's own
name before a link's); every other one is an alias of it, as an ``[aliases]`` name is, and carries its
path, so the residency manager, which keys instances by path, runs one instance of it whatever name asked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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
    alias_of: str | None = None  # another name of the listed model so named: an ``[aliases]`` one, or another
    # link to (or name of) its file; listings fold it in there

    @property
    def model(self) -> str:
        """The name the model is listed and resident under, whichever of its names found this entry."""
        return self.alias_of or self.name

    def named(self, alias: str) -> CatalogEntry:
        """Return this model's entry under another of its names."""
        return CatalogEntry(alias, self.path, self.mmproj, self.model)


#: Which file: its device and inode (links followed), or its resolved path when it cannot be stat'ed.
FileId = tuple[int, int] | str
#: Which model: its file, and its paired projector's (None: none).
ModelId = tuple[FileId, FileId | None]


def file_identity(path: Path) -> FileId:
    """Return which file ``path`` reaches, however named: its device and inode, else its resolved path."""
    try:
        found = path.stat()
    except (OSError, ValueError):  # a dangling link, a NUL byte: the path the name resolves to
        try:
            return str(path.expanduser().resolve())
        except (OSError, RuntimeError):  # a link loop
            return str(path.absolute())
    return found.st_dev, found.st_ino


def model_identity(entry: CatalogEntry) -> ModelId:
    """Return which model ``entry`` is: its file and its projector's (the same weights with another
    projector launch with other flags, and the library pairs each folder's own)."""
    return file_identity(entry.path), file_identity(entry.mmproj) if entry.mmproj is not None else None


def one_per_file(entries: Iterable[CatalogEntry]) -> tuple[dict[str, CatalogEntry], dict[ModelId, CatalogEntry]]:
    """Return ``entries`` by name, each further name of a model an alias of its first one, and the models
    by identity.

    The first: the first entry not reached through a symlink (a hard link or a copy's own name, before a
    link to it), else the first in order. An alias carries its model's path and projector.
    """
    listed = [(entry, model_identity(entry)) for entry in entries]
    first: dict[ModelId, CatalogEntry] = {}
    for entry, ident in sorted(listed, key=lambda pair: pair[0].path.is_symlink()):  # stable: order kept within
        first.setdefault(ident, entry)
    by_name: dict[str, CatalogEntry] = {}
    for entry, ident in listed:
        model = first[ident]
        by_name[entry.name] = entry if model is entry else model.named(entry.name)
    return by_name, first


def model_of(models: Mapping[ModelId, CatalogEntry], entry: CatalogEntry) -> CatalogEntry | None:
    """Return the model ``entry`` (a path's) is: the one with its file and projector, else one with its file."""
    found = models.get(model_identity(entry))
    if found is None:
        file = file_identity(entry.path)
        found = next((model for (other, _), model in models.items() if other == file), None)
    return found


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
        """Every servable model and each further name of one (``alias_of`` set), sorted by name.

        The first folder holding a name wins, then the HF cache; the first name of a file is its model's (the
        module docstring). A folder's unreadable file stays listed (loading it names the problem); a cache
        entry with one is left out.
        """
        return self._entries()[0]

    def _entries(self) -> tuple[list[CatalogEntry], dict[ModelId, CatalogEntry]]:
        """``entries``, and the models by identity (``one_per_file``)."""
        scanned: dict[str, CatalogEntry] = {}
        for folder in self.folders:
            for entry in self._library(folder).scan():
                scanned.setdefault(entry.name, CatalogEntry(entry.name, entry.path, entry.mmproj))
        if self.hf_cache is not None:
            for entry in self._library(None).scan():
                if entry.error is None:
                    scanned.setdefault(entry.name, CatalogEntry(entry.name, entry.path, entry.mmproj))
        found, models = one_per_file(scanned.values())
        for alias, target in self.aliases.items():
            if target in found:
                found.setdefault(alias, found[target].named(alias))
            elif Path(target).expanduser().is_file():
                own = CatalogEntry(alias, Path(target).expanduser().resolve())
                named = model_of(models, own)  # a path to a model the library holds is that model
                found.setdefault(alias, own if named is None else named.named(alias))
        return sorted(found.values(), key=lambda e: e.name), models

    def resolve(self, name_or_path: str) -> CatalogEntry:
        """Return the entry for a model name or a path to a .gguf file.

        A path to a file the library holds (through any link) is that model's entry.

        Raises:
            ModelNotFoundError: neither a known name nor an existing file.
        """
        entries, models = self._entries()
        for entry in entries:
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
            entry = CatalogEntry(model_name(path), path.resolve(), projector_for(path.absolute()))
            return model_of(models, entry) or entry
        if name_or_path in self.aliases:
            raise ModelNotFoundError(
                f"alias {name_or_path!r} points at {self.aliases[name_or_path]!r}, which is not a known model or file",
                param="model",
                code="model_not_found",
            )
        known = ", ".join(e.name for e in entries) or "none"
        raise ModelNotFoundError(
            f"model {name_or_path!r} not found: not a file, and not one of the known models ({known})",
            param="model",
            code="model_not_found",
        )
