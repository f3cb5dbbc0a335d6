"""Text and JSON views of a launch plan (``ggstudio plan``) and of the machine (``ggstudio doctor``)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from launcher.capabilities import Capabilities
from launcher.command import PLACEHOLDERS
from launcher.devices import Device, Inventory
from launcher.discovery import Discovered
from launcher.planner import LaunchPlan
from launcher.rpc import WorkerReport
from launcher.spec_measurements import SpecMeasurement
from launcher.units import format_size

#: Parts shown per device; "output" is the grown size (logits rows for drafted tokens included), so rows sum.
_PARTS = ("weights", "kv", "recurrent", "compute", "output", "prompt_cache", "process")
#: Capabilities doctor reports by name: what the launcher relies on.
DOCTOR_FLAGS = (
    "--fit",
    "--fit-target",
    "--fit-ctx",
    "--list-devices",
    "--no-context-shift",
    "--chat-template-kwargs",
    "--chat-template-file",
    "--jinja",
    "--mmproj",
    "--api-key",
    "--api-key-file",
    "--spec-default",
    "-lv",
    "--metrics",
    "--slots",
    "--kv-unified",
    "--swa-full",
    "--parallel",
    "--flash-attn",
    "--alias",
    "--rpc",
)


def device_json(d: Device) -> dict[str, Any]:
    out = {
        "backend": d.backend,
        "index": d.index,
        "name": d.name,
        "uuid": d.uuid,
        "source": d.source,
        "total_bytes": d.total_bytes,
        "free_bytes": d.free_bytes,
    }
    if d.endpoint is not None:
        out.update(endpoint=d.endpoint, worker_index=d.worker_index, buffer_name=d.rpc_buffer_name)
    return out


def worker_json(r: WorkerReport) -> dict[str, Any]:
    """One RPC worker: its devices, or why it was left out."""
    return {
        "endpoint": r.endpoint,
        "answered": r.problem is None and r.stale_since is None,
        "busy": r.busy,
        "stale_since": r.stale_since,
        "problem": r.problem,
        "devices": [
            {"index": d.index, "buffer_name": d.buffer_name, "free_bytes": d.free_bytes, "total_bytes": d.total_bytes}
            for d in r.devices
        ],
    }


def measured_json(measured: SpecMeasurement | None) -> dict[str, Any] | None:
    """What ``bench-spec`` measured and ``auto`` followed: the winner, its speed-up, every mode's tokens/s."""
    if measured is None:
        return None
    return {
        "summary": measured.summary(),
        "winner": measured.winner.label,
        "speedup": measured.speedup,
        "measured_at": measured.measured_at,
        "tokens_per_s": {r.label: round(r.tokens_per_s, 2) for r in measured.results},
    }


def plan_json(plan: LaunchPlan, argv: Sequence[str] = (), binary: Discovered | None = None) -> dict[str, Any]:
    """The plan as plain JSON-able values; ``argv`` is the command as shown (``LaunchCommand.shown_argv``), if built."""
    f = plan.model.facts
    return {
        "model": {
            "path": str(plan.model.path),
            "architecture": f.architecture,
            "parameters": f.parameter_count,
            "quant": f.quant_label,
            "file_bytes": plan.model.file_bytes,
            "native_context": plan.native_ctx,
            "mtp_layers": f.nextn_predict_layers,
            "mmproj": str(plan.model.mmproj) if plan.model.mmproj else None,
        },
        "binary": {"path": str(binary.path), "source": binary.source} if binary else None,
        "context": {
            "n_ctx": plan.n_ctx,
            "automatic": plan.n_ctx_auto,
            "max_safe": plan.max_safe_ctx,
            "native": plan.native_ctx,
        },
        "n_parallel": plan.n_parallel,
        "kv_unified": plan.kv_unified,
        "gpus": [device_json(d) for d in plan.gpus],
        "rpc_workers": list(plan.rpc_workers),
        "rpc_devices": [device_json(d) for d in plan.rpc_devices],
        "offload": plan.offload,
        "n_gpu_layers": plan.n_gpu_layers,
        "n_cpu_moe": plan.n_cpu_moe,
        "tensor_split": list(plan.tensor_split),
        "fit_target_mib": list(plan.fit_target_mib),
        "cache_type_k": plan.cache_type_k,
        "cache_type_v": plan.cache_type_v,
        "flash_attn": plan.flash_attn,
        "threads": plan.threads,
        "threads_batch": plan.threads_batch,
        "context_shift": plan.context_shift,
        "budget_fraction": plan.budget_fraction,
        "speculative": {
            "requested": plan.spec.requested,
            "resolved": plan.spec.resolved,
            "argv": list(plan.spec.argv),
            "reasons": list(plan.spec.reasons),
            "measured": measured_json(plan.spec.measured),
        },
        "bill": [
            {
                "device": d.name,
                "physical": f"{d.device.backend}{'' if d.device.index is None else d.device.index}",
                "name": d.device.name,
                "budget_bytes": d.budget_bytes,
                "free_bytes": d.device.free_bytes,
                "total_bytes": d.bill.total,
                "fits": d.fits,
                **{f"{p}_bytes": getattr(d.bill, p) for p in _PARTS},
                "projector_bytes": d.bill.projector,
                "compute_bytes": d.bill.compute + d.bill.compute_growth,
                "output_bytes": d.bill.output + d.bill.output_growth,
            }
            for d in plan.devices
        ],
        "projector": {
            "device": plan.bill.projector.device,
            "weights_bytes": plan.bill.projector.weights,
            "compute_bytes": plan.bill.projector.compute,
            "offload": plan.mmproj_offload,
        }
        if plan.bill.projector
        else None,
        "bill_approximate": plan.bill.approximate,
        "fits": plan.fits,
        "extra_args": list(plan.extra_args),
        "argv": list(argv),
        # what stands in the argv where each launch has a value of its own (LaunchCommand.shown_argv)
        "argv_placeholders": {k: v for k, v in PLACEHOLDERS.items() if any(k in a for a in argv)},
        "reasons": list(plan.reasons),
        "warnings": list(plan.warnings),
    }


def render_plan(info: dict[str, Any]) -> str:
    """``plan_json`` as aligned text."""
    m, ctx, spec = info["model"], info["context"], info["speculative"]
    gpus = info["gpus"]
    if info["rpc_devices"]:
        names = ", ".join(d["buffer_name"] for d in info["rpc_devices"])
        where = (
            f"-ngl {info['n_gpu_layers']} over {names}"
            + "".join(f", {g['backend']}{g['index']} {g['name']}" for g in gpus)
            + (" and the CPU" if not gpus else "")
        )
    elif not gpus:
        where = "CPU only (-ngl 0)"
    else:
        names = ", ".join(f"{g['backend']}{g['index']} {g['name']}" for g in gpus)
        how = (
            "--fit on" + (f" (about {info['n_gpu_layers']} layers on the GPUs)" if info["n_gpu_layers"] else "")
            if info["offload"] == "fit"
            else f"-ngl {info['n_gpu_layers']}"
        )
        where = f"{how} on {names}"
    if info.get("n_cpu_moe"):
        n = info["n_cpu_moe"]
        which = "the first layer" if n == 1 else f"the first {n} layers"
        where += f"; the routed experts of {which} on the CPU (--n-cpu-moe {n})"
    lines = [
        f"model      {m['path']}",
        f"           {m['architecture']}, {m['parameters'] / 1e6:,.0f}M parameters, {m['quant']}, "
        f"{format_size(m['file_bytes'])}" + (f", {m['mtp_layers']} MTP layer(s)" if m["mtp_layers"] else ""),
    ]
    if info["binary"]:
        lines.append(f"binary     {info['binary']['path']} ({info['binary']['source']})")
    lines += [
        f"context    {ctx['n_ctx']} tokens ({'automatic' if ctx['automatic'] else 'requested'}; native "
        f"{ctx['native']}; largest safe {ctx['max_safe']})",
        f"slots      {info['n_parallel']}" + (" on a unified KV cache" if info.get("kv_unified") else ""),
        f"offload    {where}",
        f"cache      K {info['cache_type_k']}, V {info['cache_type_v']}; flash attention {info['flash_attn']}"
        + ("; context shift on" if info["context_shift"] else ""),
        f"threads    {info['threads'] or 'every usable core'}"
        + (f" (batch {info['threads_batch']})" if info["threads_batch"] else ""),
        f"spec       {spec['requested']} -> {spec['resolved']}"
        + (f" ({' '.join(spec['argv'])})" if spec["argv"] else "")
        + (f"; measured: {spec['measured']['summary']}" if spec.get("measured") else ""),
        f"budget     {round(info['budget_fraction'] * 100)} % of free memory per device",
        "",
        "predicted memory" + (" (approximate)" if info["bill_approximate"] else ""),
    ]
    parts = [*_PARTS, *(["projector"] if info.get("projector") else [])]
    header = [
        "device",
        "weights",
        "KV",
        "recurrent",
        "compute",
        "output",
        "prompt cache",
        "process",
        *parts[len(_PARTS) :],
        "total",
        "budget",
        "",
    ]
    rows = [
        [
            f"{b['physical']} {b['name']}"[:40],
            *(format_size(b[f"{p}_bytes"]) for p in parts),
            format_size(b["total_bytes"]),
            format_size(b["budget_bytes"]),
            "ok" if b["fits"] else "OVER",
        ]
        for b in info["bill"]
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:-1], widths[1:-1], strict=False)), row[-1]]
        lines.append("  " + "  ".join(cells).rstrip())
    lines += ["", "reasons", *(f"  - {r}" for r in info["reasons"])]
    if info.get("evicts"):
        lines += ["", "would evict (idle, least recently used)", *(f"  - {name}" for name in info["evicts"])]
    if info.get("blocked_by"):
        lines += ["", "memory held by models that cannot be evicted now", *(f"  - {h}" for h in info["blocked_by"])]
    if info["warnings"]:
        lines += ["", "warnings", *(f"  ! {w}" for w in info["warnings"])]
    if info["argv"]:
        lines += ["", "command (as a load runs it)", "  " + shlex.join(info["argv"])]
        lines += [f"  {k}: {v}" for k, v in info.get("argv_placeholders", {}).items()]
    return "\n".join(lines)


def doctor_json(binary: Discovered, caps: Capabilities, inventory: Inventory) -> dict[str, Any]:
    """What ``ggstudio doctor`` reports, as JSON-able values."""
    return {
        "binary": {"path": str(binary.path), "source": binary.source},
        "version": caps.version,
        "build": caps.build,
        "capabilities": {
            "flags": {flag: caps.supports(flag) for flag in DOCTOR_FLAGS},
            "spec_types": list(caps.spec_types),
            "mtp_type": caps.mtp_type,
            "ngram_style": caps.ngram_style,
            "draft_n_max_flag": caps.draft_n_max_flag,
            "flag_count": len(caps.flags),
            "removed_flag_count": len(caps.removed_flags),
        },
        "devices": [device_json(d) for d in inventory.devices],
        "rpc_workers": [worker_json(r) for r in inventory.workers],
        "warnings": list(inventory.warnings),
    }


def render_doctor(info: dict[str, Any]) -> str:
    """``doctor_json`` as text."""
    c = info["capabilities"]
    build = f" (build {info['build']})" if info["build"] is not None else ""
    have = [f for f, ok in c["flags"].items() if ok]
    lack = [f for f, ok in c["flags"].items() if not ok]
    lines = [
        f"binary     {info['binary']['path']}",
        f"found via  {info['binary']['source']}",
        *(
            [f"backend    {info['backend']['backend'] or 'unknown'}: {info['backend']['why']}"]
            if "backend" in info
            else []
        ),
        f"version    {info['version'] or 'unknown'}{build}",
        f"flags      {c['flag_count']} ({c['removed_flag_count']} removed stubs)",
        f"has        {' '.join(have) or '-'}",
        f"lacks      {' '.join(lack) or '-'}",
        f"spec types {', '.join(c['spec_types']) or 'none'} (MTP: {c['mtp_type'] or 'no'}; ngram-mod knobs: "
        f"{c['ngram_style']}; draft n-max: {c['draft_n_max_flag'] or 'none'})",
        "devices",
    ]
    for d in info["devices"]:
        index = "" if d["index"] is None else str(d["index"])
        name = d.get("buffer_name") or d["name"]
        lines.append(
            f"  {d['backend']}{index}  {name}  {format_size(d['free_bytes'])} free of "
            f"{format_size(d['total_bytes'])}  ({d['source']})"
        )
    if info["rpc_workers"]:
        lines.append("rpc workers")
        for w in info["rpc_workers"]:
            state = (
                f"{len(w['devices'])} device(s)"
                if w["answered"]
                else ("busy, its last answer stands in" if w["devices"] else f"left out: {w['problem']}")
            )
            lines.append(f"  {w['endpoint']}  {state}")
    lines += [f"  ! {w}" for w in info["warnings"]]
    return "\n".join(lines)
