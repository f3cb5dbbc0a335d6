"""Hub search with a fit per variant: ``GET /api/hub/search`` and ``GET /api/hub/fit``.

- ``GET /api/hub/search?q=gemma&page=0&per_page=5&ctx=8192``: GGUF repos of the Hub, each with its
  variants (quant, size, shards, projector) and, unless ``fit=false``, each variant's fit here
  (``studio.views.fit``), and the variant the studio recommends first.
- ``GET /api/hub/fit?model=owner/repo:VARIANT&ctx=8192``: one variant's fit.

A fit reads only the variant's headers (kept in the studio home, ``studio.library.hub_headers``)
and plans them with the model manager's own ``preview``: this machine's devices, the memory budget
and the resident models it would evict. ``POST /api/plan`` takes the same ``owner/repo:VARIANT``
before it is downloaded (``remote_plan``). No weights are downloaded by any of them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request

from studio.blocking import run_blocking
from studio.errors import HubUnreachableError, ModelNotFoundError, StudioError
from studio.library import hub
from studio.library.downloads import is_repo_spec
from studio.library.hub_search import (
    RepoVariants,
    Variant,
    VariantHeaders,
    find_variant,
    repo_variants,
    search,
    variant_headers,
)
from studio.load_options import BY_NAME
from studio.residency.manager import ModelManager, Placed
from studio.residency.requests import LoadRequest
from studio.views.fit import fit_json, repo_json

router = APIRouter(prefix="/api/hub")

#: Variants whose headers are read at the same time.
PARALLEL_FITS = 4


def _manager(request: Request) -> ModelManager:
    return request.app.state.manager


def _config(request: Request) -> hub.HubConfig:
    return request.app.state.downloads.config()


def _root(request: Request) -> Path:
    return request.app.state.hub_headers


@router.get("/search")
async def hub_search(
    request: Request,
    q: str = Query("", max_length=200, description="Words to search repo names for."),
    page: int = Query(0, ge=0, le=1000),
    per_page: int = Query(5, ge=1, le=50),
    ctx: int | None = Query(None, ge=BY_NAME["n_ctx"].least, le=BY_NAME["n_ctx"].most),
    fit: bool = Query(True, description="Read each variant's header and plan it here."),
) -> dict[str, Any]:
    """One page of GGUF repos with their variants and, with ``fit``, each variant's fit and the recommendation."""
    cfg = _config(request)
    found = await asyncio.to_thread(search, q, page=page, per_page=per_page, config=cfg)
    gate = asyncio.Semaphore(PARALLEL_FITS)
    repos = await asyncio.gather(*(_repo_json(request, r, ctx, gate if fit else None) for r in found.repos))
    return {"query": found.query, "page": found.page, "per_page": found.per_page, "more": found.more, "repos": repos}


@router.get("/fit")
async def hub_fit(
    request: Request,
    model: str = Query(description="owner/repo:VARIANT"),
    ctx: int | None = Query(None, ge=BY_NAME["n_ctx"].least, le=BY_NAME["n_ctx"].most),
) -> dict[str, Any]:
    """One variant's fit here, from its header alone."""
    repo, variant = await _variant(request, model)
    return {"model": variant.spec(repo.repo), **await _fit(request, repo, variant, ctx)}


async def _repo_json(
    request: Request, repo: RepoVariants, ctx: int | None, gate: asyncio.Semaphore | None
) -> dict[str, Any]:
    if gate is None:
        return repo_json(repo, None)

    async def one(v: Variant) -> dict[str, Any]:
        if not v.complete:
            return {"fits": False, "error": f"{v.shards - len(v.files)} of its {v.shards} shards are not listed"}
        async with gate:
            try:
                return await _fit(request, repo, v, ctx)
            except HubUnreachableError:
                raise
            except (StudioError, ValueError) as exc:  # this variant's header is bad; the others still count
                return {"fits": False, "error": getattr(exc, "message", str(exc))}

    fits = await asyncio.gather(*(one(v) for v in repo.variants))
    return repo_json(repo, {v.key: f for v, f in zip(repo.variants, fits, strict=True)})


async def _variant(request: Request, spec: str) -> tuple[RepoVariants, Variant]:
    name, label = hub.parse_spec(spec)
    repo = await asyncio.to_thread(repo_variants, name, config=_config(request))
    return repo, find_variant(repo, label)


async def _headers(request: Request, repo: RepoVariants, variant: Variant) -> VariantHeaders:
    return await asyncio.to_thread(variant_headers, repo, variant, root=_root(request), config=_config(request))


async def _fit(request: Request, repo: RepoVariants, variant: Variant, ctx: int | None) -> dict[str, Any]:
    headers = await _headers(request, repo, variant)
    placed = await _manager(request).preview(LoadRequest(model=str(headers.path), n_ctx=ctx))
    return _placed_fit(placed, headers)


def _placed_fit(placed: Placed, headers: VariantHeaders) -> dict[str, Any]:
    return fit_json(
        placed.plan,
        fits=placed.fits,
        headers=headers,
        evict=placed.evict,
        blocked_by=placed.blocked_by,
        need=placed.need,
        room=placed.room,
    )


async def is_remote(request: Request, model: str) -> bool:
    """Whether ``model`` is an ``owner/repo:VARIANT`` the library does not hold: its plan is made from its header."""
    if not is_repo_spec(model):
        return False
    manager = _manager(request)
    try:
        await run_blocking(manager.catalog.resolve, model, timeout=manager.work_timeout, what=f"finding {model}")
    except ModelNotFoundError:
        return True
    return False


async def remote_plan(request: Request, load: LoadRequest) -> tuple[Placed, dict[str, Any]]:
    """The preview of an ``owner/repo:VARIANT`` not downloaded, planned on its kept headers, and what they cost."""
    repo, variant = await _variant(request, load.model)
    headers = await _headers(request, repo, variant)
    placed = await _manager(request).preview(load.replace(model=str(headers.path)))
    return placed, {
        "model": variant.spec(repo.repo),
        "commit": repo.commit,
        "downloaded": False,
        "fit": _placed_fit(placed, headers),
    }
