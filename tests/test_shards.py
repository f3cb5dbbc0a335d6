"""One reading of split-model file names, shared by the reader, the library's folders and the Hub listing."""

from __future__ import annotations

from pathlib import Path

import pytest

from gguf.errors import MissingShardError
from gguf.shards import ShardName, parse_shard, shard_name, shard_paths
from studio.library.hub import HubFile, candidates, group_key
from studio.library.scan import model_name

NAMES = [
    ("model-00001-of-00003", ShardName("model", 1, 3)),
    ("Q4_K_M/model-Q4_K_M-00002-of-00003", ShardName("Q4_K_M/model-Q4_K_M", 2, 3)),
    ("a-00001-of-00002-00002-of-00002", ShardName("a-00001-of-00002", 2, 2)),
    ("model", None),
    ("model-1-of-3", None),  # llama.cpp writes five digits
    ("model-00001-of-00003-fixed", None),
    ("-00001-of-00003", None),  # a suffix without a name
]


@pytest.mark.parametrize(("name", "parsed"), NAMES)
def test_parse_shard_reads_the_numbering_llama_cpp_writes(name, parsed):
    assert parse_shard(name) == parsed
    if parsed is not None:
        assert shard_name(parsed.stem, parsed.number, parsed.count) == f"{name}.gguf"


@pytest.mark.parametrize(("name", "parsed"), NAMES)
def test_the_catalog_and_the_hub_group_shards_as_the_reader_does(name, parsed):
    stem = parsed.stem if parsed else name
    assert group_key(f"{name}.gguf") == stem
    assert model_name(Path(f"{Path(name).name}.gguf")) == Path(stem).name


def test_a_hub_listing_missing_a_shard_names_it_as_the_reader_would_look_for_it(tmp_path):
    listed = [HubFile("Q8_0/m-00001-of-00003.gguf", 10), HubFile("Q8_0/m-00003-of-00003.gguf", 10)]
    (candidate,) = candidates(listed)
    assert candidate.missing == ("Q8_0/m-00002-of-00003.gguf",)
    for f in listed:
        (tmp_path / Path(f.path).name).write_bytes(b"")
    with pytest.raises(MissingShardError, match="m-00002-of-00003.gguf"):
        shard_paths(tmp_path / "m-00001-of-00003.gguf")
