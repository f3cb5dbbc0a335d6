"""What a load asks for, and the settings a model runs with once the config's defaults fill the gaps.

A model may have two instances: its chat instance, and an embedding instance (``--embeddings``) that an
embeddings request starts beside it when the chat one does not embed. The embedding instance is named
``embedding_name(model)`` (``"M (embeddings)"``) wherever it is listed, and any request may name it so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from launcher.memory import CacheType
from launcher.planner import EMBEDDING_FLAGS, PlanRequest
from launcher.sampling import Sampling
from studio.library.catalog import CatalogEntry
from studio.library.projectors import chosen_projector
from studio.library.scan import model_name
from studio.load_options import BY_NAME, OPTIONS, OptionValues
from studio.settings import ModelDefaults

#: Options that are no server setting: the lifetime ones, the sampling defaults (``LoadSettings.sampling``),
#: the flags and the projector (their own fields, merged their own way).
_NOT_SETTINGS = frozenset({o.name for o in OPTIONS if not o.restart or o.plan == "sampling"} | {"extra_args", "mmproj"})

#: What an embedding instance's name adds to its model's.
EMBEDDINGS_SUFFIX = " (embeddings)"


def embedding_name(model: str) -> str:
    """The name of ``model``'s embedding instance."""
    return model if model.endswith(EMBEDDINGS_SUFFIX) else model + EMBEDDINGS_SUFFIX


def base_name(model: str) -> str:
    """The model an instance's name names: ``"M (embeddings)"`` is an instance of ``M``."""
    return model.removesuffix(EMBEDDINGS_SUFFIX)


class LoadRequest(OptionValues):
    """What to load: a model and the load options asked for (``studio.load_options``); an option left out takes
    the model's config default, and ``extra_args`` left out first reuses the last ones.

    ``ttl`` and ``pinned`` shape the model's lifetime and never restart it; the other options are server
    settings, and a change of any of them restarts the model once its requests are done.
    """

    __slots__ = ("model", "force", "embeddings")
    model: str
    force: bool  # load even when the plan says it does not fit
    embeddings: bool  # the model's embedding instance, beside its chat one (module docstring)

    def __init__(self, model: str, *, force: bool = False, embeddings: bool = False, **options: Any) -> None:
        super().__init__(**options)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "force", force)
        object.__setattr__(self, "embeddings", embeddings)

    @classmethod
    def asking(cls, model: str, options: Mapping[str, Any], *, force: bool = False) -> LoadRequest:
        """A request for ``model`` with ``options`` checked already (an extended table's included)."""
        made = cls.of(options)
        object.__setattr__(made, "model", model)
        object.__setattr__(made, "force", force)
        object.__setattr__(made, "embeddings", False)
        return made

    def replace(self, **changes: Any) -> LoadRequest:
        """This request with ``changes``: its model, force, embeddings or options (None: unset)."""
        own = {k: changes.pop(k, getattr(self, k)) for k in ("model", "force", "embeddings")}
        made = self.asking(own["model"], {**self.values, **changes}, force=own["force"])
        object.__setattr__(made, "embeddings", own["embeddings"])
        return made

    def __eq__(self, other: object) -> bool:
        return super().__eq__(other) and (self.model, self.force, self.embeddings) == (
            other.model,  # type: ignore[attr-defined]
            other.force,  # type: ignore[attr-defined]
            other.embeddings,  # type: ignore[attr-defined]
        )

    def __hash__(self) -> int:
        return hash((super().__hash__(), self.model, self.force, self.embeddings))

    def __repr__(self) -> str:
        return (
            f"LoadRequest(model={self.model!r}, {super().__repr__()}, force={self.force}, embeddings={self.embeddings})"
        )


#: What an unset option means to a load's settings, where the planner's request does not take None.
_UNSET = MappingProxyType({"spec": "auto", "cache_type_kv": "f16", "context_shift": False})


@dataclass(frozen=True)
class LoadSettings:
    """The settings a model runs with; equal settings mean no restart is needed.

    ``options`` are the server's load options as the request and the model's config table set them (the
    lifetime ones, ``ttl``, ``pinned`` and ``tags``, are not settings); each reads as an attribute too.
    """

    path: Path
    options: OptionValues = OptionValues()
    extra_args: tuple[str, ...] = ()
    mmproj: Path | None = None  # the multimodal projector to pass, if any
    embeddings: bool = False  # the embedding instance
    sampling: Sampling = Sampling()  # sampling defaults and answer limits, on its command line

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle: no option
            raise AttributeError(name)
        if name in _UNSET and getattr(self.options, name) is None:
            return _UNSET[name]
        return getattr(self.options, name)

    @property
    def cache_type(self) -> CacheType:
        """The KV cache type of K and V."""
        return self.cache_type_kv

    @property
    def key(self) -> tuple[Path, bool]:
        """Which instance these settings run: a model file has at most one chat and one embedding instance."""
        return self.path, self.embeddings

    @property
    def embeds(self) -> bool:
        """Whether the instance answers embeddings requests: the embedding one, or one given ``--embeddings``."""
        return self.embeddings or any(a.split("=")[0] in EMBEDDING_FLAGS for a in self.extra_args)

    def plan_request(self, alias: str) -> PlanRequest:
        """What the planner is asked for these settings, serving the model as ``alias``: each option that has a
        planner field (``Option.plan``) set, the rest left to the planner."""
        asked: dict[str, Any] = {}
        for name, value in self.options.values.items():
            option = BY_NAME.get(name)
            targets = option.plan if option is not None else None
            for target in (targets,) if isinstance(targets, str) else targets or ():
                if target not in ("sampling", "extra_args"):
                    asked[target] = value
        return PlanRequest(
            **asked,
            extra_args=self.extra_args,
            alias=alias,
            embeddings=self.embeddings,
            sampling=self.sampling,
        )


def model_defaults_for(entry: CatalogEntry, defaults: Mapping[str, ModelDefaults]) -> ModelDefaults:
    """The config table of ``entry``'s model (an embedding instance's too): by its name, then by its file name."""
    return defaults.get(base_name(entry.name)) or defaults.get(model_name(entry.path)) or ModelDefaults()


def sampling_for(entry: CatalogEntry, defaults: Mapping[str, ModelDefaults], fallback: Sampling) -> Sampling:
    """``entry``'s sampling defaults: its config table's, what that leaves out from ``fallback``."""
    return model_defaults_for(entry, defaults).sampling.over(fallback)


def load_settings(
    request: LoadRequest,
    entry: CatalogEntry,
    defaults: Mapping[str, ModelDefaults],
    *,
    last_extra_args: tuple[str, ...] | None = None,
    fallback: Sampling = Sampling(),
) -> LoadSettings:
    """``request``'s settings for ``entry``: what it leaves out comes from the model's config table
    (by name, then by file name), extra flags first from the last load, then the built-in defaults;
    sampling defaults the table leaves out from ``fallback`` (the studio's answer limits).

    An embedding instance takes only what changes where and how fast it runs (cache type, threads, flash
    attention) from the model's table: its context, slots, pooling, speculation and prompt cache are the
    planner's, and the chat instance's flags, template and projector are no part of it.
    """
    own = model_defaults_for(entry, defaults)
    if request.embeddings:
        taken = {o.name: getattr(own, o.name) for o in OPTIONS if o.embedding}
        return LoadSettings(entry.path, OptionValues.of({**taken, "spec": "off"}), embeddings=True)
    settings = {
        name: value
        for name in {**own.values, **request.values}
        if name not in _NOT_SETTINGS and (value := request.values.get(name, own.values.get(name))) is not None
    }
    extra = next(e for e in (request.extra_args, last_extra_args, own.extra_args, ()) if e is not None)
    return LoadSettings(
        entry.path,
        OptionValues.of(settings),
        extra_args=tuple(extra),
        mmproj=chosen_projector(request.mmproj if request.mmproj is not None else own.mmproj, entry.mmproj),
        sampling=sampling_for(entry, defaults, fallback),
    )
