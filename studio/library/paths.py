"""Which model files an API client may name by path: the library's, not any file on the disk.

A client of the HTTP API names a model by name (the catalog answers) or by path.
A path is served only when the file really lies (symlinks and ``..`` resolved)
under a model folder, the Hugging Face cache or the studio home, is a file the
catalog lists (a link the user put in a model folder), or is one the user named
on the command line; ``allow_any_path = true`` in the config lifts the rule. The
CLI's own commands on this machine (``run``, ``serve --model``, ``plan``) load
through the manager, not the API, and take any path.

The same goes for the llama-server flags a load request may add (``extra_args``):
an API client may pass only those ``launcher.client_flags`` classifies as safe
(sampling, batching, threads, template and reasoning settings...); any other, one
a newer llama-server adds included, is the config file's to give.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from launcher.client_flags import client_flag_refused
from studio.errors import PathNotAllowedError
from studio.library.catalog import Catalog


@dataclass(frozen=True)
class PathPolicy:
    """The folders (and single files) an API client may load models from; ``allow_any`` lifts the rule."""

    roots: tuple[Path, ...]
    files: tuple[Path, ...] = ()
    allow_any: bool = False

    @classmethod
    def for_catalog(
        cls, catalog: Catalog, *, home: Path | None = None, files: Iterable[Path] = (), allow_any: bool = False
    ) -> PathPolicy:
        """The policy for ``catalog``: its model folders and Hugging Face cache, and the studio ``home``."""
        roots = [*catalog.folders, *([catalog.hf_cache] if catalog.hf_cache else []), *([home] if home else [])]
        return cls(roots=tuple(roots), files=tuple(files), allow_any=allow_any)

    def check(self, model: str | None, catalog: Catalog) -> None:
        """Return if an API client may load ``model`` (a name, or a path under the policy's folders).

        A ``model`` that is no existing file is left to the catalog, which knows it by
        name or answers 404; only a file outside the allowed places is refused.

        Raises:
            PathNotAllowedError: ``model`` is a file outside the model folders, the cache and the home.
        """
        if self.allow_any or not model:
            return
        try:
            path = Path(model).expanduser()
            if not path.is_file():
                return
            real = path.resolve(strict=True)
        except (OSError, RuntimeError, ValueError):  # too long, a link loop, a NUL byte: not a file to load
            return
        if any(real.is_relative_to(_real(root)) for root in self.roots) or real in {_real(f) for f in self.files}:
            return
        if any(entry.name == model or _real(entry.path) == real for entry in catalog.entries()):
            return  # a name the catalog knows first, or a file it lists (a link in a model folder)
        shown = model if str(real) == str(path.absolute()) else f"{model} (really {real})"
        raise PathNotAllowedError(
            f"the model file {shown} is outside the places API clients may load from (the model folders, the "
            "Hugging Face cache and the studio home); to allow it, add its folder to `model_dirs` in the studio's "
            "config file (or GGUF_STUDIO_MODEL_DIRS), or set `allow_any_path = true` there; `ggstudio run` and "
            "`ggstudio serve --model` on this machine take any path",
            path=str(real),
        )

    def check_extra_args(
        self, args: Sequence[str] | None, aliases_of: Callable[[str], Iterable[str]] = lambda flag: (flag,)
    ) -> None:
        """Return if an API client may add ``args`` to llama-server's command line.

        Only the flags of ``launcher.client_flags.CLIENT_FLAGS`` are let through, under any
        spelling: ``--a_b`` as ``--a-b``, ``--a=v`` as ``--a``, and every alias the binary
        declares for one (``aliases_of``: ``Capabilities.aliases_of``).

        Raises:
            PathNotAllowedError: a flag off that list, naming it and how to allow it.
        """
        if self.allow_any or not args:
            return
        token = client_flag_refused(args, aliases_of)
        if token is not None:
            raise PathNotAllowedError(
                f"extra_args: {token} is not among the llama-server flags API clients may pass (sampling, "
                "batching, threads, template and reasoning settings; docs/security.md lists them); put it in the "
                "model's extra_args in the studio's config file ([models.NAME]), or set `allow_any_path = true` "
                "there",
                path=token,
                param="extra_args",
                code="flag_not_allowed",
            )


def _real(path: Path) -> Path:
    try:
        return path.expanduser().resolve()
    except (OSError, RuntimeError):
        return path
