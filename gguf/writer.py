"""Write GGUF files: test fixtures, and models re-written with edited metadata.

The header is built in memory (even a 262k-token vocabulary is a few MB, and a
reader ``LazyArray`` is copied as its raw bytes, never decoded). Tensor data is
streamed from ``bytes`` or copied in chunks from a region of another file, so
re-writing a large model never holds it in memory. The file appears whole or
not at all: it is written beside ``path`` under a temporary name, then renamed.

The layout is ggml's ``gguf_write_out``: tensors in the given order, each at an
aligned offset followed by zero padding. llama.cpp requires exactly that: each
tensor's offset must be the padded size of all the tensors before it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

from gguf.errors import GGUFError, TruncatedError
from gguf.files import replacing
from gguf.ggml_types import BY_NAME, GGMLType
from gguf.model import read
from gguf.reader import (
    ARRAY,
    BOOL,
    DEFAULT_ALIGNMENT,
    FIXED,
    FLOAT32,
    INT32,
    INT64,
    MAGIC,
    MAX_DIMS,
    STRING,
    SUPPORTED_VERSIONS,
    UINT32,
    UINT64,
    VALUE_TYPE_NAMES,
    Header,
    LazyArray,
    StatKey,
    TensorInfo,
)

ALIGNMENT_KEY = "general.alignment"
#: llama.cpp rejects tensor names of this many bytes or more (GGML_MAX_NAME).
MAX_NAME_BYTES = 64
_CHUNK = 16 << 20


@dataclass(frozen=True)
class FileRegion:
    """``n_bytes`` at absolute ``offset`` in ``path``: tensor data copied without loading it."""

    path: Path
    offset: int
    n_bytes: int
    stat_key: StatKey | None = None  # when set, the file must not have changed since it was read


@dataclass(frozen=True)
class TensorToWrite:
    """One tensor. ``data`` is its bytes, a ``FileRegion``, or None for zeros.

    Zeros are left as a hole in the file (sparse where the file system allows),
    so a fixture can declare a multi-GB model in milliseconds.
    """

    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous dimension
    ggml_type: GGMLType | str  # a GGMLType or its name ("Q4_K"); stored as GGMLType
    data: bytes | FileRegion | None = None

    def __post_init__(self) -> None:
        if isinstance(self.ggml_type, str) and self.ggml_type not in BY_NAME:
            raise ValueError(f"tensor {self.name!r}: unknown ggml type {self.ggml_type!r}")
        gtype = BY_NAME[self.ggml_type] if isinstance(self.ggml_type, str) else self.ggml_type
        object.__setattr__(self, "ggml_type", gtype)
        object.__setattr__(self, "shape", tuple(self.shape))
        if len(self.name.encode()) >= MAX_NAME_BYTES:
            raise ValueError(f"tensor name {self.name!r} is {MAX_NAME_BYTES} bytes or longer; llama.cpp rejects it")
        if not 1 <= len(self.shape) <= MAX_DIMS or any(d <= 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r} has shape {self.shape}; it needs 1 to {MAX_DIMS} positive dims")
        if self.shape[0] % gtype.block_size:
            raise ValueError(
                f"tensor {self.name!r}: {self.shape[0]} columns is not a multiple of the "
                f"{gtype.name} block size {gtype.block_size}"
            )
        size = self.data.n_bytes if isinstance(self.data, FileRegion) else len(self.data or b"")
        if self.data is not None and size != self.n_bytes:
            raise ValueError(
                f"tensor {self.name!r} ({gtype.name} {list(self.shape)}) needs {self.n_bytes} bytes, not {size}"
            )

    @property
    def gtype(self) -> GGMLType:
        """``ggml_type`` as a GGMLType (a name was resolved in ``__post_init__``)."""
        return cast(GGMLType, self.ggml_type)

    @property
    def n_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return self.gtype.nbytes(n)


def infer_type(value: Any) -> tuple[int, ...]:
    """Return the GGUF type ``value`` is written as when none is given.

    bool -> bool; int -> int32 if it fits, else int64, else uint64; float ->
    float32; str -> string; list/tuple -> array of the element type that fits
    every element (ints and floats mixed: float32; empty: int32). For arrays of
    arrays only ``(ARRAY, ARRAY)`` is returned: each inner array is inferred
    on its own, as GGUF stores a type per inner array.
    """
    if isinstance(value, LazyArray):
        return (ARRAY, value.element_type)
    if isinstance(value, (list, tuple)):
        return (ARRAY, _element_type(value))
    if isinstance(value, (bool, int, float, str)):
        return (_element_type([value]),)
    raise TypeError(f"a {type(value).__name__} has no GGUF type")


def copy_of(header: Header, tensor: TensorInfo, name: str | None = None) -> TensorToWrite:
    """``tensor`` of ``header``'s file to write again (renamed ``name``): its data is copied, never loaded,
    and refused if the file changed since ``header`` was read."""
    return TensorToWrite(
        name or tensor.name,
        tensor.shape,
        tensor.ggml_type,
        FileRegion(header.path, header.data_offset + tensor.offset, tensor.n_bytes, header.stat_key),
    )


def _element_type(values: Sequence[Any]) -> int:
    kinds = {type(v) for v in values}
    if not kinds:
        return INT32
    if kinds <= {bool}:
        return BOOL
    if kinds <= {str}:
        return STRING
    if kinds <= {int}:
        lo, hi = min(values), max(values)
        if -(1 << 31) <= lo and hi < 1 << 31:
            return INT32
        return INT64 if -(1 << 63) <= lo and hi < 1 << 63 else UINT64
    if kinds <= {int, float}:
        return FLOAT32
    if all(isinstance(v, (list, tuple, LazyArray)) for v in values):
        return ARRAY
    raise TypeError(f"cannot infer one GGUF element type for {sorted(k.__name__ for k in kinds)}")


def _put(out: bytearray, value: Any, types: tuple[int, ...]) -> None:
    """Append ``value`` encoded as ``types`` (``(type,)`` or ``(ARRAY, element type, ...)``)."""
    vtype = types[0]
    if vtype == ARRAY:
        _put_array(out, value, types[1:] or infer_type(value)[1:])
    elif vtype == STRING:
        _put_string(out, value)
    elif vtype in FIXED:
        out += struct.pack("<" + FIXED[vtype][0], value)
    else:
        raise ValueError(f"unknown GGUF value type {vtype}")


def _put_string(out: bytearray, text: str) -> None:
    if not isinstance(text, str):
        raise TypeError(f"expected a str, not {type(text).__name__}")
    raw = text.encode("utf-8")
    out += struct.pack("<Q", len(raw))
    out += raw


def _put_array(out: bytearray, values: Any, etypes: tuple[int, ...]) -> None:
    etype = etypes[0]
    out += struct.pack("<IQ", etype, len(values))
    if isinstance(values, LazyArray) and values.element_type == etype:
        out += _lazy_bytes(values)
    elif etype in FIXED:
        out += struct.pack(f"<{len(values)}{FIXED[etype][0]}", *values)
    elif etype == STRING:
        for text in values:
            _put_string(out, text)
    elif etype == ARRAY:
        for inner in values:
            _put_array(out, inner, etypes[1:] or infer_type(inner)[1:])
    else:
        raise ValueError(f"unknown GGUF array element type {etype}")


def _open_checked(path: Path, stat_key: StatKey | None) -> BinaryIO:
    """Open ``path`` for reading, refusing a file that changed since its header was read."""
    fh = open(path, "rb")
    if stat_key is not None and StatKey.of(os.fstat(fh.fileno())) != stat_key:
        fh.close()
        raise GGUFError("the file changed since its header was read; read it again", path=path)
    return fh


def _lazy_bytes(lazy: LazyArray) -> bytes:
    """The encoded elements of ``lazy``, straight from its file."""
    with _open_checked(lazy.path, lazy.stat_key) as fh:
        fh.seek(lazy.offset)
        data = fh.read(lazy.end - lazy.offset)
    if len(data) != lazy.end - lazy.offset:
        raise TruncatedError("the file is shorter than when its header was read", path=lazy.path, offset=lazy.offset)
    return data


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _encode_header(
    metadata: Mapping[str, Any],
    tensors: Sequence[TensorToWrite],
    value_types: Mapping[str, tuple[int, ...]],
    alignment: int,
    version: int,
) -> tuple[bytearray, list[int]]:
    """Return the header (up to, not including, its padding) and each tensor's data offset."""
    out = bytearray(MAGIC)
    out += struct.pack("<IQQ", version, len(tensors), len(metadata))
    for key, value in metadata.items():
        types: tuple[int, ...] = ()
        try:
            types = value_types.get(key) or ((UINT32,) if key == ALIGNMENT_KEY else infer_type(value))
            _put_string(out, key)
            out += struct.pack("<I", types[0])
            _put(out, value, types)
        except GGUFError:
            raise
        except (struct.error, TypeError, ValueError, OverflowError) as exc:
            names = "/".join(VALUE_TYPE_NAMES[t] if 0 <= t < len(VALUE_TYPE_NAMES) else str(t) for t in types) or "GGUF"
            error = TypeError if isinstance(exc, TypeError) else ValueError
            raise error(f"metadata {key!r}: cannot write {_short(value)} as {names}: {exc}") from exc
    offsets = []
    end = 0
    for t in tensors:
        offsets.append(end)
        _put_string(out, t.name)
        out += struct.pack(f"<I{len(t.shape)}QIQ", len(t.shape), *t.shape, t.gtype.id, end)
        end += -(-t.n_bytes // alignment) * alignment
    offsets.append(end)
    return out, offsets


def write_gguf(
    path: str | os.PathLike[str],
    metadata: Mapping[str, Any],
    tensors: Sequence[TensorToWrite] = (),
    *,
    value_types: Mapping[str, tuple[int, ...]] | None = None,
    alignment: int | None = None,
    version: int = 3,
) -> Path:
    """Write a GGUF file and return its path.

    ``value_types`` (the reader's ``Header.value_types`` format) pins the type of
    any key; other keys get ``infer_type`` (``general.alignment``: uint32, as
    llama.cpp requires). ``alignment`` defaults to ``general.alignment`` or 32;
    a non-default one is added to the metadata when absent.

    Raises:
        ValueError / TypeError: a value does not fit its type; the message names the key.
        GGUFError: a ``LazyArray`` or ``FileRegion`` source changed or shrank.
    """
    path = Path(path)
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"GGUF version {version} cannot be written; use one of {SUPPORTED_VERSIONS}")
    declared = metadata.get(ALIGNMENT_KEY)
    if alignment is None:
        alignment = DEFAULT_ALIGNMENT if declared is None else declared
    elif declared is not None and declared != alignment:
        raise ValueError(f"alignment={alignment} but the metadata says {ALIGNMENT_KEY}={declared}")
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, not {alignment!r}")
    if declared is None and alignment != DEFAULT_ALIGNMENT:
        metadata = {**metadata, ALIGNMENT_KEY: alignment}
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"tensor names repeat: {sorted({n for n in names if names.count(n) > 1})}")
    header, offsets = _encode_header(metadata, tensors, value_types or {}, alignment, version)
    data_start = -(-len(header) // alignment) * alignment

    with replacing(path) as tmp, tmp.open("xb") as out, ExitStack() as sources:
        out.write(header)
        opened: dict[tuple[Path, StatKey | None], BinaryIO] = {}
        for tensor, offset in zip(tensors, offsets, strict=False):
            out.seek(data_start + offset)  # padding and zero tensors stay holes: they read as zeros
            if isinstance(tensor.data, FileRegion):
                region = tensor.data
                src_key = (region.path, region.stat_key)
                if src_key not in opened:
                    opened[src_key] = sources.enter_context(_open_checked(region.path, region.stat_key))
                _copy(opened[src_key], region, out)
            elif tensor.data is not None:
                out.write(tensor.data)
        out.truncate(data_start + offsets[-1])
    return path


def _copy(src: BinaryIO, region: FileRegion, out: BinaryIO) -> None:
    src.seek(region.offset)
    left = region.n_bytes
    while left:
        chunk = src.read(min(left, _CHUNK))
        if not chunk:
            raise TruncatedError(
                f"the file ends {left} bytes before the tensor data it should hold",
                path=region.path,
                offset=region.offset + region.n_bytes - left,
            )
        out.write(chunk)
        left -= len(chunk)


def rewrite(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    metadata_updates: Mapping[str, Any] | None = None,
    drop_keys: Sequence[str] = (),
    value_types: Mapping[str, tuple[int, ...]] | None = None,
) -> Path:
    """Copy the single-file model ``src`` to ``dst``, editing only its metadata.

    Keys keep their order and exact types; an updated key keeps its old type
    unless ``value_types`` gives a new one; new keys are appended (typed by
    ``value_types`` or inferred). Tensor data is copied byte for byte.
    """
    model = read(src)
    if len(model.shards) > 1:
        raise ValueError(f"{src} is one shard of a {len(model.shards)}-file model; rewrite handles single files")
    head = model.shards[0]
    dropped = set(drop_keys)
    metadata = {k: v for k, v in head.metadata.items() if k not in dropped}
    metadata.update(metadata_updates or {})
    types = {**head.value_types, **(value_types or {})}
    return write_gguf(dst, metadata, [copy_of(head, t) for t in head.tensors], value_types=types, version=head.version)
