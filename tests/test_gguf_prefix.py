"""Parsing a header from the first bytes of a file that is elsewhere (``gguf.read_header_prefix``)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

import gguf
from gguf import reader
from gguf.writer import TensorToWrite, write_gguf

MARGIN = 64 * 1024


def read_in_growing_prefixes(data: bytes, path: Path) -> tuple[gguf.Header, int, int]:
    """What a ranged reader does: 64 KiB first, then up to each lower bound plus 64 KiB; (header, bytes, reads)."""
    have, reads = min(MARGIN, len(data)), 1
    while True:
        try:
            return gguf.read_header_prefix(data[:have], len(data), path), have, reads
        except gguf.NeedMoreBytes as exc:
            assert exc.needed > have  # every answer asks for bytes it does not have
            have, reads = min(exc.needed + MARGIN, len(data)), reads + 1


def models(zoo_dir: Path, gemma_model: Path) -> list[Path]:
    return [*sorted(zoo_dir.glob("*.gguf")), gemma_model]


def test_every_zoo_header_and_gemmas_large_vocabulary_parse_from_prefixes_within_64_kib_of_the_header(
    zoo_dir, gemma_model
):
    for path in models(zoo_dir, gemma_model):
        data = path.read_bytes()
        whole = gguf.read_header(path)
        header, read, _ = read_in_growing_prefixes(data, path)
        assert header.tensors == whole.tensors, path.name
        assert header.data_offset == whole.data_offset, path.name
        assert {k: v for k, v in header.metadata.items() if not isinstance(v, gguf.LazyArray)} == {
            k: v for k, v in whole.metadata.items() if not isinstance(v, gguf.LazyArray)
        }, path.name
        assert read <= whole.data_offset + MARGIN, path.name


def test_the_pure_python_string_skip_finds_the_same_bounds(gemma_model, monkeypatch):
    data = gemma_model.read_bytes()
    with_c = read_in_growing_prefixes(data, gemma_model)
    monkeypatch.setattr(reader, "c_skip_strings", None)
    without_c = read_in_growing_prefixes(data, gemma_model)
    assert without_c[0].tensors == with_c[0].tensors
    assert without_c[1] <= with_c[0].data_offset + MARGIN


def test_a_header_that_does_not_fit_in_the_file_size_is_truncated_not_more_bytes(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", {"general.architecture": "llama"}, [TensorToWrite("t", (64,), "F32")])
    data = path.read_bytes()
    header = gguf.read_header(path)
    with pytest.raises(gguf.TruncatedError) as info:  # the tensor data is past the end the size gives
        gguf.read_header_prefix(data, header.data_offset + 16, path)
    assert not isinstance(info.value, gguf.NeedMoreBytes)


def test_a_huge_string_length_is_reported_as_its_end_before_any_byte_of_it_is_asked_for(tmp_path):
    """A caller refuses a header claiming more than its limit from the lower bound alone."""
    key = b"general.name"
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 8)
    claimed = 1 << 26
    data = head + struct.pack("<Q", claimed) + b"x" * 100
    with pytest.raises(gguf.NeedMoreBytes) as info:
        gguf.read_header_prefix(data, len(head) + 8 + claimed + 1024, tmp_path / "huge.gguf")
    assert info.value.needed == len(head) + 8 + claimed
