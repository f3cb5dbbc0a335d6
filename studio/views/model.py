"""A person-readable (and JSON) summary of a GGUF model, for ``ggstudio inspect``.

A multimodal projector gets its own, shorter summary (``kind: "projector"``: what it
encodes, its type, the width it feeds); a model says whether it is a text-to-speech
model (``speech``: its codec and why).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gguf import GGUFFile
from gguf.projector import projector_facts
from gguf.speech import speech_facts
from gguf.templates import template_capabilities
from launcher.sampling import Sampling, in_force
from launcher.units import format_mib
from studio.speech.engines import speech_engine


def summary(model: GGUFFile, sampling: Sampling | None = None) -> dict[str, Any]:
    """Return the facts a user asks about first, as plain JSON-able values; with ``sampling`` (the model's
    configured defaults), also the sampling defaults in force and where each comes from."""
    projector = projector_facts(model)
    if projector is not None:
        return projector_summary(model)
    f = model.facts
    speech = speech_facts(model)
    kv = f.kv_bytes_per_token(2.0)
    caps = template_capabilities(f.chat_template) if f.chat_template else None
    swa_count = sum(f.swa_layers)
    return {
        "kind": "model",
        "path": str(model.path),
        "architecture": f.architecture,
        "name": f.name,
        "size_label": f.size_label,
        "parameters": f.parameter_count,
        "quant": f.quant_label,
        "quant_description": f.file_type_description,
        "file_bytes": model.file_size,
        "native_context": f.context_length,
        "layers": f.layer_count,
        "blocks": f.block_count,
        "embedding_length": f.embedding_length,
        "heads": _collapse(f.head_count),
        "kv_heads": _collapse(f.head_count_kv),
        "head_dim_k": f.key_length,
        "head_dim_v": f.value_length,
        "kv_f16_bytes_per_1k_tokens": {"full": kv.full * 1024, "swa": kv.swa * 1024},
        "sliding_window": f.sliding_window if swa_count else 0,
        "swa_layers": swa_count,
        "recurrent_layers": sum(f.recurrent_layers),
        "mla_kv_lora_rank": f.kv_lora_rank,
        "mtp_layers": f.nextn_predict_layers,
        "experts": f.expert_count,
        "experts_used": f.expert_used_count,
        "vocab_size": f.vocab_size,
        "chat_template": dataclasses.asdict(caps) if caps else None,
        "sampling_in_file": dict(f.sampling),
        "sampling": in_force(sampling, f.sampling) if sampling is not None else None,
        "shards": [str(h.path) for h in model.shards],
        "speech": {
            "codec": speech.codec,
            "family": speech.family,
            "vocoder": speech.vocoder,
            "description": speech.describe(),
            "engine": speech_engine(speech),
        }
        if speech
        else None,
        "approximate": f.approximate,
        "notes": list(f.notes),
    }


def projector_summary(model: GGUFFile) -> dict[str, Any]:
    """Return what a multimodal projector file holds, as plain JSON-able values."""
    p = projector_facts(model)
    assert p is not None
    return {
        "kind": "projector",
        "path": str(model.path),
        "architecture": "clip",
        "name": model.metadata.get("general.name"),
        "vision": p.vision,
        "audio": p.audio,
        "speech_out": p.speech_out,
        "encoders": [
            {
                "modality": e.modality,
                "projector_type": e.projector_type,
                "embedding_length": e.n_embd,
                "layers": e.n_layer,
                "projection_dim": e.projection_dim,
                **(
                    {"image_size": e.image_size, "patch_size": e.patch_size}
                    if e.modality == "vision"
                    else {"mel_bins": e.n_mel_bins}
                ),
            }
            for e in p.encoders
        ],
        "projection_dims": list(p.projection_dims),
        "weight_bytes": p.weight_bytes,
        "file_bytes": model.file_size,
    }


def render_projector(info: dict[str, Any]) -> str:
    """Return ``projector_summary`` as aligned text lines."""
    takes = " and ".join(w for w, on in (("images", info["vision"]), ("audio (speech in)", info["audio"])) if on)
    rows = [
        ("kind", "multimodal projector (mmproj)" + (f"  ({info['name']})" if info["name"] else "")),
        (
            "takes",
            (takes or "nothing it declares") + ("; speaks (an audio generation head)" if info["speech_out"] else ""),
        ),
    ]
    for e in info["encoders"]:
        shape = (
            f"{e['image_size']}px images in {e['patch_size']}px patches"
            if e["modality"] == "vision"
            else f"{e['mel_bins']} mel bins"
        )
        rows.append(
            (
                f"{e['modality']} encoder",
                f"{e['projector_type'] or '?'}: {e['layers']} layers of "
                f"{e['embedding_length']}, {shape}, into width {e['projection_dim']}",
            )
        )
    rows.append(("weights", format_mib(info["weight_bytes"], decimals=2)))
    width = max(len(k) for k, _ in rows)
    return "\n".join([info["path"]] + [f"  {k:<{width}}  {v}" for k, v in rows])


def _collapse(values: tuple[int, ...]) -> int | list[int]:
    """One number when every layer agrees, else the per-layer list."""
    return values[0] if values and len(set(values)) == 1 else list(values)


def render(info: dict[str, Any]) -> str:
    """Return ``summary`` as aligned text lines."""
    if info.get("kind") == "projector":
        return render_projector(info)
    kv = info["kv_f16_bytes_per_1k_tokens"]
    caps = info["chat_template"]
    rows = [
        ("architecture", f"{info['architecture']}" + (f"  ({info['name']})" if info["name"] else "")),
        ("parameters", _count(info["parameters"]) + (f"  (label {info['size_label']})" if info["size_label"] else "")),
        (
            "quant",
            f"{info['quant']}  ({info['quant_description']}), {format_mib(info['file_bytes'], decimals=1)} on disk",
        ),
        ("native context", f"{info['native_context']:,} tokens"),
        (
            "layers",
            f"{info['layers']}"
            + (f" (+{info['blocks'] - info['layers']} extra blocks)" if info["blocks"] != info["layers"] else ""),
        ),
        (
            "heads",
            f"{info['heads']} query, {info['kv_heads']} KV; head dim K {info['head_dim_k']} / V {info['head_dim_v']}",
        ),
        (
            "KV per 1k tokens",
            f"{format_mib(kv['full'] + kv['swa'], decimals=2)} at f16"
            + (
                f" ({format_mib(kv['swa'], decimals=2)} of it in SWA layers, capped by the window)" if kv["swa"] else ""
            ),
        ),
        (
            "sliding window",
            f"{info['sliding_window']} tokens on {info['swa_layers']} of {info['blocks']} layers"
            if info["swa_layers"]
            else "none",
        ),
        ("recurrent", f"{info['recurrent_layers']} layers" if info["recurrent_layers"] else "none"),
        ("MLA", f"kv_lora_rank {info['mla_kv_lora_rank']}" if info["mla_kv_lora_rank"] else "no"),
        ("MTP", f"yes, {info['mtp_layers']} layer(s)" if info["mtp_layers"] else "no"),
        (
            "experts",
            f"{info['experts']} ({info['experts_used']} used per token)" if info["experts"] else "none (dense)",
        ),
        ("vocab", f"{info['vocab_size']:,} tokens"),
        ("chat template", _template_line(caps)),
        ("sampling", _sampling_line(info)),
        ("shards", f"{len(info['shards'])} file(s)"),
    ]
    if info.get("speech"):
        speech = info["speech"]
        engine = speech.get("engine")
        how = f"speaks through POST /v1/audio/speech ({engine})" if engine else "no speech engine here speaks it"
        rows.append(("speech", f"text-to-speech, not chat: {speech['description']}; {how}"))
    if info["approximate"] or info["notes"]:
        rows.append(("notes", "; ".join(info["notes"]) or "approximate"))
    width = max(len(k) for k, _ in rows)
    return "\n".join([info["path"]] + [f"  {k:<{width}}  {v}" for k, v in rows])


def _sampling_line(info: dict[str, Any]) -> str:
    """The defaults in force with their sources, else the file's own keys."""
    if info.get("sampling"):
        return ", ".join(f"{k} {v['value']:g} ({v['source']})" for k, v in info["sampling"].items())
    own = info.get("sampling_in_file") or {}
    return ", ".join(f"{k} {v:g}" for k, v in own.items()) + " (in the file)" if own else "none in the file"


def _template_line(caps: dict[str, Any] | None) -> str:
    if caps is None:
        return "none in the file"
    reasoning = "no"
    if caps["supports_reasoning"]:
        reasoning = "always on" if caps["always_thinks"] else f"yes (switch: {caps['reasoning_style']})"
    return f"reasoning {reasoning}; tools {'yes' if caps['supports_tools'] else 'no'}"


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)
