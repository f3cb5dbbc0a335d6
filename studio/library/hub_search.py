"""Hub search for GGUF repos and their variants, and the headers a fit needs: nothing of the weights.

``search`` asks huggingface_hub's ``list_models`` (the ``gguf`` filter, the query, most downloaded
first) for one page of repos, then lists each repo's files with their sizes (``hub.list_files``) and
groups them into variants as a pull would (``hub.candidates``: quant label, shards, the projector
a load would take). ``list_models`` has no time limit of its own and retries a refused connection
for tens of seconds, so a first ``HEAD`` with the timeout tells an unreachable Hub at once, and the
search itself runs in a worker thread that is given ``config.timeout``: past it, the search is a
``HubUnreachableError`` (the thread finishes on its own, its answer unused).

``variant_headers`` keeps the headers of a variant's files (every shard: the first holds the
metadata, each holds its tensors' infos) and of its projector (``hub_headers``), and returns the
kept first shard, which the planner reads as the downloaded file.

``recommend`` picks, among the variants that fit, the largest; below ``QUALITY_FLOOR_BITS`` bits
per weight it says quality suffers.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from studio.errors import HubUnreachableError
from studio.library import hub
from studio.library.hub_headers import HeaderRead, fetch_header

T = TypeVar("T")

#: Below this many bits per weight (the number in Q3_K_M, IQ2_XS) a quant loses noticeably in quality.
QUALITY_FLOOR_BITS = 4
_BITS = re.compile(r"^(?:UD-)?(?:I?Q|TQ)(\d)", re.IGNORECASE)
_FLOAT_BITS = {"BF16": 16, "FP16": 16, "F16": 16, "FP32": 32, "F32": 32, "MXFP4": 4, "MXFP4_MOE": 4}


@dataclass(frozen=True)
class Variant:
    """One loadable variant of a repo: its quant label, files (shards in order) and total size."""

    label: str
    key: str  # the path without .gguf and the shard suffix: unique in the repo
    files: tuple[hub.HubFile, ...]
    size: int
    shards: int
    complete: bool  # every shard is listed

    def spec(self, repo: str) -> str:
        """What ``/api/pull`` and ``/api/plan`` take for it."""
        return f"{repo}:{self.label}"


@dataclass(frozen=True)
class RepoVariants:
    """A repo at one commit: its variants (smallest first) and the projector a load would take."""

    repo: str
    commit: str
    variants: tuple[Variant, ...]
    mmproj: hub.HubFile | None
    downloads: int | None = None
    likes: int | None = None


@dataclass(frozen=True)
class SearchPage:
    """One page of a search."""

    query: str
    page: int  # 0-based
    per_page: int
    repos: tuple[RepoVariants, ...]
    more: bool  # another page may follow


@dataclass(frozen=True)
class VariantHeaders:
    """A variant's headers kept locally: the first shard to plan on, and what reading them cost."""

    path: Path  # the kept first shard (its shards and projector beside it)
    reads: tuple[HeaderRead, ...]  # one per file: the shards, then the projector

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.reads)

    @property
    def header_bytes(self) -> int:
        return sum(r.header_bytes for r in self.reads)

    @property
    def cached(self) -> bool:
        return all(r.cached for r in self.reads)


def variants_of(repo: str, commit: str, files: list[hub.HubFile]) -> RepoVariants:
    """Return ``files`` grouped into variants as a pull groups them, with the projector."""
    cands = hub.candidates(files)
    variants = tuple(Variant(c.label, c.key, c.files, c.size, len(c.files) + len(c.missing), c.complete) for c in cands)
    return RepoVariants(repo, commit, variants, hub.pick_mmproj(files))


def repo_variants(repo: str, *, revision: str = "main", config: hub.HubConfig | None = None) -> RepoVariants:
    """Return the variants of ``repo`` as the Hub lists them now.

    Raises:
        HubUnreachableError, ModelNotFoundError, HubAuthError, HubError: as ``hub.list_files``.
    """
    commit, files = hub.list_files(repo, revision, config)
    return variants_of(repo, commit, files)


def search(query: str, *, page: int = 0, per_page: int = 10, config: hub.HubConfig | None = None) -> SearchPage:
    """Return one page of GGUF repos matching ``query``, most downloaded first, each with its variants.

    Raises:
        HubUnreachableError: the Hub did not answer within ``config.timeout``.
        HubAuthError, HubError: the Hub refused the search or a listing.
    """
    cfg = config or hub.HubConfig.from_env()
    if cfg.offline:
        raise HubUnreachableError("the Hub is not searched in offline mode (HF_HUB_OFFLINE); unset it to search")
    _reachable(cfg)
    found = _within(cfg, lambda: _list_models(query, (page + 1) * per_page + 1, cfg), "searching the Hub")
    window = found[page * per_page : (page + 1) * per_page]
    repos = []
    for item in window:
        variants = repo_variants(item["id"], config=cfg)
        repos.append(
            RepoVariants(
                variants.repo, variants.commit, variants.variants, variants.mmproj, item["downloads"], item["likes"]
            )
        )
    return SearchPage(query, page, per_page, tuple(repos), len(found) > (page + 1) * per_page)


def _list_models(query: str, limit: int, cfg: hub.HubConfig) -> list[dict[str, Any]]:
    from huggingface_hub import HfApi

    with hub._hub_errors(query, cfg):
        models = HfApi(endpoint=cfg.endpoint, token=cfg.token).list_models(
            search=query or None, filter="gguf", sort="downloads", limit=limit
        )
        return [{"id": m.id, "downloads": m.downloads, "likes": m.likes} for m in models]


def _reachable(cfg: hub.HubConfig) -> None:
    """Return if the Hub answers at all within the timeout: ``list_models`` would retry a refused connection
    five times over 23 s, logging each retry, before it failed."""
    import httpx

    try:
        httpx.head(f"{cfg.endpoint}/api/models", timeout=cfg.timeout)
    except (httpx.ConnectError, httpx.TimeoutException) as exc:
        raise HubUnreachableError(
            f"the Hub at {cfg.endpoint} cannot be reached within {cfg.timeout:g} s ({type(exc).__name__}); "
            "check the network or HF_ENDPOINT"
        ) from exc
    except httpx.HTTPError:  # it answered something: list_models reports what
        pass


def _within(cfg: hub.HubConfig, work: Callable[[], T], what: str) -> T:
    """``work()``'s answer if it comes within ``cfg.timeout`` seconds; else a ``HubUnreachableError``."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as exc:  # handed to the waiting caller
            future.set_exception(exc)

    threading.Thread(target=run, name="hub-search", daemon=True).start()
    try:
        return future.result(timeout=cfg.timeout)
    except TimeoutError:
        raise HubUnreachableError(
            f"the Hub at {cfg.endpoint} did not answer within {cfg.timeout:g} s while {what}; "
            "check the network or HF_ENDPOINT"
        ) from None
    except hub._network_errors() as exc:
        raise HubUnreachableError(
            f"the Hub at {cfg.endpoint} cannot be reached ({type(exc).__name__}) while {what}; "
            "check the network or HF_ENDPOINT"
        ) from exc


def variant_headers(
    repo: RepoVariants, variant: Variant, *, root: Path, config: hub.HubConfig | None = None
) -> VariantHeaders:
    """Return the kept headers of ``variant``'s shards and of the repo's projector, reading what is not kept.

    Raises:
        HubError (and its kinds), ModelNotFoundError: as ``hub_headers.fetch_header``.
        gguf.GGUFError: a file is not a GGUF model.
    """
    if not variant.complete:
        from studio.errors import ModelNotFoundError

        raise ModelNotFoundError(
            f"{repo.repo}: {variant.label} is split in {variant.shards} shards and the repo lists only "
            f"{len(variant.files)}",
            param="model",
            code="missing_shard",
        )
    reads = [
        fetch_header(repo.repo, repo.commit, f, root=root, config=config, shard=i) for i, f in enumerate(variant.files)
    ]
    if repo.mmproj is not None:
        reads.append(fetch_header(repo.repo, repo.commit, repo.mmproj, root=root, config=config))
    return VariantHeaders(reads[0].path, tuple(reads))


def find_variant(repo: RepoVariants, label: str | None) -> Variant:
    """Return the variant a pull of ``repo:label`` takes (``hub.choose``: the default without a label).

    Raises:
        ModelNotFoundError, BadRequestError: as ``hub.choose``.
    """
    cands = [hub.Candidate(v.key, v.label, v.files) for v in repo.variants]
    chosen, _ = hub.choose(cands, label, repo.repo, [f.path for v in repo.variants for f in v.files])
    return next(v for v in repo.variants if v.key == chosen.key)


def quant_bits(label: str) -> int | None:
    """Return the bits per weight a quant label names (``Q4_K_M``: 4, ``BF16``: 16), or None."""
    upper = label.upper()
    if upper in _FLOAT_BITS:
        return _FLOAT_BITS[upper]
    m = _BITS.match(upper)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Recommendation:
    """The variant to take here, and what to know about it."""

    variant: Variant
    note: str


def recommend(variants: Sequence[Variant], fits: Callable[[Variant], bool]) -> Recommendation | None:
    """Return the largest variant that ``fits``, with a note (quality suffers below the floor), or None."""
    fitting = [v for v in variants if v.complete and fits(v)]
    if not fitting:
        return None
    best = max(fitting, key=lambda v: (v.size, v.key))
    bits = quant_bits(best.label)
    if bits is not None and bits < QUALITY_FLOOR_BITS:
        note = (
            f"{best.label} is the largest variant that fits; below {QUALITY_FLOOR_BITS} bits per weight "
            "quality suffers noticeably: free memory or lower the context for a larger one"
        )
    else:
        note = f"{best.label} is the largest variant that fits"
    return Recommendation(best, note)
