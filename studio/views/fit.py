"""The fit of a Hub variant on this machine, as JSON and as a badge: what the search and the page show.

A badge promises what the plan promises: the planner's bill for this machine's devices, the
memory budget and what is resident now (the models a load would evict are named), computed from
the variant's own header. ``fits`` means a load now, with those evictions, starts at ``n_ctx``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from launcher.planner import LaunchPlan
from launcher.units import format_size
from studio.library.hub_search import RepoVariants, Variant, VariantHeaders, quant_bits, recommend


def fit_json(
    plan: LaunchPlan,
    *,
    fits: bool,
    headers: VariantHeaders,
    evict: Sequence[str] = (),
    blocked_by: Sequence[str] = (),
    need: str = "",
    room: str = "",
) -> dict[str, Any]:
    """The fit of one variant: the verdict, the context, where the layers go, what goes, and why not."""
    devices = [f"{g.backend}{g.index} {g.name}" for g in plan.gpus] or ["CPU"]
    layers = plan.model.facts.block_count
    out: dict[str, Any] = {
        "fits": fits,
        "n_ctx": plan.n_ctx,
        "max_ctx": plan.max_safe_ctx,
        "native_ctx": plan.native_ctx,
        "n_gpu_layers": plan.n_gpu_layers,
        "n_cpu_moe": plan.n_cpu_moe,
        "layers": layers,
        "offload": plan.offload,
        "devices": devices,
        "evicts": list(evict),
        "spec": plan.spec.resolved,
        "memory_bytes": plan.bill.total,
        "reason": None if fits else not_fit_reason(plan, blocked_by=blocked_by, need=need, room=room),
        "header_bytes": headers.header_bytes,
        "bytes_read": headers.bytes_read,
        "cached": headers.cached,
    }
    out["badge"] = badge(out)
    return out


def not_fit_reason(plan: LaunchPlan, *, blocked_by: Sequence[str] = (), need: str = "", room: str = "") -> str:
    """Why a variant does not fit: what it needs against what could be freed, or the device over budget."""
    if need:
        held = f"; held by {', '.join(blocked_by)}" if blocked_by else ""
        return f"needs {need} where {room or 'nothing'} could be freed{held}"
    over = [d for d in plan.devices if not d.fits]
    if over:
        return "; ".join(
            f"needs {format_size(d.bill.total)} on {d.name} where {format_size(d.budget_bytes)} is free" for d in over
        )
    return "does not fit the memory budget"


def badge(fit: dict[str, Any]) -> str:
    """One line: ``fits at 32,768 ctx, 25/25 layers on CUDA0 ...; evicts a, b`` or ``does not fit: ...``."""
    if not fit["fits"]:
        return f"does not fit: {fit['reason']}"
    if fit["devices"] == ["CPU"]:
        where = "on the CPU"
    elif fit["offload"] == "fit":
        where = f"about {fit['n_gpu_layers']}/{fit['layers']} layers on {', '.join(fit['devices'])}"
    else:
        where = f"{min(fit['n_gpu_layers'], fit['layers'])}/{fit['layers']} layers on {', '.join(fit['devices'])}"
        if fit.get("n_cpu_moe"):
            where += f", the experts of {fit['n_cpu_moe']} on the CPU"
    evicts = f"; evicts {', '.join(fit['evicts'])}" if fit["evicts"] else "; evicts nothing"
    return f"fits at {fit['n_ctx']:,} ctx, {where}{evicts}"


def variant_json(repo: RepoVariants, v: Variant) -> dict[str, Any]:
    """One variant as the search lists it; ``size`` counts the projector a load takes with it."""
    return {
        "model": v.spec(repo.repo),
        "label": v.label,
        "key": v.key,
        "size": v.size + (repo.mmproj.size if repo.mmproj else 0),
        "weights_size": v.size,
        "shards": v.shards,
        "complete": v.complete,
        "bits": quant_bits(v.label),
        "projector": repo.mmproj.path if repo.mmproj else None,
    }


def repo_json(repo: RepoVariants, fits: Mapping[str, dict[str, Any]] | None) -> dict[str, Any]:
    """A repo with its variants, each with its fit (by variant key) when ``fits`` is given, the recommended first."""
    variants = [variant_json(repo, v) for v in repo.variants]
    for v in variants:
        if fits is not None and v["key"] in fits:
            v["fit"] = fits[v["key"]]
    best = recommend(repo.variants, lambda v: bool(fits[v.key].get("fits"))) if fits is not None else None
    if best is not None:
        variants.sort(key=lambda v: v["key"] != best.variant.key)
        variants[0]["recommended"] = True
    return {
        "repo": repo.repo,
        "commit": repo.commit,
        "downloads": repo.downloads,
        "likes": repo.likes,
        "mmproj": {"path": repo.mmproj.path, "size": repo.mmproj.size} if repo.mmproj else None,
        "recommended": best.variant.spec(repo.repo) if best else None,
        "recommendation": best.note if best else ("no variant fits here" if fits is not None else None),
        "variants": variants,
    }


def render_search(info: dict[str, Any]) -> str:
    """A search answer as text: per repo, its recommendation, then a line per variant with its badge."""
    if not info["repos"]:
        return f"no GGUF repos match {info['query']!r}"
    lines = []
    for r in info["repos"]:
        lines.append(f"{r['repo']}" + (f"  ({r['downloads']:,} downloads)" if r.get("downloads") else ""))
        if r["recommendation"]:
            lines.append(f"  {r['recommendation']}")
        width = max(len(v["label"]) for v in r["variants"]) if r["variants"] else 0
        for v in r["variants"]:
            fit = v.get("fit")
            shards = f", {v['shards']} shards" if v["shards"] > 1 else ""
            said = "" if fit is None else fit.get("error") or fit["badge"]
            mark = "*" if v.get("recommended") else " "
            lines.append(f" {mark}{v['label'].ljust(width)}  {format_size(v['size']):>9}{shards}  {said}".rstrip())
    if info.get("more"):
        lines.append(f"(more: --page {info['page'] + 1})")
    return "\n".join(lines)
