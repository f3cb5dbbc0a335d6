"""The GGUF writer: every value type and several ggml types round-trip through the reader,
and a rewritten real Gemma is byte-identical in its tensors and still serves."""

from __future__ import annotations

import hashlib
import os
import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import gguf
from gguf.reader import (
    ARRAY,
    BOOL,
    FLOAT32,
    FLOAT64,
    INT8,
    INT16,
    INT32,
    INT64,
    STRING,
    UINT8,
    UINT16,
    UINT32,
    UINT64,
    VALUE_TYPE_NAMES,
    LazyArray,
)
from gguf.writer import FileRegion, TensorToWrite, copy_of, infer_type, rewrite, write_gguf
from launcher.process import LlamaServer
from tests.helpers import free_port, server_argv

EXTREMES: dict[int, tuple[Any, Any]] = {
    UINT8: (0, 255),
    INT8: (-128, 127),
    UINT16: (0, 65535),
    INT16: (-32768, 32767),
    UINT32: (0, 2**32 - 1),
    INT32: (-(2**31), 2**31 - 1),
    UINT64: (0, 2**64 - 1),
    INT64: (-(2**63), 2**63 - 1),
    FLOAT32: (-1.5, 2.0**127),
    FLOAT64: (-1e308, 0.1),
    BOOL: (False, True),
}


def every_type() -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """One key per value type, as a scalar and as an array, plus the awkward arrays."""
    values: dict[str, Any] = {}
    types: dict[str, tuple[int, ...]] = {}

    def put(key: str, value: Any, vtype: tuple[int, ...]) -> None:
        values[key], types[key] = value, vtype

    for vtype, (lo, hi) in EXTREMES.items():
        name = VALUE_TYPE_NAMES[vtype]
        put(f"scalar.{name}", hi, (vtype,))
        put(f"scalar.{name}.min", lo, (vtype,))
        put(f"array.{name}", [lo, hi, lo], (ARRAY, vtype))
        put(f"empty.{name}", [], (ARRAY, vtype))
    put("scalar.string", "héllo wörld ✓ 🦙 日本語", (STRING,))
    put("scalar.string.empty", "", (STRING,))
    put("array.string", ["", "a", "ünï", "🦙" * 300], (ARRAY, STRING))
    put("empty.string", [], (ARRAY, STRING))
    put("nested.int16", [[1, -2], [], [3]], (ARRAY, ARRAY, INT16))
    put("nested.string", [["a"], ["b", "ç"]], (ARRAY, ARRAY, STRING))
    put("nested.deep", [[[1.5]], [[2.5, -3.5], []]], (ARRAY, ARRAY, ARRAY, FLOAT64))
    put("nested.empty", [], (ARRAY, ARRAY))
    # Longer than the reader's eager limits: these come back as LazyArray.
    put("big.float32", [i * 0.25 for i in range(6000)], (ARRAY, FLOAT32))
    put("big.uint64", [i * 2**40 for i in range(5001)], (ARRAY, UINT64))
    put("big.string", [f"tok{i}·{'x' * (i % 300)}" for i in range(6000)], (ARRAY, STRING))
    put("nested.big", [list(range(5000)), [7]], (ARRAY, ARRAY, INT32))
    return values, types


def plain(value: Any) -> Any:
    """``value`` with every LazyArray decoded, for comparing."""
    if isinstance(value, (list, tuple, LazyArray)):
        return [plain(v) for v in value]
    return value


def some_tensors(seed: int = 0) -> list[TensorToWrite]:
    rng = random.Random(seed)
    shapes = [
        ("f32", (4, 3), "F32"),
        ("f16", (8,), "F16"),
        ("q4_0", (64, 2), "Q4_0"),
        ("q8_0", (32, 3, 2), "Q8_0"),
        ("q4_k", (256, 2), "Q4_K"),
        ("blk.0.attn_q.weight", (512, 1, 1, 2), "Q6_K"),
    ]
    out = []
    for name, shape, kind in shapes:
        n_bytes = TensorToWrite(name, shape, kind).n_bytes
        out.append(TensorToWrite(name, shape, kind, rng.randbytes(n_bytes)))
    return out


def region(header: gguf.Header, info: gguf.TensorInfo) -> bytes:
    with header.path.open("rb") as fh:
        fh.seek(header.data_offset + info.offset)
        return fh.read(info.n_bytes)


def check_layout(header: gguf.Header) -> None:
    """What llama.cpp insists on: aligned data section, each tensor right after the padded previous one."""
    assert header.data_offset % header.alignment == 0
    expected = 0
    for t in header.tensors:
        assert t.offset == expected, t.name
        expected += -(-t.n_bytes // header.alignment) * header.alignment
    assert header.file_size == header.data_offset + expected


# --- round trips -------------------------------------------------------------------


@pytest.mark.parametrize(("alignment", "version"), [(32, 3), (64, 3), (32, 2), (256, 2)])
def test_every_value_type_and_tensor_round_trips(tmp_path, alignment, version):
    values, types = every_type()
    tensors = some_tensors()
    path = write_gguf(tmp_path / "m.gguf", values, tensors, value_types=types, alignment=alignment, version=version)
    header = gguf.read(path, cache=False).shards[0]

    assert header.version == version
    assert header.alignment == alignment
    expected = dict(values)
    if alignment != 32:
        expected["general.alignment"] = alignment
        types = {**types, "general.alignment": (UINT32,)}
    assert list(header.metadata) == list(expected)
    assert dict(header.value_types) == types
    for key, value in expected.items():  # every float32 value here is exact in float32
        assert plain(header.metadata[key]) == plain(value), key
    for key in ("big.float32", "big.uint64", "big.string"):
        assert isinstance(header.metadata[key], LazyArray)

    assert [(t.name, t.shape, t.ggml_type.name, t.n_bytes) for t in header.tensors] == [
        (t.name, t.shape, t.gtype.name, t.n_bytes) for t in tensors
    ]
    check_layout(header)
    for info, tensor in zip(header.tensors, tensors, strict=False):
        assert region(header, info) == tensor.data


def test_rewriting_is_byte_identical_and_copies_lazy_arrays_raw(tmp_path):
    values, types = every_type()
    first = write_gguf(tmp_path / "a.gguf", values, some_tensors(), value_types=types, alignment=64)
    second = rewrite(first, tmp_path / "b.gguf")
    assert second.read_bytes() == first.read_bytes()
    # The same again straight from the reader's metadata (LazyArray values included).
    header = gguf.read(first, cache=False).shards[0]
    third = write_gguf(tmp_path / "c.gguf", header.metadata, some_tensors(), value_types=header.value_types)
    assert third.read_bytes() == first.read_bytes()


def test_rewrite_edits_and_drops_keys_keeping_types(tmp_path):
    src = write_gguf(
        tmp_path / "a.gguf",
        {"general.name": "old", "n": 7, "gone": 1.5, "general.alignment": 64},
        some_tensors(),
        value_types={"n": (UINT16,)},
    )
    out = rewrite(
        src, tmp_path / "b.gguf", metadata_updates={"n": 9, "new.key": [1, 2]}, drop_keys=["gone", "general.alignment"]
    )
    header = gguf.read(out, cache=False).shards[0]
    assert dict(header.metadata) == {"general.name": "old", "n": 9, "new.key": [1, 2]}
    assert dict(header.value_types) == {"general.name": (STRING,), "n": (UINT16,), "new.key": (ARRAY, INT32)}
    assert header.alignment == 32
    check_layout(header)
    before = gguf.read(src, cache=False).shards[0]
    assert [region(header, t) for t in header.tensors] == [region(before, t) for t in before.tensors]


def test_rewrite_in_place(tmp_path):
    src = write_gguf(tmp_path / "a.gguf", {"k": "v"}, some_tensors())
    rewrite(src, src, metadata_updates={"k": "w"})
    header = gguf.read(src, cache=False).shards[0]
    assert header.metadata["k"] == "w"
    assert [region(header, t) for t in header.tensors] == [t.data for t in some_tensors()]
    assert [p.name for p in tmp_path.iterdir()] == ["a.gguf"]  # no temp file left


def test_inferred_types(tmp_path):
    values = {
        "int": 1,
        "neg": -5,
        "i64": 2**40,
        "u64": 2**63,
        "float": 0.5,
        "bool": True,
        "str": "x",
        "ints": [1, 2**40],
        "mixed": [1, 0.5],
        "bools": [True],
        "strs": ["a"],
        "empty": [],
        "nested": [[1], [2]],
        "tuple": (1, 2),
    }
    path = write_gguf(tmp_path / "m.gguf", values)
    header = gguf.read(path, cache=False).shards[0]
    assert dict(header.value_types) == {
        "int": (INT32,),
        "neg": (INT32,),
        "i64": (INT64,),
        "u64": (UINT64,),
        "float": (FLOAT32,),
        "bool": (BOOL,),
        "str": (STRING,),
        "ints": (ARRAY, INT64),
        "mixed": (ARRAY, FLOAT32),
        "bools": (ARRAY, BOOL),
        "strs": (ARRAY, STRING),
        "empty": (ARRAY, INT32),
        "nested": (ARRAY, ARRAY, INT32),
        "tuple": (ARRAY, INT32),
    }
    assert plain(header.metadata["mixed"]) == [1.0, 0.5]
    assert infer_type(-(2**31)) == (INT32,) and infer_type(2**31) == (INT64,)


def test_inner_arrays_each_keep_their_own_type(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", {"k": [[1, 2], ["a"], [0.5]]})
    assert plain(gguf.read(path, cache=False).metadata["k"]) == [[1, 2], ["a"], [0.5]]


def test_alignment_key_is_uint32_and_must_agree(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", {"general.alignment": 128}, some_tensors())
    header = gguf.read(path, cache=False).shards[0]
    assert header.value_types["general.alignment"] == (UINT32,) and header.alignment == 128
    check_layout(header)
    with pytest.raises(ValueError, match="alignment"):
        write_gguf(tmp_path / "x.gguf", {"general.alignment": 64}, alignment=32)
    with pytest.raises(ValueError, match="power of two"):
        write_gguf(tmp_path / "x.gguf", {}, alignment=48)


def test_zero_tensors_are_holes_and_read_as_zeros(tmp_path):
    big = TensorToWrite("token_embd.weight", (4096, 32000), "Q4_K")
    path = write_gguf(tmp_path / "big.gguf", {"general.architecture": "llama"}, [big, *some_tensors()])
    header = gguf.read(path, cache=False).shards[0]
    assert header.tensors[0].n_bytes == 4096 * 32000 // 256 * 144
    check_layout(header)
    assert region(header, header.tensors[0])[-4096:] == bytes(4096)
    assert region(header, header.tensors[-1]) == some_tensors()[-1].data


def test_file_region_tensors_are_copied(tmp_path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(os.urandom(1000))
    path = write_gguf(tmp_path / "m.gguf", {}, [TensorToWrite("t", (64,), "F32", FileRegion(blob, 100, 256))])
    header = gguf.read(path, cache=False).shards[0]
    assert region(header, header.tensors[0]) == blob.read_bytes()[100:356]
    with pytest.raises(gguf.TruncatedError):
        write_gguf(tmp_path / "n.gguf", {}, [TensorToWrite("t", (256,), "F32", FileRegion(blob, 0, 1024))])
    assert not (tmp_path / "n.gguf").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blob.bin", "m.gguf"]


def test_a_changed_source_is_refused(tmp_path):
    values, types = every_type()
    src = write_gguf(tmp_path / "a.gguf", values, some_tensors(), value_types=types)
    header = gguf.read(src, cache=False).shards[0]
    os.utime(src, ns=(0, 0))
    with pytest.raises(gguf.GGUFError, match="changed"):
        write_gguf(tmp_path / "b.gguf", header.metadata, value_types=header.value_types)
    copies = [copy_of(header, t) for t in header.tensors]
    with pytest.raises(gguf.GGUFError, match="changed"):
        write_gguf(tmp_path / "b.gguf", {}, copies)
    assert not (tmp_path / "b.gguf").exists()


@pytest.mark.parametrize(
    ("value", "vtype", "error"),
    [
        (256, (UINT8,), ValueError),
        (-1, (UINT64,), ValueError),
        (1e39, (FLOAT32,), ValueError),
        ("x", (INT32,), ValueError),
        (5, (STRING,), TypeError),
        ([1, 2], (ARRAY, STRING), TypeError),
        (["\ud800"], (ARRAY, STRING), ValueError),
        (7, (ARRAY, INT32), TypeError),
        (1, (13,), ValueError),
    ],
)
def test_values_that_do_not_fit_their_type_name_the_key(tmp_path, value, vtype, error):
    with pytest.raises(error, match="'the.key'"):
        write_gguf(tmp_path / "m.gguf", {"the.key": value}, value_types={"the.key": vtype})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", [{"a": 1}, None, b"raw", [1, "a"], 2**64])
def test_values_without_a_gguf_type_are_refused(tmp_path, value):
    with pytest.raises((TypeError, ValueError), match="'k'"):
        write_gguf(tmp_path / "m.gguf", {"k": value})


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("t", (100,), "Q4_0", bytes(100)), "multiple of the Q4_0 block size 32"),
        (("t", (32,), "Q4_0", bytes(17)), "needs 18 bytes, not 17"),
        (("t", (), "F32"), "1 to 4 positive dims"),
        (("t", (1, 1, 1, 1, 1), "F32"), "1 to 4 positive dims"),
        (("t", (0,), "F32"), "1 to 4 positive dims"),
        (("x" * 64, (1,), "F32"), "64 bytes or longer"),
        (("t", (1,), "Q9_9"), "unknown ggml type"),
    ],
)
def test_bad_tensors_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        TensorToWrite(*args)


def test_duplicate_tensor_names_and_bad_versions_are_refused(tmp_path):
    t = TensorToWrite("t", (1,), "F32", bytes(4))
    with pytest.raises(ValueError, match="repeat"):
        write_gguf(tmp_path / "m.gguf", {}, [t, t])
    with pytest.raises(ValueError, match="version 1"):
        write_gguf(tmp_path / "m.gguf", {}, version=1)


# --- the real model ----------------------------------------------------------------


def tensor_digests(header: gguf.Header) -> dict[str, str]:
    with header.path.open("rb") as fh:
        out = {}
        for t in header.tensors:
            fh.seek(header.data_offset + t.offset)
            out[t.name] = hashlib.sha256(fh.read(t.n_bytes)).hexdigest()
        return out


def file_digest(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


@pytest.mark.slow
def test_rewritten_gemma_is_identical_and_serves(gemma_model, llama_server_bin, tmp_path):
    started = time.perf_counter()
    out = rewrite(gemma_model, tmp_path / "gemma-rewritten.gguf")
    elapsed = time.perf_counter() - started
    src = gguf.read(gemma_model, cache=False).shards[0]
    dst = gguf.read(out, cache=False).shards[0]
    assert elapsed < 60, f"rewriting Gemma took {elapsed:.1f} s"

    assert list(dst.metadata) == list(src.metadata)
    assert dict(dst.value_types) == dict(src.value_types)
    for key, value in src.metadata.items():
        assert plain(dst.metadata[key]) == plain(value), key
    assert [(t.name, t.shape, t.ggml_type, t.offset, t.n_bytes) for t in dst.tensors] == [
        (t.name, t.shape, t.ggml_type, t.offset, t.n_bytes) for t in src.tensors
    ]
    check_layout(dst)
    assert tensor_digests(dst) == tensor_digests(src)
    # Gemma was written with ggml's layout, which is the writer's too: the whole file comes back.
    assert file_digest(out) == file_digest(gemma_model)

    port = free_port()
    argv = server_argv(llama_server_bin, out, host="127.0.0.1", port=port, n_ctx=512)
    server = LlamaServer(argv, host="127.0.0.1", port=port, log_path=tmp_path / "llama-server.log")
    server.start()
    try:
        server.wait_ready(timeout=120)
        reply = httpx.post(
            f"{server.url}/completion",
            timeout=60,
            json={"prompt": "The capital of France is", "n_predict": 4, "temperature": 0},
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["tokens_predicted"] >= 1 and reply.json()["content"].strip()
    finally:
        server.stop()
