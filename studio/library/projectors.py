"""One rule for what is a multimodal projector (an ``mmproj`` file), for the library, the catalog and the hub.

A file on disk is a projector when its own header says so (``general.architecture
== "clip"``, ``gguf.projector``); a file whose header cannot be read, and a file
the Hub lists (no header to read before downloading it), is one when its name
contains ``mmproj`` (``mmproj-F16.gguf``, ``gemma-3-4b-mmproj-f16.gguf``). The
header wins over the name both ways: a model named ``...mmproj...`` is still a
model, a projector named ``vision-adapter.gguf`` is still a projector.

``projector_problem`` is the width check: a projector feeds a model only when it
projects to the model's embedding length.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import gguf
from gguf.projector import ProjectorFacts, is_projector, projector_facts, width_mismatch
from studio.errors import BadRequestError

NAME_MARK = "mmproj"


def named_like_projector(name: str) -> bool:
    """Return whether a file name (or repo path) marks a projector: ``mmproj`` anywhere in the file's name."""
    return NAME_MARK in PurePosixPath(name).name.lower()


def is_projector_file(path: Path) -> bool:
    """Return whether the GGUF at ``path`` is a projector: by its header when readable, else by its name."""
    try:
        return is_projector(gguf.read(path).metadata)
    except gguf.GGUFError:
        return named_like_projector(path.name)


def read_projector(path: Path) -> ProjectorFacts | None:
    """Return the facts of the projector at ``path``, or None when the file is not one.

    Raises:
        GGUFError: the file is missing or malformed.
    """
    return projector_facts(gguf.read(path))


def projector_problem(model_path: Path, projector_path: Path) -> str | None:
    """Return why the projector cannot be used with the model (not a projector, another width...), or None."""
    try:
        facts = read_projector(projector_path)
        model = gguf.read(model_path)
    except gguf.GGUFError as exc:
        return str(exc)
    if facts is None:
        arch = gguf.read(projector_path).metadata.get("general.architecture")
        return f"it is a {arch!r} model, not a clip projector"
    return width_mismatch(facts, model)


#: What a load request or the config file says for "no projector".
NO_PROJECTOR = "none"


def chosen_projector(requested: str | None, paired: Path | None) -> Path | None:
    """Return the projector a load uses: ``requested`` (a path, or ``"none"``), else the one the library paired.

    Raises:
        BadRequestError: ``requested`` names no file.
    """
    if requested is None:
        return paired
    if requested.strip().lower() in (NO_PROJECTOR, ""):
        return None
    path = Path(requested).expanduser()
    if not path.is_file():
        raise BadRequestError(
            f"mmproj {requested!r} is not a file; give the path of a projector .gguf, or "
            f"{NO_PROJECTOR!r} to load without one",
            param="mmproj",
            code="mmproj_not_found",
        )
    return path.resolve()
