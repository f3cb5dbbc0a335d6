"""Parse one GGUF file's header: metadata, tensor-info table, data offset.

The file is memory-mapped and parsed in place with ``struct.unpack_from``: no
read of the tensor data, no copy of the header. Large arrays (token lists,
merges, scores) are skipped, not decoded, and kept as ``LazyArray`` views that
read and decode their bytes only when asked. Runs of short strings are skipped
by a compiled regular expression that matches 1024 length-prefixed strings per
call, which is several times faster than a Python loop over each length.

Every malformed input raises a ``GGUFError`` subclass with the byte offset.

``read_header_prefix`` parses the same way from the first bytes of a file that is
elsewhere (a Hub file read with ranged requests): when the bytes run out before the
end of the tensor infos it raises ``NeedMoreBytes`` with a lower bound of where the
header ends (what it still has to read, each remaining key at 13 bytes and each
tensor info at 28), so a caller that fetches up to that bound plus a fixed margin
never reads more than the header and the margin. Parsing again from the start is
cheaper than any resumable design: the header parses at hundreds of MB/s.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gguf.errors import (
    CorruptHeaderError,
    GGUFError,
    NeedMoreBytes,
    NotGGUFError,
    TruncatedError,
    UnsupportedVersionError,
)
from gguf.ggml_types import GGML_TYPES, GGMLType

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_NAME = 64  # GGML_MAX_NAME, including the terminating NUL
MAX_NESTING = 8
#: Lengths checked before a string is copied out of the map, so a corrupt length costs nothing: keys are dotted
#: names of tens of bytes; the longest values are an embedded tokenizer.json (Gemma 3's 262k vocabulary: 33 MB)
#: and chat templates (tens of KB). Bytes beyond these are tensor data read as text.
MAX_KEY = 1 << 16
MAX_STRING = 1 << 27
#: Arrays of arrays (which llama.cpp refuses; the writer's tests use a few) are read up to this many inner ones.
MAX_INNER_ARRAYS = 4096
#: Counts beyond any real file, refused before the loops over them: models have tens of keys and up to a few
#: thousand tensors (DeepSeek-V3: 1,025; facts allow 1024 blocks, 256 tensors each would be 262,144).
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 18

# GGUF metadata value types.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
VALUE_TYPE_NAMES = (
    "uint8",
    "int8",
    "uint16",
    "int16",
    "uint32",
    "int32",
    "float32",
    "bool",
    "string",
    "array",
    "uint64",
    "int64",
    "float64",
)
#: struct format character and size of each fixed-size value type.
FIXED: dict[int, tuple[str, int]] = {
    UINT8: ("B", 1),
    INT8: ("b", 1),
    UINT16: ("H", 2),
    INT16: ("h", 2),
    UINT32: ("I", 4),
    INT32: ("i", 4),
    FLOAT32: ("f", 4),
    BOOL: ("?", 1),
    UINT64: ("Q", 8),
    INT64: ("q", 8),
    FLOAT64: ("d", 8),
}

#: Arrays longer than this are kept lazy (strings) ...
EAGER_STRINGS = 64
#: ... or longer than this (numbers); per-layer arrays stay eager.
EAGER_NUMBERS = 4096

_U32 = struct.Struct("<I").unpack_from
_U64 = struct.Struct("<Q").unpack_from
_U32U64 = struct.Struct("<IQ").unpack_from

#: The optional C loop (gguf/_skip.c): the offset after ``count`` strings, or None past the end.
c_skip_strings: Callable[[bytes | mmap.mmap, int, int], int | None] | None
try:  # the regex path below is the fallback
    from gguf._skip import skip_strings as c_skip_strings
except ImportError:  # pragma: no cover - depends on the install having a compiler
    c_skip_strings = None

#: A tensor's info as read: (name, shape, ggml type, data offset, where the info starts in the file).
_TensorRecord = tuple[str, tuple[int, ...], int, int, int]

_SKIP_CHUNK = 1024
_short_strings: re.Pattern[bytes] | None = None


def _short_string_run() -> re.Pattern[bytes]:
    """Return a regex matching ``_SKIP_CHUNK`` consecutive strings shorter than 256 bytes."""
    global _short_strings
    if _short_strings is None:
        one = b"|".join(re.escape(bytes([n])) + b"\x00{7}" + b".{%d}" % n for n in range(256))
        _short_strings = re.compile(b"(?>" + one + b"){%d}" % _SKIP_CHUNK, re.DOTALL)
    return _short_strings


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor-info table."""

    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous dimension
    ggml_type: GGMLType
    offset: int  # relative to the file's data section
    n_bytes: int
    shard: int = 0  # index of the shard file holding the data

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class StatKey:
    """Identity of a file's contents for caching: same key, same bytes (in practice)."""

    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, st: os.stat_result) -> StatKey:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


@dataclass(frozen=True, eq=False)
class LazyArray:
    """A large metadata array, decoded from the file only when read."""

    path: Path
    offset: int  # first element
    end: int  # one past the last element's last byte
    count: int
    element_type: int
    stat_key: StatKey

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Any]:
        return iter(self.values)

    def __getitem__(self, index: int) -> Any:
        return self.values[index]

    def __repr__(self) -> str:
        return f"LazyArray({VALUE_TYPE_NAMES[self.element_type]}[{self.count}])"

    @cached_property
    def values(self) -> tuple[Any, ...]:
        """Every element, decoded (read from the file on first access)."""
        with self.path.open("rb") as fh:
            if StatKey.of(os.fstat(fh.fileno())) != self.stat_key:
                raise GGUFError("the file changed since its header was read; read it again", path=self.path)
            fh.seek(self.offset)
            data = fh.read(self.end - self.offset)
        if len(data) != self.end - self.offset:
            raise TruncatedError("the file is shorter than when its header was read", path=self.path)
        if self.element_type == STRING:
            try:
                return tuple(_decode_strings(data, self.count, self.path, self.offset))
            except struct.error:
                raise CorruptHeaderError("a string array runs past its recorded end", path=self.path) from None
        fmt, _ = FIXED[self.element_type]
        return struct.unpack_from(f"<{self.count}{fmt}", data)


def _decode_strings(data: bytes, count: int, path: Path, base: int) -> Iterator[str]:
    off = 0
    for _ in range(count):
        (n,) = _U64(data, off)
        raw = data[off + 8 : off + 8 + n]
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptHeaderError("a string in an array is not valid UTF-8", path=path, offset=base + off) from None
        off += 8 + n


@dataclass(frozen=True)
class Header:
    """The parsed header of one GGUF file."""

    path: Path
    version: int
    metadata: Mapping[str, Any]
    value_types: Mapping[str, tuple[int, ...]]  # (type,) or (ARRAY, element type, ...)
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_offset: int
    file_size: int
    stat_key: StatKey = field(repr=False)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)


def read_header(path: str | os.PathLike[str], shard: int = 0) -> Header:
    """Return the parsed header of the GGUF file at ``path``.

    Raises:
        GGUFError: the file is missing, unreadable, or not a valid GGUF file.
    """
    path = Path(path)
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise GGUFError(f"cannot open the file: {exc.strerror or exc}", path=path) from exc
    with fh:
        st = os.fstat(fh.fileno())
        size = st.st_size
        if size < 24:
            _check_magic(fh.read(4), path)
            raise TruncatedError(f"the file is only {size} bytes; a GGUF header needs at least 24", path=path)
        try:
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise GGUFError(f"cannot map the file: {exc}", path=path) from exc
        with buf:
            return _Parser(buf, size, path, StatKey.of(st), shard).header()


def _check_magic(magic: bytes, path: Path) -> None:
    if magic != MAGIC:
        raise NotGGUFError(
            f"not a GGUF file (it starts with {magic[:4]!r}, not b'GGUF'); is this the right file?",
            path=path,
            offset=0,
        )


def read_header_prefix(data: bytes, file_size: int, path: str | os.PathLike[str], shard: int = 0) -> Header:
    """Return the header parsed from ``data``, the first bytes of a ``file_size``-byte GGUF file.

    ``path`` is where the file is said to be (errors name it); the header's ``LazyArray`` values
    read from that path, so they work once the prefix is written there.

    Raises:
        NeedMoreBytes: ``data`` ends before the tensor infos do.
        GGUFError: the bytes are not a valid GGUF header, or the header does not fit in ``file_size``.
    """
    path = Path(path)
    if file_size < 24:
        _check_magic(bytes(data[:4]), path)
        raise TruncatedError(f"the file is only {file_size} bytes; a GGUF header needs at least 24", path=path)
    if len(data) < 24:
        raise NeedMoreBytes(24, path=path, have=len(data))
    return _Parser(data, file_size, path, StatKey(file_size, 0, 0, 0), shard, avail=min(len(data), file_size)).header()


class _Parser:
    """One pass over a mapped header; ``off`` always points at the next unread byte.

    ``size`` is the file's size, ``avail`` how many of its first bytes ``buf`` holds (all of them for a
    local file); ``rest`` is the least the header still holds after the item being read.
    """

    def __init__(
        self, buf: bytes | mmap.mmap, size: int, path: Path, stat_key: StatKey, shard: int, avail: int | None = None
    ) -> None:
        self.buf = buf
        self.size = size
        self.avail = size if avail is None else avail
        self.path = path
        self.stat_key = stat_key
        self.shard = shard
        self.off = 0
        self.rest = 0

    # -- errors -------------------------------------------------------------
    def corrupt(self, message: str, offset: int | None = None) -> CorruptHeaderError:
        return CorruptHeaderError(message, path=self.path, offset=self.off if offset is None else offset)

    def need(self, end: int) -> None:
        """Raise ``NeedMoreBytes`` if the bytes up to ``end`` (within the file) are not in the buffer."""
        if end > self.avail:
            raise NeedMoreBytes(end + self.rest, path=self.path, have=self.avail)

    def need_before(self, end: int, bound: int) -> None:
        """``need(end)``, where the header is known to reach ``bound`` beyond it (a run of strings)."""
        if end > self.avail:
            raise NeedMoreBytes(bound + self.rest, path=self.path, have=self.avail)

    def truncated(self, what: str, offset: int) -> TruncatedError:
        return TruncatedError(
            f"the file ends inside {what} (it is {self.size} bytes); the download may be incomplete",
            path=self.path,
            offset=offset,
        )

    # -- header -------------------------------------------------------------
    def header(self) -> Header:
        buf = self.buf
        _check_magic(buf[:4], self.path)
        (version,) = _U32(buf, 4)
        if version not in SUPPORTED_VERSIONS:
            (as_big,) = struct.unpack_from(">I", buf, 4)
            if as_big in SUPPORTED_VERSIONS:
                raise UnsupportedVersionError(
                    "this is a big-endian GGUF file (made for s390x or similar); convert it to "
                    "little-endian to use it here",
                    path=self.path,
                    offset=4,
                )
            if version == 1:
                raise UnsupportedVersionError(
                    "GGUF version 1 (2023, 32-bit lengths) is not supported; re-convert the model "
                    "with a current llama.cpp",
                    path=self.path,
                    offset=4,
                )
            raise UnsupportedVersionError(
                f"unknown GGUF version {version}; this reader handles versions 2 and 3", path=self.path, offset=4
            )
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        self.off = 24
        # Each key/value needs at least 13 bytes and each tensor info 28: reject
        # counts the file cannot possibly hold before looping over them.
        if n_kv * 13 > self.size - 24:
            raise self.corrupt(f"the header claims {n_kv} metadata entries, more than the file can hold", 16)
        if n_tensors * 28 > self.size - 24:
            raise self.corrupt(f"the header claims {n_tensors} tensors, more than the file can hold", 8)
        if n_kv > MAX_KV:
            raise self.corrupt(f"the header claims {n_kv} metadata entries; no model has more than {MAX_KV}", 16)
        if n_tensors > MAX_TENSORS:
            raise self.corrupt(f"the header claims {n_tensors} tensors; no model has more than {MAX_TENSORS}", 8)
        metadata: dict[str, Any] = {}
        types: dict[str, tuple[int, ...]] = {}
        for i in range(n_kv):
            self.rest = 13 * (n_kv - i - 1) + 28 * n_tensors
            start = self.off
            key = self.string("a metadata key", MAX_KEY)
            if not key:
                raise self.corrupt("a metadata key is empty", start)
            if key in metadata:
                raise self.corrupt(f"metadata key {key!r} appears twice", start)
            vtype = self.u32("a value type")
            value, vtypes = self.value(vtype, key, 0)
            metadata[key] = value
            types[key] = vtypes
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if "general.alignment" in types and types["general.alignment"] != (UINT32,):
            raise self.corrupt("general.alignment must be a uint32 (llama.cpp refuses other types)")
        if alignment <= 0 or alignment & (alignment - 1):
            raise self.corrupt(f"general.alignment is {alignment!r}; it must be a power of two")
        infos, names = [], set()
        for i in range(n_tensors):
            self.rest = 28 * (n_tensors - i - 1)
            info = self.tensor_info()
            if info[0] in names:  # found as soon as it repeats: zeros read as tensor infos all say ""
                raise self.corrupt(f"tensor {info[0]!r} appears twice", info[4])
            names.add(info[0])
            infos.append(info)
        data_offset = -(-self.off // alignment) * alignment
        tensors = self.check_tensors(infos, data_offset, alignment)
        return Header(
            path=self.path,
            version=version,
            metadata=MappingProxyType(metadata),
            value_types=MappingProxyType(types),
            tensors=tensors,
            alignment=alignment,
            data_offset=data_offset,
            file_size=self.size,
            stat_key=self.stat_key,
        )

    # -- primitives ---------------------------------------------------------
    def u32(self, what: str) -> int:
        if self.off + 4 > self.size:
            raise self.truncated(what, self.off)
        self.need(self.off + 4)
        v: int
        (v,) = _U32(self.buf, self.off)
        self.off += 4
        return v

    def u64(self, what: str) -> int:
        if self.off + 8 > self.size:
            raise self.truncated(what, self.off)
        self.need(self.off + 8)
        v: int
        (v,) = _U64(self.buf, self.off)
        self.off += 8
        return v

    def string(self, what: str, limit: int = MAX_STRING) -> str:
        """The next string; its length is checked against the file and ``limit`` before any byte is copied."""
        start = self.off
        n = self.u64(what)
        end = self.off + n
        if end > self.size:
            raise TruncatedError(
                f"{what} claims {n} bytes but the file ends {self.size - self.off} bytes later; "
                "the file is truncated or corrupt",
                path=self.path,
                offset=start,
            )
        if n > limit:
            raise self.corrupt(f"{what} claims {n} bytes; at most {limit} are allowed", start)
        self.need(end)
        try:
            text = self.buf[self.off : end].decode("utf-8")
        except UnicodeDecodeError:
            raise self.corrupt(f"{what} is not valid UTF-8", start) from None
        self.off = end
        return text

    # -- values -------------------------------------------------------------
    def value(self, vtype: int, key: str, depth: int) -> tuple[Any, tuple[int, ...]]:
        if vtype in FIXED:
            fmt, n = FIXED[vtype]
            if self.off + n > self.size:
                raise self.truncated(f"the value of {key!r}", self.off)
            self.need(self.off + n)
            (v,) = struct.unpack_from("<" + fmt, self.buf, self.off)
            self.off += n
            return v, (vtype,)
        if vtype == STRING:
            return self.string(f"the value of {key!r}"), (STRING,)
        if vtype == ARRAY:
            return self.array(key, depth)
        raise self.corrupt(f"unknown value type {vtype} for key {key!r}", self.off - 4)

    def array(self, key: str, depth: int) -> tuple[Any, tuple[int, ...]]:
        if depth >= MAX_NESTING:
            raise self.corrupt(f"arrays in {key!r} are nested more than {MAX_NESTING} deep")
        start = self.off
        etype = self.u32(f"the array type of {key!r}")
        count = self.u64(f"the array length of {key!r}")
        remaining = self.size - self.off
        if etype in FIXED:
            fmt, n = FIXED[etype]
            if count * n > remaining:
                raise self.truncated(f"the {count}-element array {key!r}", start)
            self.need(self.off + count * n)
            if count > EAGER_NUMBERS:
                lazy = LazyArray(self.path, self.off, self.off + count * n, count, etype, self.stat_key)
                self.off += count * n
                return lazy, (ARRAY, etype)
            values = list(struct.unpack_from(f"<{count}{fmt}", self.buf, self.off))
            self.off += count * n
            return values, (ARRAY, etype)
        if etype == STRING:
            if count * 8 > remaining:
                raise self.truncated(f"the {count}-string array {key!r}", start)
            self.need(self.off + count * 8)
            if count > EAGER_STRINGS:
                first = self.off
                self.skip_strings(count, key)
                return LazyArray(self.path, first, self.off, count, STRING, self.stat_key), (ARRAY, STRING)
            return [self.string(f"an element of {key!r}") for _ in range(count)], (ARRAY, STRING)
        if etype == ARRAY:
            if count * 12 > remaining:
                raise self.truncated(f"the {count}-array array {key!r}", start)
            if count > MAX_INNER_ARRAYS:
                raise self.corrupt(
                    f"{key!r} holds {count} arrays; llama.cpp reads no arrays of arrays, and this "
                    f"reader at most {MAX_INNER_ARRAYS}",
                    start,
                )
            items = []
            inner_types = set()
            for _ in range(count):
                v, inner = self.array(key, depth + 1)
                items.append(v)
                inner_types.add(inner)
            # One shared inner type is recorded; mixed inner arrays record none.
            return items, (ARRAY, *inner_types.pop()) if len(inner_types) == 1 else (ARRAY, ARRAY)
        raise self.corrupt(f"unknown array element type {etype} in {key!r}", start)

    def skip_strings(self, count: int, key: str) -> None:
        if c_skip_strings is not None:
            end = c_skip_strings(self.buf, self.off, count)
            if end is None:
                if self.avail < self.size:
                    self.skip_strings_in_prefix(count, key)
                    return
                raise self.truncated(f"the string array {key!r}", self.off)
            self.off = end
            return
        if self.avail < self.size:
            self.skip_strings_in_prefix(count, key)
            return
        buf, off, size = self.buf, self.off, self.size
        match = _short_string_run().match
        try:
            while count >= _SKIP_CHUNK:
                m = match(buf, off)
                if m is not None:
                    off = m.end()
                else:  # a string of 256+ bytes in this run: step through it one by one
                    for _ in range(_SKIP_CHUNK):
                        off += 8 + _U64(buf, off)[0]
                count -= _SKIP_CHUNK
            for _ in range(count):
                off += 8 + _U64(buf, off)[0]
        except (struct.error, OverflowError):  # a length that points past the end
            raise self.truncated(f"the string array {key!r}", self.off) from None
        if off > size:
            raise self.truncated(f"the string array {key!r}", self.off)
        self.off = off

    def skip_strings_in_prefix(self, count: int, key: str) -> None:
        """Step through ``count`` strings one by one, so that the string the prefix ends in is known.

        With the C loop, the longest run of whole strings in the buffer is found first by bisection
        (each probe at memory speed), so only the last few strings are stepped through in Python.
        """
        buf, off, first = self.buf, self.off, 0
        if c_skip_strings is not None:
            lo, hi, lo_end = 0, count, off
            while lo < hi:
                mid = (lo + hi + 1) // 2
                end = c_skip_strings(buf, off, mid)
                if end is None or end > self.avail:
                    hi = mid - 1
                else:
                    lo, lo_end = mid, end
            first, off = lo, lo_end
        for i in range(first, count):
            after = 8 * (count - i - 1)  # the strings after this one take at least their lengths' bytes
            self.need_before(off + 8, off + 8 + after)
            (n,) = _U64(buf, off)
            if off + 8 + n > self.size:
                raise self.truncated(f"the string array {key!r}", self.off)
            self.need_before(off + 8 + n, off + 8 + n + after)
            off += 8 + n
        self.off = off

    # -- tensors ------------------------------------------------------------
    def tensor_info(self) -> _TensorRecord:
        start = self.off
        name = self.string("a tensor name", MAX_NAME - 1)  # ggml's limit
        n_dims = self.u32(f"the dimension count of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise self.corrupt(f"tensor {name!r} has {n_dims} dimensions; ggml allows at most {MAX_DIMS}", start)
        if self.off + 8 * n_dims + 12 > self.size:
            raise self.truncated(f"the info of tensor {name!r}", start)
        self.need(self.off + 8 * n_dims + 12)
        shape = struct.unpack_from(f"<{n_dims}Q", self.buf, self.off)
        self.off += 8 * n_dims
        ttype = self.u32(f"the type of tensor {name!r}")
        offset = self.u64(f"the offset of tensor {name!r}")
        return name, shape, ttype, offset, start

    def check_tensors(self, infos: list[_TensorRecord], data_offset: int, alignment: int) -> tuple[TensorInfo, ...]:
        data_size = self.size - data_offset
        out = []
        expected_offset = 0  # llama.cpp requires tensors packed in table order, each padded
        for name, shape, ttype, offset, start in infos:
            gtype = GGML_TYPES.get(ttype)
            if gtype is None:
                raise self.corrupt(
                    f"tensor {name!r} has unknown ggml type {ttype}; the file may need a newer llama.cpp", start
                )
            n = 1
            for d in shape:
                n *= d
            if n >= 1 << 62 or any(d >= 1 << 62 for d in shape):
                raise self.corrupt(f"tensor {name!r} has an impossible shape {list(shape)}", start)
            if shape and shape[0] % gtype.block_size:
                raise self.corrupt(
                    f"tensor {name!r} has {shape[0]} columns, not a multiple of the {gtype.name} block "
                    f"size {gtype.block_size}",
                    start,
                )
            nbytes = gtype.nbytes(n)
            if offset != expected_offset:
                raise self.corrupt(
                    f"tensor {name!r} has data offset {offset}, but the tensors before it end at "
                    f"{expected_offset}; llama.cpp refuses such files",
                    start,
                )
            expected_offset += -(-nbytes // alignment) * alignment
            if offset + nbytes > data_size:
                raise TruncatedError(
                    f"tensor {name!r} needs bytes up to {data_offset + offset + nbytes}, but the file has "
                    f"{self.size}; the download is incomplete or the file is corrupt",
                    path=self.path,
                    offset=start,
                )
            out.append(TensorInfo(name, tuple(shape), gtype, offset, nbytes, self.shard))
        return tuple(out)
