"""The GGUF reader on real files, and on every kind of broken file we could think of."""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gguf
from gguf.errors import CorruptHeaderError, MissingShardError, NotGGUFError, TruncatedError, UnsupportedVersionError
from gguf.reader import ARRAY, BOOL, FLOAT32, FLOAT64, INT8, INT16, INT32, INT64, STRING, UINT8, UINT16, UINT32, UINT64

# --- a tiny byte-level builder, independent of gguf.writer, for hand-made bad files ---


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def header(
    kvs: list[bytes], tensors: list[bytes] = (), version: int = 3, n_kv: int | None = None, n_tensors: int | None = None
) -> bytes:
    n_kv = len(kvs) if n_kv is None else n_kv
    n_tensors = len(tensors) if n_tensors is None else n_tensors
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + b"".join(kvs) + b"".join(tensors)


def tensor(name: str, shape: tuple[int, ...], ttype: int = 0, offset: int = 0) -> bytes:
    return (
        s(name)
        + struct.pack("<I", len(shape))
        + struct.pack(f"<{len(shape)}Q", *shape)
        + struct.pack("<IQ", ttype, offset)
    )


def pad_to(data: bytes, alignment: int = 32) -> bytes:
    return data + b"\0" * (-len(data) % alignment)


EVERY_TYPE = [
    kv("t.u8", UINT8, struct.pack("<B", 200)),
    kv("t.i8", INT8, struct.pack("<b", -5)),
    kv("t.u16", UINT16, struct.pack("<H", 60000)),
    kv("t.i16", INT16, struct.pack("<h", -300)),
    kv("t.u32", UINT32, struct.pack("<I", 4_000_000_000)),
    kv("t.i32", INT32, struct.pack("<i", -70000)),
    kv("t.f32", FLOAT32, struct.pack("<f", 0.5)),
    kv("t.bool", BOOL, b"\x01"),
    kv("t.str", STRING, s("héllo")),
    kv("t.u64", UINT64, struct.pack("<Q", 2**63)),
    kv("t.i64", INT64, struct.pack("<q", -(2**40))),
    kv("t.f64", FLOAT64, struct.pack("<d", 1e300)),
    kv("t.arr", ARRAY, struct.pack("<IQ", INT32, 3) + struct.pack("<3i", 1, -2, 3)),
    kv("t.strs", ARRAY, struct.pack("<IQ", STRING, 2) + s("a") + s("bc")),
    kv(
        "t.nested",
        ARRAY,
        struct.pack("<IQ", ARRAY, 2)
        + struct.pack("<IQ", UINT8, 2)
        + b"\x01\x02"
        + struct.pack("<IQ", UINT8, 1)
        + b"\x03",
    ),
]


def small_model() -> bytes:
    """A valid file: every value type, two F32 tensors."""
    head = header(EVERY_TYPE, [tensor("a", (8,)), tensor("b", (4, 2), offset=32)])
    return pad_to(head) + b"\x11" * 32 + b"\x22" * 32


def write(tmp_path: Path, data: bytes, name: str = "m.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


# --- valid files -------------------------------------------------------------------


def test_every_value_type_reads_back(tmp_path):
    f = gguf.read(write(tmp_path, small_model()), cache=False)
    m = f.metadata
    assert (m["t.u8"], m["t.i8"], m["t.u16"], m["t.i16"]) == (200, -5, 60000, -300)
    assert (m["t.u32"], m["t.i32"], m["t.f32"], m["t.bool"]) == (4_000_000_000, -70000, 0.5, True)
    assert (m["t.str"], m["t.u64"], m["t.i64"], m["t.f64"]) == ("héllo", 2**63, -(2**40), 1e300)
    assert m["t.arr"] == [1, -2, 3] and m["t.strs"] == ["a", "bc"] and m["t.nested"] == [[1, 2], [3]]
    assert f.shards[0].value_types["t.nested"] == (ARRAY, ARRAY, UINT8)
    assert [(t.name, t.shape, t.n_bytes) for t in f.tensors] == [("a", (8,), 32), ("b", (4, 2), 32)]
    assert f.shards[0].data_offset % 32 == 0 and f.version == 3


def test_scalar_and_empty_tensors_are_accepted_like_llama_cpp(tmp_path):
    data = pad_to(header([], [s("scalar") + struct.pack("<IIQ", 0, 0, 0), tensor("empty", (32, 0), offset=32)]))
    f = gguf.read(write(tmp_path, data + b"\0" * 32), cache=False)
    assert [(t.shape, t.n_elements, t.n_bytes) for t in f.tensors] == [((), 1, 4), ((32, 0), 0, 0)]


def test_version_2_reads_like_3(tmp_path):
    data = bytearray(small_model())
    data[4:8] = struct.pack("<I", 2)
    assert gguf.read(write(tmp_path, bytes(data)), cache=False).version == 2


def test_gemma_header(gemma_model):
    f = gguf.read(gemma_model, cache=False)
    assert f.metadata["general.architecture"] == "gemma3"
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 262144
    assert f.metadata["tokenizer.ggml.tokens"][2] == "<bos>"
    assert len(f.tensors) > 100
    # Every tensor's bytes end inside the file, and the data section is exactly what they need (+padding).
    last = max(f.tensors, key=lambda t: t.offset)
    assert f.shards[0].data_offset + last.offset + last.n_bytes <= f.file_size
    assert f.file_size - f.shards[0].data_offset - f.tensor_bytes < 32 * len(f.tensors)


@pytest.mark.parametrize("name, n_tokens", [("ggml-vocab-qwen2.gguf", 151936), ("ggml-vocab-gemma-4.gguf", 262144)])
def test_large_vocab_arrays_are_lazy_and_decode_on_demand(llama_src, name, n_tokens):
    f = gguf.read(llama_src / "models" / name, cache=False)
    tokens = f.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, gguf.LazyArray) and len(tokens) == n_tokens
    assert all(isinstance(t, str) for t in tokens.values)
    merges = f.metadata["tokenizer.ggml.merges"]
    assert " " in merges[0]


@pytest.fixture(params=["c", "python"])
def skip_path(request, monkeypatch):
    """Run a test with the C string skipper and with the pure-Python fallback."""
    from gguf import reader

    if request.param == "python":
        monkeypatch.setattr(reader, "c_skip_strings", None)
    else:
        assert reader.c_skip_strings is not None, "the C accelerator was not built by `pip install -e .`"
    return request.param


@pytest.mark.parametrize("name", ["ggml-vocab-qwen2.gguf", "ggml-vocab-gemma-4.gguf", "ggml-vocab-llama-spm.gguf"])
def test_c_and_python_string_skipping_agree(llama_src, name, monkeypatch):
    from gguf import reader

    path = llama_src / "models" / name
    fast = gguf.read(path, cache=False)
    monkeypatch.setattr(reader, "c_skip_strings", None)
    slow = gguf.read(path, cache=False)
    assert fast.shards[0].data_offset == slow.shards[0].data_offset
    for key, value in fast.metadata.items():
        other = slow.metadata[key]
        if isinstance(value, gguf.LazyArray):
            assert (value.offset, value.end, value.count) == (other.offset, other.end, other.count), key
        else:
            assert value == other, key


def test_long_strings_in_a_big_array_take_the_slow_step(tmp_path, skip_path):
    words = [("w" * (i % 700)) for i in range(5000)]  # lengths past 255 break the regex's fast runs
    big = kv("v.words", ARRAY, struct.pack("<IQ", STRING, len(words)) + b"".join(s(w) for w in words))
    f = gguf.read(write(tmp_path, header([big, kv("v.after", UINT8, b"\x07")])), cache=False)
    assert list(f.metadata["v.words"]) == words and f.metadata["v.after"] == 7


def test_cache_returns_the_same_object_until_the_file_changes(tmp_path):
    p = write(tmp_path, small_model())
    first = gguf.read(p)
    assert gguf.read(p) is first
    data = bytearray(small_model())
    data[data.index(b"h\xc3\xa9llo")] = ord("j")
    p.write_bytes(bytes(data))
    os.utime(p, ns=(1, 1))  # a different mtime even on coarse-clock file systems
    again = gguf.read(p)
    assert again is not first and again.metadata["t.str"] == "jéllo"


def test_a_second_link_to_a_cached_file_reads_as_its_own_path_not_the_firsts(tmp_path):
    """The cache was keyed by the link's target and kept the first path: a model read through a second link
    named the first one, so a studio launched llama-server through another studio's link to the same file."""
    target = write(tmp_path, small_model())
    first, second = tmp_path / "a" / "one.gguf", tmp_path / "b" / "two.gguf"
    for link in (first, second):
        link.parent.mkdir()
        link.symlink_to(target)
    assert gguf.read(first).path == first
    assert gguf.read(second).path == second
    assert gguf.read(first).path == first


def test_lazy_array_refuses_a_file_changed_underneath(tmp_path):
    big = kv("v.tokens", ARRAY, struct.pack("<IQ", STRING, 100) + b"".join(s(f"tok{i}") for i in range(100)))
    p = write(tmp_path, header([big]))
    tokens = gguf.read(p, cache=False).metadata["v.tokens"]
    p.write_bytes(header([big]) + b"more")
    with pytest.raises(gguf.GGUFError, match="changed"):
        _ = tokens.values


# --- shards ------------------------------------------------------------------------


def shard(index: int, count: int, tensors: list[tuple[str, int]]) -> bytes:
    kvs = [
        kv("general.architecture", STRING, s("llama")),
        kv("split.no", UINT16, struct.pack("<H", index)),
        kv("split.count", UINT16, struct.pack("<H", count)),
    ]
    infos, off = [], 0
    for name, n in tensors:
        infos.append(tensor(name, (n,), offset=off))
        off += -(-n * 4 // 32) * 32
    return pad_to(header(kvs, infos)) + b"\0" * off


def test_shards_are_found_and_aggregated_from_any_shard(tmp_path):
    for i in range(3):
        write(tmp_path, shard(i, 3, [(f"t{i}", 8 * (i + 1))]), f"m-{i + 1:05d}-of-00003.gguf")
    f = gguf.read(tmp_path / "m-00002-of-00003.gguf", cache=False)
    assert len(f.shards) == 3 and f.path.name == "m-00001-of-00003.gguf"
    assert [(t.name, t.shard) for t in f.tensors] == [("t0", 0), ("t1", 1), ("t2", 2)]
    assert f.tensor_bytes == 4 * (8 + 16 + 24)


def test_missing_shards_are_named(tmp_path):
    write(tmp_path, shard(0, 3, [("t0", 8)]), "m-00001-of-00003.gguf")
    with pytest.raises(MissingShardError) as info:
        gguf.read(tmp_path / "m-00001-of-00003.gguf")
    assert info.value.missing == ["m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]
    assert "m-00003-of-00003.gguf" in str(info.value)


def test_shard_whose_split_no_disagrees_with_its_name(tmp_path):
    write(tmp_path, shard(0, 2, [("t0", 8)]), "m-00001-of-00002.gguf")
    write(tmp_path, shard(0, 2, [("t1", 8)]), "m-00002-of-00002.gguf")
    with pytest.raises(CorruptHeaderError, match="split.no"):
        gguf.read(tmp_path / "m-00001-of-00002.gguf", cache=False)


# --- hand-made bad files -----------------------------------------------------------

BAD_FILES = {
    "empty": (b"", NotGGUFError, "not a GGUF file"),
    "text": (b"<html>404 Not Found</html>" * 4, NotGGUFError, "not a GGUF file"),
    "magic only": (b"GGUF", TruncatedError, "only 4 bytes"),
    "version 1": (b"GGUF" + struct.pack("<IIIQ", 1, 0, 0, 0), UnsupportedVersionError, "version 1"),
    "version 99": (b"GGUF" + struct.pack("<IQQ", 99, 0, 0), UnsupportedVersionError, "unknown GGUF version 99"),
    "big endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), UnsupportedVersionError, "big-endian"),
    "huge kv count": (b"GGUF" + struct.pack("<IQQ", 3, 0, 2**62), CorruptHeaderError, "metadata entries"),
    "huge tensor count": (b"GGUF" + struct.pack("<IQQ", 3, 2**60, 0), CorruptHeaderError, "tensors"),
    "string of 2^63 bytes": (header([kv("k", STRING, struct.pack("<Q", 2**63))]), TruncatedError, "claims"),
    "key of 2^63 bytes": (header([struct.pack("<Q", 2**63) + b"x" * 32]), TruncatedError, "claims"),
    "array of 2^60 u8": (header([kv("k", ARRAY, struct.pack("<IQ", UINT8, 2**60))]), TruncatedError, "array"),
    "array of 2^60 strings": (header([kv("k", ARRAY, struct.pack("<IQ", STRING, 2**60))]), TruncatedError, "array"),
    "array of 2^60 arrays": (header([kv("k", ARRAY, struct.pack("<IQ", ARRAY, 2**60))]), TruncatedError, "array"),
    "long string array past the end": (
        header([kv("k", ARRAY, struct.pack("<IQ", STRING, 5000) + s("x") * 4000)]),
        TruncatedError,
        "string array",
    ),
    "string array with a 2^63 length inside": (
        header(
            [
                kv(
                    "k",
                    ARRAY,
                    struct.pack("<IQ", STRING, 3000) + s("x") * 2000 + struct.pack("<Q", 2**63) + s("y") * 1500,
                )
            ]
        ),
        TruncatedError,
        "string array",
    ),
    "unknown value type": (header([kv("k", 13, b"\0" * 8)]), CorruptHeaderError, "unknown value type 13"),
    "unknown array type": (header([kv("k", ARRAY, struct.pack("<IQ", 77, 1))]), CorruptHeaderError, "element type 77"),
    "invalid utf-8 key": (header([kv(b"\xff\xfe", UINT8, b"\0")]), CorruptHeaderError, "UTF-8"),
    "invalid utf-8 value": (header([kv("k", STRING, s(b"\xc3\x28"))]), CorruptHeaderError, "UTF-8"),
    "duplicate key": (header([kv("k", UINT8, b"\0"), kv("k", UINT8, b"\1")]), CorruptHeaderError, "twice"),
    "deep nesting": (header([kv("k", ARRAY, struct.pack("<IQ", ARRAY, 1) * 20)]), CorruptHeaderError, "nested"),
    "alignment zero": (
        header([kv("general.alignment", UINT32, struct.pack("<I", 0))]),
        CorruptHeaderError,
        "power of two",
    ),
    "alignment 2^31+1": (
        header([kv("general.alignment", UINT32, struct.pack("<I", 2**31 + 1))]),
        CorruptHeaderError,
        "power of two",
    ),
    "alignment three": (
        header([kv("general.alignment", UINT32, struct.pack("<I", 3))]),
        CorruptHeaderError,
        "power of two",
    ),
    "alignment as string": (header([kv("general.alignment", STRING, s("32"))]), CorruptHeaderError, "uint32"),
    "unknown tensor type": (
        pad_to(header([], [tensor("w", (32,), ttype=99)])) + b"\0" * 128,
        CorruptHeaderError,
        "unknown ggml type 99",
    ),
    "removed tensor type": (
        pad_to(header([], [tensor("w", (32,), ttype=4)])) + b"\0" * 128,
        CorruptHeaderError,
        "unknown ggml type 4",
    ),
    "five dims": (pad_to(header([], [tensor("w", (1, 1, 1, 1, 1))])), CorruptHeaderError, "dimensions"),
    "long tensor name": (pad_to(header([], [tensor("w" * 64, (8,))])) + b"\0" * 32, CorruptHeaderError, "63"),
    "empty key": (header([kv("", UINT8, b"\0")]) + b"\0" * 16, CorruptHeaderError, "empty"),
    "alignment as int32": (
        header([kv("general.alignment", INT32, struct.pack("<i", 64))]),
        CorruptHeaderError,
        "uint32",
    ),
    "tensors out of order": (
        pad_to(header([], [tensor("a", (8,), offset=32), tensor("b", (8,))])) + b"\0" * 64,
        CorruptHeaderError,
        "end at 0",
    ),
    "huge dims": (pad_to(header([], [tensor("w", (2**40, 2**40))])), CorruptHeaderError, "shape"),
    "q4_0 row not a block multiple": (
        pad_to(header([], [tensor("w", (33,), ttype=2)])) + b"\0" * 64,
        CorruptHeaderError,
        "block size 32",
    ),
    "tensor past the end": (pad_to(header([], [tensor("w", (1024,))])) + b"\0" * 64, TruncatedError, "incomplete"),
    "tensor offset past the end": (
        pad_to(header([], [tensor("w", (8,), offset=2**62)])),
        CorruptHeaderError,
        "end at 0",
    ),
    "misaligned tensor": (
        pad_to(header([], [tensor("w", (8,), offset=4)])) + b"\0" * 64,
        CorruptHeaderError,
        "end at 0",
    ),
    "duplicate tensor": (
        pad_to(header([], [tensor("w", (8,)), tensor("w", (8,), offset=32)])) + b"\0" * 64,
        CorruptHeaderError,
        "twice",
    ),
    "kv count larger than present": (header([kv("k", UINT8, b"\0")], n_kv=3) + b"\0" * 40, gguf.GGUFError, ""),
    # lengths and counts that fit in the file but no real one has: refused before they are read or looped over
    "key of 70,000 bytes": (header([kv("k" * 70_000, UINT8, b"\0")]), CorruptHeaderError, "at most 65536"),
    "tensor name of 10,000 bytes": (
        pad_to(header([], [tensor("w" * 10_000, (8,))])) + b"\0" * 32,
        CorruptHeaderError,
        "at most 63",
    ),
    "4097 arrays in an array": (
        header([kv("k", ARRAY, struct.pack("<IQ", ARRAY, 4097) + struct.pack("<IQ", UINT8, 0) * 4097)]),
        CorruptHeaderError,
        "at most 4096",
    ),
    "65,537 metadata entries": (
        b"GGUF" + struct.pack("<IQQ", 3, 0, 65_537) + b"\0" * (13 * 65_537),
        CorruptHeaderError,
        "no model has more than 65536",
    ),
    "262,145 tensors": (
        b"GGUF" + struct.pack("<IQQ", 3, 262_145, 0) + b"\0" * (28 * 262_145),
        CorruptHeaderError,
        "no model has more than 262144",
    ),
    "zeros read as tensor infos": (
        b"GGUF" + struct.pack("<IQQ", 3, 100_000, 0) + b"\0" * (28 * 100_000),
        CorruptHeaderError,
        "(byte 48): tensor '' appears twice",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_file_raises_one_clear_error(tmp_path, case, skip_path):
    data, error, words = BAD_FILES[case]
    path = write(tmp_path, data)
    with pytest.raises(error) as info:
        gguf.read(path, cache=False)
    assert words in str(info.value)
    assert str(path) in str(info.value)
    assert isinstance(info.value, gguf.GGUFError)


def test_truncation_at_every_byte_is_a_gguf_error(tmp_path):
    data = small_model()
    path = tmp_path / "t.gguf"
    for cut in range(len(data)):
        path.write_bytes(data[:cut])
        with pytest.raises(gguf.GGUFError) as info:
            gguf.read(path, cache=False)
        assert info.value.offset is None or 0 <= info.value.offset <= cut, cut


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(gguf.GGUFError, match="cannot open"):
        gguf.read(tmp_path / "nope.gguf")
    with pytest.raises(gguf.GGUFError):
        gguf.read(tmp_path)


# --- fuzzing real headers ------------------------------------------------------------

_REAL_HEADERS: dict[str, tuple[bytes, int]] = {}


def _real_header(path: Path) -> tuple[bytes, int]:
    """The header bytes of a real file and its full size (the data is replaced by a hole)."""
    key = str(path)
    if key not in _REAL_HEADERS:
        f = gguf.read(path, cache=False)
        with path.open("rb") as fh:
            _REAL_HEADERS[key] = (fh.read(f.shards[0].data_offset), f.file_size)
    return _REAL_HEADERS[key]


mutations = st.lists(
    st.tuples(st.one_of(st.integers(0, 4096), st.integers(0, 2**31)), st.integers(0, 255)),
    min_size=1,
    max_size=8,
)


def _fuzz(head: bytes, size: int, edits: list[tuple[int, int]], cut: int | None) -> None:
    """Mutate ``head`` (then pad it to ``size`` with a hole, or cut it); reading it, its
    lazy arrays and its facts may raise GGUFError and nothing else."""
    data = bytearray(head)
    for pos, value in edits:
        data[pos % len(data)] = value
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "fuzz.gguf"
        with target.open("wb") as fh:
            fh.write(data)
            if cut is None:
                fh.truncate(size)  # a sparse hole where the tensor data was
        try:
            f = gguf.read(target, cache=False)
            _ = f.facts
            for value in f.metadata.values():
                if isinstance(value, gguf.LazyArray):
                    _ = value.values
        except gguf.GGUFError:
            pass


fuzz_cuts = st.one_of(st.none(), st.integers(0, 2**31))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=mutations, cut=fuzz_cuts)
def test_fuzzed_gemma_header_raises_only_gguf_errors(gemma_model, edits, cut):
    _fuzz(*_real_header(gemma_model), edits, cut)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=mutations, cut=fuzz_cuts)
def test_fuzzed_vocab_header_raises_only_gguf_errors(llama_src, edits, cut):
    _fuzz(*_real_header(llama_src / "models" / "ggml-vocab-qwen2.gguf"), edits, cut)


@settings(max_examples=300, deadline=None)
@given(edits=mutations, cut=fuzz_cuts)
def test_fuzzed_small_model_raises_only_gguf_errors(edits, cut):
    data = small_model()
    _fuzz(data, len(data), edits, cut)
