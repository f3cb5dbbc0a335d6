"""Measured speculative decoding: which mode was fastest for a model on these devices with this llama-server.

``ggstudio bench-spec`` (``studio.spec_bench``) measures tokens/s per mode and
stores the result here, one JSON file per key; the planner looks it up when the
mode is ``auto``, and ``auto`` then takes the measured winner instead of the
policy (``launcher.speculative``). The published numbers are why: the winner
varies by model, device and workload (MTP 0.58-0.86x below 3B parameters,
+15-24 % from ngram-mod on copy-edit work).

The key is what the speed depends on: the model file (path, size, mtime), the
devices it runs on (the plan's GPUs and RPC devices, and the CPU, by name) and
the llama-server build (path, size, mtime, version). A rebuilt binary or a
changed device set gives another key, finds nothing, and the policy stands
until the model is measured again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf.files import write_atomically
from launcher.capabilities import Capabilities
from launcher.devices import Device

_SCHEMA = 1
#: How each measured mode is named to a user: llama.cpp's type names.
LABELS = {
    "off": "off",
    "ngram": "ngram-mod",
    "ngram-simple": "ngram-simple",
    "mtp": "mtp",
    "mtp+ngram": "mtp+ngram-mod",
}


def _file_identity(path: Path) -> str:
    resolved = path.resolve()
    stat = resolved.stat()
    return f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}"


@dataclass(frozen=True)
class SpecKey:
    """What a measurement holds for: one model file, one device set, one llama-server build."""

    model: str  # "path|size|mtime_ns"
    devices: tuple[str, ...]  # "KEY=name", e.g. "CPU=AMD EPYC", "CUDA0=NVIDIA H200"
    binary: str  # "path|size|mtime_ns|version"

    @classmethod
    def of(cls, model: Path, devices: Sequence[Device], caps: Capabilities) -> SpecKey:
        """The key for serving ``model`` on ``devices`` with ``caps``' binary.

        Raises:
            OSError: the model or the binary cannot be read.
        """
        return cls(
            _file_identity(model),
            tuple(sorted(f"{d.key}={d.name}" for d in devices)),
            f"{_file_identity(Path(caps.binary))}|{caps.version}",
        )

    @property
    def digest(self) -> str:
        text = json.dumps([self.model, list(self.devices), self.binary])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ModeResult:
    """One mode's speed over the prompt set."""

    mode: str  # a resolved speculative mode: "off", "ngram", "ngram-simple", "mtp", "mtp+ngram"
    tokens_per_s: float  # the score: geometric mean over the prompt kinds of the median tokens/s per kind
    per_prompt: Mapping[str, float] = field(default_factory=dict)  # tokens/s per prompt kind
    draft_acceptance: float | None = None  # accepted / drafted tokens, when it drafted

    @property
    def label(self) -> str:
        return LABELS.get(self.mode, self.mode)


@dataclass(frozen=True)
class SpecMeasurement:
    """The speeds of every mode measured for one key, and when."""

    key: SpecKey
    results: tuple[ModeResult, ...]
    measured_at: str  # ISO 8601, UTC
    tokens: int = 0  # tokens generated per prompt

    @property
    def winner(self) -> ModeResult:
        return max(self.results, key=lambda r: r.tokens_per_s)

    def result(self, mode: str) -> ModeResult | None:
        return next((r for r in self.results if r.mode == mode), None)

    @property
    def speedup(self) -> float | None:
        """The winner's tokens/s over speculative decoding off; None if off was not measured."""
        off = self.result("off")
        return self.winner.tokens_per_s / off.tokens_per_s if off and off.tokens_per_s > 0 else None

    def summary(self) -> str:
        """In words, as ``plan`` and ``/api/status`` say it: ``ngram-mod, measured 1.31x over off on this machine``."""
        speedup = self.speedup
        over = f"{speedup:.2f}x over off" if speedup is not None else f"{self.winner.tokens_per_s:.1f} tokens/s"
        return f"{self.winner.label}, measured {over} on this machine ({self.measured_at[:10]})"

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": _SCHEMA,
            "key": {"model": self.key.model, "devices": list(self.key.devices), "binary": self.key.binary},
            "measured_at": self.measured_at,
            "tokens": self.tokens,
            "results": [
                {
                    "mode": r.mode,
                    "tokens_per_s": r.tokens_per_s,
                    "per_prompt": dict(r.per_prompt),
                    "draft_acceptance": r.draft_acceptance,
                }
                for r in self.results
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SpecMeasurement:
        """Raises ``ValueError`` (or ``KeyError``/``TypeError``) on anything but this module's own output."""
        if data.get("schema") != _SCHEMA:
            raise ValueError(f"unknown schema {data.get('schema')!r}")
        key = data["key"]
        results = tuple(
            ModeResult(
                str(r["mode"]),
                float(r["tokens_per_s"]),
                {str(k): float(v) for k, v in r["per_prompt"].items()},
                None if r["draft_acceptance"] is None else float(r["draft_acceptance"]),
            )
            for r in data["results"]
        )
        if not results:
            raise ValueError("no results")
        return cls(
            SpecKey(str(key["model"]), tuple(map(str, key["devices"])), str(key["binary"])),
            results,
            str(data["measured_at"]),
            int(data.get("tokens", 0)),
        )


def path_for(directory: Path, key: SpecKey) -> Path:
    return directory / f"spec-{key.digest}.json"


def save(directory: Path, measurement: SpecMeasurement) -> Path:
    """Store ``measurement`` under its key, replacing an older one; return its file."""
    directory.mkdir(parents=True, exist_ok=True)
    target = path_for(directory, measurement.key)
    write_atomically(target, json.dumps(measurement.to_json(), indent=1))
    return target


def lookup(
    directory: Path | None,
    model: Path,
    devices: Sequence[Device],
    caps: Capabilities,
) -> SpecMeasurement | None:
    """The stored measurement for this model, device set and binary; None when there is none (or it is unreadable)."""
    if directory is None:
        return None
    try:
        key = SpecKey.of(model, devices, caps)
        data = json.loads(path_for(directory, key).read_text())
        found = SpecMeasurement.from_json(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return found if found.key == key else None
