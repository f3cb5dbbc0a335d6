"""A structure-aware, seeded fuzz of GGUF headers through everything the studio does with a model file.

Each base file (the real Gemma header, a few zoo models) is walked once, independently
of ``gguf.reader``, to find where each field of its header lies: the version and the
counts, every key's length and type tag, scalar values, string lengths, array element
types, counts and first elements, and every tensor's name, dimension count, dimensions,
type and data offset. A case patches one to three of those fields with values chosen to
hurt (0, 1, the type's extremes, one more or less than before, NaN and infinities,
a block index of 60000...) or, more rarely, truncates the file or flips a random header
byte, then runs the pipeline ``gguf.read`` -> facts -> ``estimate`` -> ``plan`` ->
``build_command``'s argv, and undoes the patch. Only the studio's own errors
(``GGUFError``, ``LauncherError``) may come out; anything else is a finding, as is a case
that takes more than a second of CPU.

The base copies are sparse (the header's bytes, then a hole as long as the tensor data),
in a temporary folder: the pipeline reads headers, never weights. A case is reproducible
from ``(seed, index)`` alone.
"""

from __future__ import annotations

import math
import os
import random
import signal
import struct
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import gguf
from launcher.capabilities import Capabilities
from launcher.command import build_command
from launcher.devices import Device, Inventory
from launcher.errors import LauncherError
from launcher.memory import estimate, for_file
from launcher.planner import ModelInfo, PlanRequest, plan
from launcher.units import MIB

#: The project's own error classes: anything else escaping the pipeline is a bug.
OURS: tuple[type[BaseException], ...] = (gguf.GGUFError, LauncherError)
#: A case this slow (CPU seconds) is a hang; the watchdog ends one at ``WATCHDOG_S`` of wall time.
HANG_S = 1.0
WATCHDOG_S = 20.0

GIB = 1024 * MIB
_CPU = Device("CPU", None, "CPU", 64 * GIB, 48 * GIB, "psutil")
#: Machines a case plans on, alternately: CPU only, and two GPUs so the layer split and GPU searches run too.
MACHINES = (
    Inventory((_CPU,), ()),
    Inventory(
        (
            Device("CUDA", 0, "GPU A", 24 * GIB, 300 * MIB, "nvidia-smi"),
            Device("CUDA", 1, "GPU B", 24 * GIB, 8 * GIB, "nvidia-smi"),
            _CPU,
        ),
        (),
    ),
)
REQUESTS = (PlanRequest(), PlanRequest(n_ctx=8192, n_parallel=2, cache_type_k="q8_0", cache_type_v="q8_0"))

# GGUF value types (the reader's numbering)
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_UNSIGNED = {"B": "B", "b": "B", "H": "H", "h": "H", "I": "I", "i": "I", "Q": "Q", "q": "Q", "f": "I", "d": "Q"}
#: Elements of an array whose positions are recorded (per-layer arrays are shorter; token lists need not be whole).
_ELEMENTS_KEPT = 64


@dataclass(frozen=True)
class Field:
    """One header field of a base file: where it is, its struct format, and what it is."""

    kind: str  # one of CATEGORIES, e.g. "hparam", "tensor_dim"
    offset: int
    fmt: str  # struct format of the field ("I", "Q", "f", ...), or "s" for raw bytes
    size: int
    what: str  # e.g. "gemma3.block_count", "blk.3.attn_k.weight dim 1"


@dataclass
class Base:
    """A sparse copy of a real model file and the map of its header."""

    name: str
    path: Path
    size: int
    header_end: int
    fields: dict[str, list[Field]] = field(default_factory=dict)


def map_header(data: bytes) -> tuple[dict[str, list[Field]], int]:
    """(fields by kind, end of the tensor-info table) of a valid GGUF header."""
    fields: dict[str, list[Field]] = {}

    def add(kind: str, offset: int, fmt: str, what: str, size: int | None = None) -> None:
        fields.setdefault(kind, []).append(Field(kind, offset, fmt, size or struct.calcsize("<" + fmt), what))

    add("counts", 4, "I", "version")
    add("counts", 8, "Q", "tensor count")
    add("counts", 16, "Q", "metadata count")
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    off = 24

    def string(what: str) -> tuple[str, int]:
        nonlocal off
        (n,) = struct.unpack_from("<Q", data, off)
        add("string_len", off, "Q", what)
        text = data[off + 8 : off + 8 + n].decode("utf-8", "replace")
        off += 8 + n
        return text, off - n

    def value(vtype: int, key: str, depth: int, record: bool = True) -> None:
        nonlocal off
        if vtype in _FIXED:
            if record:
                hparam = not key.startswith(("general.", "tokenizer.", "split."))  # the architecture's own keys
                add("array_element" if depth else "hparam" if hparam else "scalar", off, _FIXED[vtype], key)
            off += struct.calcsize("<" + _FIXED[vtype])
        elif vtype == _STRING:
            (n,) = struct.unpack_from("<Q", data, off)
            if record:
                add("string_len", off, "Q", f"{key} (string)")
            off += 8 + n
        elif vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", data, off)
            if record:
                add("array_type", off, "I", key)
                add("array_count", off + 4, "Q", key)
            off += 12
            if etype in _FIXED and count > _ELEMENTS_KEPT:  # the rest of a numeric array in one step
                for i in range(_ELEMENTS_KEPT):
                    value(etype, f"{key}[{i}]", depth + 1, record)
                off += (count - _ELEMENTS_KEPT) * struct.calcsize("<" + _FIXED[etype])
                return
            for i in range(count):
                value(etype, f"{key}[{i}]", depth + 1, record and i < _ELEMENTS_KEPT)

    for _ in range(n_kv):
        key, _ = string("a key")
        add("type_tag", off, "I", key)
        (vtype,) = struct.unpack_from("<I", data, off)
        off += 4
        value(vtype, key, 0)
    for _ in range(n_tensors):
        name, start = string("a tensor name")
        if name.startswith("blk."):
            add("tensor_name", start, "s", name, size=len(name.encode()))
        (n_dims,) = struct.unpack_from("<I", data, off)
        add("tensor_dims", off, "I", f"{name} dimension count")
        off += 4
        for d in range(n_dims):
            add("tensor_dim", off, "Q", f"{name} dim {d}")
            off += 8
        add("tensor_type", off, "I", f"{name} type")
        add("tensor_offset", off + 4, "Q", f"{name} offset")
        off += 12
    return fields, off


def make_base(src: Path, folder: Path) -> Base:
    """A sparse copy of ``src`` in ``folder``: its header bytes, then a hole to the original size."""
    size = src.stat().st_size
    head = gguf.read(src).shards[0]
    with src.open("rb") as f:
        header = f.read(head.data_offset)
    dst = folder / src.name
    with dst.open("wb") as f:
        f.write(header)
        f.truncate(size)
    fields, end = map_header(header)
    return Base(src.stem, dst, size, end, fields)


# -- values that hurt ---------------------------------------------------------------------


def _int_values(fmt: str, old: int, rng: random.Random) -> list[int]:
    bits = 8 * struct.calcsize("<" + fmt)
    top = (1 << bits) - 1
    picks = [
        0,
        1,
        2,
        3,
        old + 1,
        old - 1,
        old * 2,
        old * 1000,
        top,
        top - 1,
        top >> 1,
        (top >> 1) + 1,
        rng.randrange(top + 1),
    ]
    picks += [
        v
        for v in (
            255,
            256,
            1024,
            32768,
            65535,
            65536,
            60000,
            1 << 20,
            1 << 24,
            1 << 27,
            1 << 31,
            1 << 32,
            1 << 40,
            1 << 62,
        )
        if v <= top
    ]
    return [v & top for v in picks]


def _float_values(old: float) -> list[float]:
    return [
        math.nan,
        math.inf,
        -math.inf,
        0.0,
        -0.0,
        -1.0,
        1e-45,
        1e38,
        -1e38,
        old * 1e6 if math.isfinite(old) else 1.0,
    ]


def _packed(fmt: str, old_bytes: bytes, rng: random.Random) -> bytes:
    """New bytes for a field of struct format ``fmt`` whose bytes were ``old_bytes``."""
    if fmt in "fd":
        (old,) = struct.unpack("<" + fmt, old_bytes)
        if rng.random() < 0.7:
            return struct.pack("<" + fmt, rng.choice(_float_values(old)))
    raw = _UNSIGNED[fmt]
    (old,) = struct.unpack("<" + raw, old_bytes)
    return struct.pack("<" + raw, rng.choice(_int_values(raw, old, rng)))


def _tensor_name(old: bytes, rng: random.Random) -> bytes:
    """The block index of ``blk.N.…`` replaced by another of the same number of digits (the name keeps its length)."""
    head, n, rest = old.split(b".", 2) if old.count(b".") >= 2 else (old, b"", b"")
    digits = len(n) or 1
    choice = rng.choice([0, 9 * (10 ** (digits - 1)), 10**digits - 1, rng.randrange(10**digits)])
    return b".".join([head, str(choice).rjust(digits, "0").encode()[-digits:], rest])[: len(old)]


#: The categories a case draws from and their weights (by count, tensor fields would crowd out the rest): the
#: hyper-parameters (scalars under the architecture's prefix), other scalars and array elements most often, since
#: the header stays readable and the facts, the estimate and the plan get to see them.
CATEGORIES = {
    "counts": 1,
    "type_tag": 1,
    "hparam": 5,
    "scalar": 2,
    "string_len": 1,
    "array_type": 1,
    "array_count": 1,
    "array_element": 2,
    "tensor_name": 1,
    "tensor_dims": 1,
    "tensor_dim": 2,
    "tensor_type": 1,
    "tensor_offset": 1,
    "truncate": 1,
    "byte": 1,
}


@dataclass(frozen=True)
class Patch:
    """Bytes to write at ``offset`` (or, with ``truncate_to``, the file cut short), and what it means."""

    offset: int
    data: bytes
    what: str
    truncate_to: int | None = None


def draw_patches(base: Base, rng: random.Random, header: bytes) -> list[Patch]:
    """One to three mutations of ``base``'s header."""
    patches = []
    for _ in range(rng.choices((1, 2, 3), weights=(6, 3, 1))[0]):
        present = [c for c in CATEGORIES if c in ("truncate", "byte") or base.fields.get(c)]
        category = rng.choices(present, weights=[CATEGORIES[c] for c in present])[0]
        if category == "truncate":
            cut = rng.choice(
                [
                    rng.randrange(base.header_end),
                    base.header_end,
                    base.size - 1,
                    rng.randrange(base.header_end, base.size),
                ]
            )
            patches.append(Patch(0, b"", f"file truncated to {cut} bytes", truncate_to=cut))
            continue
        if category == "byte":
            at = rng.randrange(base.header_end)
            patches.append(Patch(at, bytes([rng.randrange(256)]), f"byte {at} set"))
            continue
        f = rng.choice(base.fields[category])
        old = header[f.offset : f.offset + f.size]
        new = _tensor_name(old, rng) if f.fmt == "s" else _packed(f.fmt, old, rng)
        shown = new.decode("ascii", "replace") if f.fmt == "s" else struct.unpack("<" + f.fmt, new)[0]
        patches.append(Patch(f.offset, new, f"{category} {f.what} = {shown!r}"))
    return patches


# -- running cases -------------------------------------------------------------------------------------


class CaseTimeout(Exception):
    """The watchdog ended a case."""


@contextmanager
def watchdog(seconds: float) -> Iterator[None]:
    """Raise ``CaseTimeout`` in this (main) thread after ``seconds`` of wall time."""

    def expire(signum: int, frame: object) -> None:
        raise CaseTimeout(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def pipeline(
    path: Path, caps: Capabilities, binary: Path, machine: Inventory, request: PlanRequest, files_root: Path
) -> str:
    """Everything the studio does with a model file short of starting it; returns how far it got."""
    model = gguf.read(path, cache=False)
    facts = model.facts
    estimate(facts, for_file(model))
    launch = plan(ModelInfo.from_gguf(model), machine, caps, request)
    with build_command(launch, caps, binary=binary, api_key="fuzz", files_root=files_root) as command:
        command.argv(8080)
    return "argv"


@dataclass(frozen=True)
class Outcome:
    """One case: what was patched, how it ended, and how long it took."""

    index: int
    base: str
    patches: tuple[str, ...]
    result: str  # "argv", or the error class that stopped it
    foreign: bool  # an exception outside OURS (or the watchdog)
    cpu_s: float
    wall_s: float
    detail: str = ""  # the foreign exception's traceback


def run_case(
    index: int,
    seed: int,
    bases: Sequence[Base],
    headers: Sequence[bytes],
    caps: Capabilities,
    binary: Path,
    files_root: Path,
) -> Outcome:
    """Case ``index`` of the fuzz seeded ``seed``: patch, run the pipeline under the watchdog, undo."""
    rng = random.Random(seed * 1_000_003 + index)
    which = index % len(bases)
    base, header = bases[which], headers[which]
    patches = draw_patches(base, rng, header)
    rounds = index // len(bases)  # every base meets every machine and request
    machine, request = MACHINES[rounds % 2], REQUESTS[(rounds // 2) % 2]
    fd = os.open(base.path, os.O_RDWR)
    result, foreign, detail = "argv", False, ""
    cpu, wall = time.process_time(), time.monotonic()
    try:
        for p in patches:
            if p.truncate_to is not None:
                os.ftruncate(fd, p.truncate_to)
            else:
                os.pwrite(fd, p.data, p.offset)
        with watchdog(WATCHDOG_S):
            result = pipeline(base.path, caps, binary, machine, request, files_root)
    except OURS as exc:
        result = type(exc).__name__
    except Exception as exc:  # a finding: anything that is not ours
        result, foreign, detail = type(exc).__name__, True, traceback.format_exc()
    finally:
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        os.ftruncate(fd, base.size)
        os.pwrite(fd, header, 0)
        os.close(fd)
    return Outcome(index, base.name, tuple(p.what for p in patches), result, foreign, cpu, wall, detail)


def fuzz(
    bases: Sequence[Base],
    caps: Capabilities,
    binary: Path,
    files_root: Path,
    *,
    cases: int,
    seed: int,
    on_outcome: Callable[[Outcome], None] = lambda o: None,
) -> list[Outcome]:
    """Run ``cases`` cases over ``bases``; ``on_outcome`` sees each as it ends."""
    headers = []
    for b in bases:
        with b.path.open("rb") as f:
            headers.append(f.read(b.header_end))
    outcomes = []
    for index in range(cases):
        outcome = run_case(index, seed, bases, headers, caps, binary, files_root)
        on_outcome(outcome)
        outcomes.append(outcome)
    return outcomes
