"""What a llama-server binary can do, read from its own ``--version`` and ``--help``.

llama.cpp renames and removes flags between builds (``--draft-max`` became
``--spec-draft-n-max``, the ``mtp`` speculative type became ``draft-mtp``), and a
removed flag still appears in ``--help`` as a stub that fails when used. So the
launcher asks the binary instead of guessing from a version number.

A help block is a declaration line at column 0 (the flag, its aliases, a value
hint) followed by description lines indented by 40 spaces; a short declaration
carries the first description line on the same line. Probing runs the binary
twice, so results are cached in memory and on disk, keyed by the binary's path,
size and mtime: a rebuilt binary is probed again.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gguf.files import write_atomically
from launcher import platform
from launcher.errors import LauncherError

NgramStyle = Literal["new", "legacy", "none"]

PROBE_TIMEOUT_S = 10.0
_CACHE_SCHEMA = 2
_REMOVED_PREFIX = "the argument has been removed"
_NEW_NGRAM_KNOBS = ("--spec-ngram-mod-n-match", "--spec-ngram-mod-n-min", "--spec-ngram-mod-n-max")
_LEGACY_NGRAM_KNOBS = ("--spec-ngram-size-n", "--draft-min", "--draft-max")
_SECTION = re.compile(r"^-{3,} .* -{3,}$")
# The flags of a declaration line: "-fit,  --fit [on|off]" -> "-fit", "--fit".
_DECLARATION = re.compile(r"^-{1,2}[A-Za-z0-9][\w.-]*(?:,\s+-{1,2}[A-Za-z0-9][\w.-]*)*")
_FLAG = re.compile(r"-{1,2}[A-Za-z0-9][\w.-]*")
_DESCRIPTION_COLUMN = 40
# "version: 0.6.0-dev (build 11434, commit ...)" (new) or "version: 6990 (a1b2c3d4)" (old).
_VERSION_NEW = re.compile(r"^version:\s*(\S+)\s*\(build\s+(\d+)", re.MULTILINE)
_VERSION_OLD = re.compile(r"^version:\s*(\d+)\s*\(", re.MULTILINE)


class ProbeError(LauncherError):
    """Running a tool to learn what it supports failed (hang, crash or unreadable output)."""

    def __init__(self, message: str, *, binary: Path | str, output_tail: str = "") -> None:
        super().__init__(message)
        self.binary = str(binary)
        self.output_tail = output_tail


@dataclass(frozen=True)
class ToolOutput:
    """What a short-lived tool printed, and how it exited."""

    exit_code: int
    stdout: str
    stderr: str


def run_tool(argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None) -> ToolOutput:
    """Run ``argv`` to completion within ``timeout`` seconds, killing its whole group on overrun.

    Raises:
        ProbeError: it could not start, or it ran past ``timeout``.
    """
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env) if env is not None else None,
            **platform.child_popen_kwargs(),
        )
    except OSError as exc:
        raise ProbeError(f"{argv[0]} could not be started: {exc}", binary=argv[0]) from exc
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # A hung tool may have children holding the pipes open: stop the whole group.
        platform.kill_group(proc.pid)
        out, err = proc.communicate()
        raise ProbeError(
            f"`{' '.join(argv)}` did not finish within {timeout:g} s and was killed",
            binary=argv[0],
            output_tail=_tail(out + err),
        ) from None
    return ToolOutput(proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def _tail(raw: bytes | str, chars: int = 2000) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return text[-chars:]


@dataclass(frozen=True)
class FlagBlock:
    """One flag's entry in ``--help``: every spelling, and its description."""

    flags: tuple[str, ...]
    value_hint: str  # e.g. "N", "[on|off]", or the list of choices
    description: str

    @property
    def removed(self) -> bool:
        """llama.cpp keeps removed flags as stubs that only raise an error when used."""
        return self.description.startswith(_REMOVED_PREFIX)


def parse_help(text: str) -> list[FlagBlock]:
    """Split llama-server ``--help`` output into flag blocks."""
    blocks: list[FlagBlock] = []
    flags: tuple[str, ...] = ()
    hint = ""
    description: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith(" "):
            if flags and line.strip():
                description.append(line.strip())
            continue
        if flags:  # a blank line, a section title or the next declaration ends the block
            blocks.append(FlagBlock(flags, hint, " ".join(description)))
            flags, description = (), []
        match = None if _SECTION.match(line) else _DECLARATION.match(line)
        if match:
            flags = tuple(_FLAG.findall(match.group(0)))
            declaration = line
            # A declaration of up to 37 characters is padded to column 40 and followed by its help.
            if line[_DESCRIPTION_COLUMN - 3 : _DESCRIPTION_COLUMN] == "   " and line[_DESCRIPTION_COLUMN:].strip():
                declaration = line[:_DESCRIPTION_COLUMN]
                description.append(line[_DESCRIPTION_COLUMN:].strip())
            hint = declaration[match.end() :].strip()
    return blocks


def parse_version(text: str) -> tuple[str, int | None]:
    """Return (version, build number) from ``--version`` output; ("", None) if absent."""
    if match := _VERSION_NEW.search(text):
        return match.group(1), int(match.group(2))
    if match := _VERSION_OLD.search(text):  # old builds: the build number is the version
        return match.group(1), int(match.group(1))
    return "", None


def _choices(hint: str) -> tuple[str, ...]:
    """Read "a,b,c", "[a|b|c]" or "{a,b,c}" as a tuple of choices."""
    words = re.split(r"[,|]", hint.strip("[]{}<>() "))
    return tuple(w for w in (w.strip() for w in words) if re.fullmatch(r"[a-z0-9][a-z0-9_-]*", w))


@dataclass(frozen=True)
class Capabilities:
    """The flags and speculative types one llama-server build accepts."""

    binary: str
    version: str
    build: int | None
    flags: frozenset[str]  # every real spelling, aliases and negations included
    removed_flags: frozenset[str]  # stubs that only say "the argument has been removed"
    spec_types: tuple[str, ...]  # the --spec-type choices, in the order the help lists them
    ngram_style: NgramStyle  # how ngram-mod is tuned: --spec-ngram-mod-n-* (new) or older knobs
    draft_n_max_flag: str | None  # --spec-draft-n-max, the older --draft-max, or None
    spellings: tuple[tuple[str, ...], ...] = ()  # each working flag's spellings, as one help declaration lists them

    def supports(self, flag: str) -> bool:
        """True if ``flag`` is a working flag of this build (a removed stub is not)."""
        return flag in self.flags

    def aliases_of(self, flag: str) -> tuple[str, ...]:
        """Every spelling this build's help declares together with ``flag`` (``flag`` alone if none)."""
        return next((group for group in self.spellings if flag in group), (flag,))

    @property
    def mtp_type(self) -> str | None:
        """The --spec-type value for multi-token prediction: "draft-mtp", older "mtp", or None."""
        return next((t for t in ("draft-mtp", "mtp") if t in self.spec_types), None)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; ``from_json`` reads it back."""
        return {
            "binary": self.binary,
            "version": self.version,
            "build": self.build,
            "flags": sorted(self.flags),
            "removed_flags": sorted(self.removed_flags),
            "spec_types": list(self.spec_types),
            "ngram_style": self.ngram_style,
            "draft_n_max_flag": self.draft_n_max_flag,
            "spellings": [list(g) for g in self.spellings],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Capabilities:
        style = data["ngram_style"]
        if style not in ("new", "legacy", "none"):
            raise ValueError(f"unknown ngram_style {style!r}")
        return cls(
            binary=str(data["binary"]),
            version=str(data["version"]),
            build=None if data["build"] is None else int(data["build"]),
            flags=frozenset(map(str, data["flags"])),
            removed_flags=frozenset(map(str, data["removed_flags"])),
            spec_types=tuple(map(str, data["spec_types"])),
            ngram_style=style,
            draft_n_max_flag=None if data["draft_n_max_flag"] is None else str(data["draft_n_max_flag"]),
            spellings=tuple(tuple(map(str, g)) for g in data["spellings"]),
        )


def capabilities_from_text(binary: str, version_text: str, help_text: str) -> Capabilities:
    """Build Capabilities from saved ``--version`` and ``--help`` output.

    Raises:
        ProbeError: the help has no ``--help`` entry, so it is not llama.cpp help text.
    """
    blocks = parse_help(help_text)
    flags = frozenset(f for b in blocks if not b.removed for f in b.flags)
    if "--help" not in flags:
        raise ProbeError(
            f"{binary} --help printed no llama.cpp option list; is it a llama-server binary?",
            binary=binary,
            output_tail=_tail(help_text),
        )
    version, build = parse_version(version_text)
    spec_type = next((b for b in blocks if "--spec-type" in b.flags and not b.removed), None)
    return Capabilities(
        binary=binary,
        version=version,
        build=build,
        flags=flags,
        removed_flags=frozenset(f for b in blocks if b.removed for f in b.flags) - flags,
        spec_types=_choices(spec_type.value_hint) if spec_type else (),
        ngram_style=_ngram_style(flags),
        draft_n_max_flag=next((f for f in ("--spec-draft-n-max", "--draft-max") if f in flags), None),
        spellings=tuple(b.flags for b in blocks if not b.removed and len(b.flags) > 1),
    )


def _ngram_style(flags: frozenset[str]) -> NgramStyle:
    if all(f in flags for f in _NEW_NGRAM_KNOBS):
        return "new"
    if all(f in flags for f in _LEGACY_NGRAM_KNOBS):
        return "legacy"
    return "none"


_memory: dict[tuple[str, int, int], Capabilities] = {}


def clear_memory_cache() -> None:
    """Forget every in-memory probe result (the on-disk cache stays)."""
    _memory.clear()


def probe(binary: Path, *, cache_dir: Path | None = None, timeout: float = PROBE_TIMEOUT_S) -> Capabilities:
    """Return what ``binary`` supports, from cache when the same file was probed before.

    Raises:
        ProbeError: the binary is missing, hangs, crashes or prints something that is not llama.cpp help.
    """
    path = binary.resolve()
    try:
        stat = path.stat()
    except OSError as exc:
        raise ProbeError(f"cannot probe {binary}: {exc.strerror}", binary=binary) from exc
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key in _memory:
        return _memory[key]
    cache_file = (
        cache_dir / f"capabilities-{hashlib.sha256(key[0].encode()).hexdigest()[:16]}.json" if cache_dir else None
    )
    caps = _read_cache(cache_file, key) if cache_file else None
    if caps is None:
        caps = capabilities_from_text(str(path), _run_ok(path, "--version", timeout), _run_ok(path, "--help", timeout))
        if cache_file:
            _write_cache(cache_file, key, caps)
    _memory[key] = caps
    return caps


def _run_ok(binary: Path, flag: str, timeout: float) -> str:
    result = run_tool([str(binary), flag], timeout=timeout)
    output = result.stdout + result.stderr  # llama.cpp prints --version to stderr
    if result.exit_code != 0:
        raise ProbeError(
            f"`{binary} {flag}` exited with code {result.exit_code}; last output:\n{_tail(output, 500)}",
            binary=binary,
            output_tail=_tail(output),
        )
    return output


def _read_cache(cache_file: Path, key: tuple[str, int, int]) -> Capabilities | None:
    """Return the cached result for exactly this file, or None (absent, stale or unreadable)."""
    try:
        data = json.loads(cache_file.read_text())
        if data["schema"] != _CACHE_SCHEMA or [data["path"], data["size"], data["mtime_ns"]] != list(key):
            return None
        return Capabilities.from_json(data["capabilities"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a corrupt cache is only a missed shortcut: probe again and overwrite it


def _write_cache(cache_file: Path, key: tuple[str, int, int], caps: Capabilities) -> None:
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    data = {"schema": _CACHE_SCHEMA, "path": key[0], "size": key[1], "mtime_ns": key[2], "capabilities": caps.to_json()}
    write_atomically(cache_file, json.dumps(data, indent=1))  # readers never see half a file
