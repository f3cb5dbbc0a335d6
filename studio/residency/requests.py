"""What a load asks for, and the settings a model runs with once the config's defaults fill the gaps.

A model may have two instances: its chat instance, and an embedding instance (``--embeddings``) that an
embeddings request starts beside it when the chat one does not embed. The embedding instance is named
``embedding_name(model)`` (``"M (embeddings)"``) wherever it is listed, and any request may name it so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from launcher.memory import CacheType, FlashAttn
from launcher.planner import EMBEDDING_FLAGS, PlanRequest
from launcher.sampling import Sampling
from studio.library.catalog import CatalogEntry
from studio.library.projectors import chosen_projector
from studio.library.scan import model_name
from studio.settings import ModelDefaults

#: What an embedding instance's name adds to its model's.
EMBEDDINGS_SUFFIX = " (embeddings)"


def embedding_name(model: str) -> str:
    """The name of ``model``'s embedding instance."""
    return model if model.endswith(EMBEDDINGS_SUFFIX) else model + EMBEDDINGS_SUFFIX


def base_name(model: str) -> str:
    """The model an instance's name names: ``"M (embeddings)"`` is an instance of ``M``."""
    return model.removesuffix(EMBEDDINGS_SUFFIX)


@dataclass(frozen=True)
class LoadRequest:
    """What to load. ``None`` takes the model's config default; ``extra_args=None`` first reuses the last ones.

    ``ttl`` and ``pinned`` shape the model's lifetime and never restart it; the other fields are server
    settings, and a change of any of them restarts the model once its requests are done.
    """

    model: str
    n_ctx: int | None = None  # None, and none configured: the planner's largest safe context (up to the native one)
    n_parallel: int | None = None  # None, and none configured: the planner's (4 unified on GPUs, 1 on the CPU)
    extra_args: tuple[str, ...] | None = None
    spec: str | None = None  # None, and none configured: "auto"
    spec_n_max: int | None = None  # None, and none configured: the speculative policy's
    cache_type: CacheType | None = None  # None, and none configured: "f16"
    cache_ram: int | None = None  # MiB of prompt cache; None, and none configured: the planner's (0: off)
    chat_template: str | None = None  # a Jinja template, or a llama.cpp built-in's name, replacing the model's own
    threads: int | None = None  # None, and none configured: the planner's share of the cores
    threads_batch: int | None = None  # None, and none configured: the same as threads
    flash_attn: FlashAttn | None = None  # None, and none configured: on when the cache type needs it, else auto
    context_shift: bool | None = None  # None, and none configured: off (a conversation past the context is an error)
    jinja: bool | None = None  # None, and none configured: Jinja unless the template is a built-in's name
    ttl: float | None = None  # seconds idle before unloading; None: the model's configured one, or the global
    pinned: bool | None = None  # None: the model's configured one
    force: bool = False  # load even when the plan says it does not fit
    mmproj: str | None = None  # a projector path; "none": without one; None, and none configured: the paired one
    embeddings: bool = False  # the model's embedding instance, beside its chat one (module docstring)


@dataclass(frozen=True)
class LoadSettings:
    """The settings a model runs with; equal settings mean no restart is needed."""

    path: Path
    n_ctx: int | None
    n_parallel: int | None
    extra_args: tuple[str, ...]
    spec: str = "auto"
    spec_n_max: int | None = None
    cache_type: CacheType = "f16"
    chat_template: str | None = None
    mmproj: Path | None = None  # the multimodal projector to pass, if any
    threads: int | None = None
    threads_batch: int | None = None
    flash_attn: FlashAttn | None = None
    context_shift: bool = False
    jinja: bool | None = None  # False: llama-server's built-in renderer, which refuses tools
    cache_ram: int | None = None
    embeddings: bool = False  # the embedding instance
    sampling: Sampling = Sampling()  # sampling defaults and answer limits, on its command line
    thinking: bool | None = None  # thinking on or off at load (the model's config); None: the planner's default

    @property
    def key(self) -> tuple[Path, bool]:
        """Which instance these settings run: a model file has at most one chat and one embedding instance."""
        return self.path, self.embeddings

    @property
    def embeds(self) -> bool:
        """Whether the instance answers embeddings requests: the embedding one, or one given ``--embeddings``."""
        return self.embeddings or any(a.split("=")[0] in EMBEDDING_FLAGS for a in self.extra_args)

    def plan_request(self, alias: str) -> PlanRequest:
        """What the planner is asked for these settings, serving the model as ``alias``."""
        return PlanRequest(
            n_ctx=self.n_ctx,
            n_parallel=self.n_parallel,
            cache_type_k=self.cache_type,
            cache_type_v=self.cache_type,
            spec=self.spec,
            spec_n_max=self.spec_n_max,
            extra_args=self.extra_args,
            alias=alias,
            chat_template=self.chat_template,
            cache_ram_mib=self.cache_ram,
            threads=self.threads,
            threads_batch=self.threads_batch,
            flash_attn=self.flash_attn,
            context_shift=self.context_shift,
            jinja=self.jinja,
            embeddings=self.embeddings,
            sampling=self.sampling,
            thinking=self.thinking,
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
        return LoadSettings(
            entry.path,
            n_ctx=None,
            n_parallel=None,
            extra_args=(),
            spec="off",
            cache_type=own.cache_type_kv or "f16",
            threads=own.threads,
            threads_batch=own.threads_batch,
            flash_attn=own.flash_attn,
            embeddings=True,
        )
    extra = next(e for e in (request.extra_args, last_extra_args, own.extra_args, ()) if e is not None)
    return LoadSettings(
        entry.path,
        n_ctx=request.n_ctx if request.n_ctx is not None else own.n_ctx,
        n_parallel=request.n_parallel if request.n_parallel is not None else own.n_parallel,
        extra_args=tuple(extra),
        spec=request.spec if request.spec is not None else own.spec or "auto",
        spec_n_max=request.spec_n_max if request.spec_n_max is not None else own.spec_n_max,
        cache_type=request.cache_type if request.cache_type is not None else own.cache_type_kv or "f16",
        chat_template=request.chat_template if request.chat_template is not None else own.chat_template,
        cache_ram=request.cache_ram if request.cache_ram is not None else own.cache_ram,
        mmproj=chosen_projector(request.mmproj if request.mmproj is not None else own.mmproj, entry.mmproj),
        threads=request.threads if request.threads is not None else own.threads,
        threads_batch=request.threads_batch if request.threads_batch is not None else own.threads_batch,
        flash_attn=request.flash_attn if request.flash_attn is not None else own.flash_attn,
        context_shift=bool(request.context_shift if request.context_shift is not None else own.context_shift),
        jinja=request.jinja if request.jinja is not None else own.jinja,
        sampling=sampling_for(entry, defaults, fallback),
        thinking=own.thinking,
    )
