"""``/api/status``: every resident model, and the default model's fields at the top for single-model GUIs."""

from __future__ import annotations

from typing import Any

from launcher.build import built_backend
from launcher.memory import MemoryBill
from launcher.sampling import in_force
from studio.chat.media import plan_capabilities
from studio.residency.lifecycle import ResidentState
from studio.residency.manager import ModelManager
from studio.residency.placement import physical
from studio.residency.resident import ResidentModel
from studio.views.plan import measured_json


def status_json(manager: ModelManager) -> dict[str, Any]:
    """The whole studio: ``models`` lists every resident one; the top-level fields describe the default one."""
    residents = manager.residents
    models = [resident_json(r) for r in residents]
    failed = [r for r in residents if r.state is ResidentState.FAILED]
    shown = manager.default or (max(failed, key=lambda r: r.created) if failed else None)
    top = next((m for m, r in zip(models, residents, strict=False) if r is shown), None)
    if top is None:
        resolving = manager.resolving
        top = {**_EMPTY, "state": "resolving" if resolving else "unloaded", "model": resolving}
    budget = manager.residency.memory_budget
    return {
        **top,
        "models": models,
        "waiting": manager.waiting,
        # which llama-server build runs and why (``launcher.backends.running_build``)
        "build": manager.build
        or {"backend": built_backend(manager.binary), "path": str(manager.binary), "why": None, "install": None},
        "memory_budget": None
        if budget is None
        else {
            "total": budget.total,
            "per_device": dict(budget.per_device),
            # the studio's own host memory: off the total (or the CPU's share) before any model is placed
            "reserve": manager.reserve,
        },
    }


def resident_json(r: ResidentModel) -> dict[str, Any]:
    """One resident model: state, contexts, plan, memory predicted and actual per device, requests, lifetime."""
    sup = r.supervisor.status()
    loaded, plan = r.loaded, r.plan
    progress = sup.progress
    actual = sup.allocations if r.state is ResidentState.READY else None
    return {
        "state": r.state.value,
        "model": r.name,
        # "embeddings": the model's embedding instance (``--embeddings``), named "M (embeddings)"; "chat": its own
        "instance": "embeddings" if r.settings.embeddings else "chat",
        "embeddings": r.settings.embeds,  # it answers embeddings requests
        "pooling": plan.pooling,
        "path": str(r.settings.path),
        "mmproj": str(r.settings.mmproj) if r.settings.mmproj else None,
        "native_context": r.facts.context_length,
        "effective_context": loaded.n_ctx if loaded else None,
        "largest_safe_context": plan.max_safe_ctx,
        "speculative": {
            "requested": plan.spec.requested,
            "resolved": plan.spec.resolved,
            "flags": list(plan.spec.argv),
            "reasons": list(plan.spec.reasons),
            "measured": measured_json(plan.spec.measured),
        },
        "cache_type_kv": r.settings.cache_type,
        # what a request that sets none gets, and from where (``launcher.sampling.in_force``)
        "sampling": in_force(r.settings.sampling, r.facts.sampling, loaded.n_ctx if loaded else None),
        "offload": {
            "gpus": [d.name for d in plan.gpus],
            "n_gpu_layers": plan.n_gpu_layers,
            "mode": plan.offload,
            "active_on": sorted(d.device for d in actual.devices if d.weights) if actual else None,
        },
        "reasons": list(plan.reasons),
        "capabilities": {
            "reasoning": bool(r.template and r.template.supports_reasoning),
            "reasoning_style": r.template.reasoning_style if r.template else "none",
            "tools": bool(r.template and r.template.supports_tools),
            # no template from the file, the config or the load: llama-server chats through its fallback (ChatML)
            "fallback_template": template_source(r.settings.chat_template, r.facts.chat_template) == "fallback",
            "has_mtp": r.facts.has_mtp,
            **plan_capabilities(plan).to_json(),
        },
        "progress": {
            "phase": progress.phase,
            "bytes_loaded": progress.bytes_loaded,
            "bytes_total": progress.bytes_total,
            "phases_seen": list(progress.phases_seen),
        }
        if progress
        else None,
        "memory": {
            "predicted": bill_json(plan.bill, physical(plan.bill, plan)),
            "actual": bill_json(actual, physical(actual, plan)) if actual else None,
        },
        "error": r.error if r.state in (ResidentState.FAILED, ResidentState.CRASHED) else None,
        "last_exit": r.last_exit,  # why its llama-server last died (killed by a signal, a crash), kept past restarts
        "rpc_workers": list(plan.rpc_workers),
        "failed_workers": list(sup.failed_workers),
        "pid": sup.pid,
        **r.status(),
    }


def template_source(configured: str | None, own: str | None) -> str:
    """Which chat template a model chats through: ``configured``, its ``own``, or llama-server's ``fallback``."""
    return "configured" if configured is not None else "own" if own is not None else "fallback"


def bill_json(bill: MemoryBill, per_device: dict[str, int]) -> dict[str, Any]:
    """Bytes per device and part, for the GUI; ``by_device`` names the physical devices (``CUDA0``...)."""
    return {
        "devices": {
            d.device: {
                "weights": d.weights,
                "kv": d.kv,
                "recurrent": d.recurrent,
                "compute": d.compute,
                "output": d.output,
                "output_growth": d.output_growth,
                "compute_growth": d.compute_growth,
                "projector": d.projector,
                "prompt_cache": d.prompt_cache,
                "process": d.process,
                "total": d.total,
            }
            for d in bill.devices
        },
        "by_device": per_device,
        "total": bill.total,
        # what llama-server holds once it listens: the figure to set beside the actual total
        "startup_total": bill.startup_total,
        # the share of it llama-server's log prints: the actual bill's total (the log has no process line)
        "logged_total": bill.logged_total,
        "approximate": bill.approximate,
        "reasons": list(bill.reasons),
        "projector": {
            "device": bill.projector.device,
            "weights": bill.projector.weights,
            "compute": bill.projector.compute,
            "total": bill.projector.total,
        }
        if bill.projector
        else None,
    }


_EMPTY: dict[str, Any] = {
    "instance": None,
    "embeddings": None,
    "pooling": None,
    "path": None,
    "mmproj": None,
    "native_context": None,
    "effective_context": None,
    "largest_safe_context": None,
    "speculative": None,
    "cache_type_kv": None,
    "sampling": None,
    "offload": None,
    "reasons": None,
    "capabilities": None,
    "progress": None,
    "memory": None,
    "error": None,
    "last_exit": None,
    "pid": None,
    "in_flight": 0,
}
