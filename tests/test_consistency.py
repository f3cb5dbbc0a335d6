"""A header whose hyper-parameters its tensors contradict, or that no real model has, is refused by the facts.

The refusals edit the real Gemma 3 270M header (metadata or tensor list) in
memory; the acceptances run every file llama-server itself accepts: the real
Gemma, every zoo architecture, zoo models widened to real proportions (several
heads, many experts), an MTP model and the same model with its MTP tensors left out.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

import gguf
from gguf.consistency import MAX_BLOCKS, MAX_CONTEXT, MAX_EXPERTS
from gguf.errors import ImplausibleValueError, InconsistentHeaderError
from gguf.model import GGUFFile
from gguf.reader import Header, TensorInfo
from gguf.writer import copy_of, write_gguf
from tests.support.wide_zoo import widen_model, with_experts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma_header(gemma_model: Path) -> Header:
    return gguf.read(gemma_model).shards[0]


def facts_of(header: Header, *, tensors: tuple[TensorInfo, ...] | None = None, **edits: Any):
    """The facts of ``header`` with metadata ``edits`` (``gemma3__block_count`` for ``gemma3.block_count``)."""
    metadata = dict(header.metadata)
    metadata.update({k.replace("__", "."): v for k, v in edits.items()})
    edited = dataclasses.replace(
        header, metadata=MappingProxyType(metadata), tensors=header.tensors if tensors is None else tensors
    )
    return GGUFFile(shards=(edited,)).facts


@pytest.mark.parametrize(
    ("edits", "error", "key", "says"),
    [
        # the defect of issue 15: 65535 blocks claimed, 18 present, and the plan ran for minutes
        ({"gemma3__block_count": 65535}, ImplausibleValueError, "gemma3.block_count", "65,535"),
        ({"gemma3__block_count": MAX_BLOCKS + 1}, ImplausibleValueError, "gemma3.block_count", f"{MAX_BLOCKS:,}"),
        ({"gemma3__block_count": 19}, InconsistentHeaderError, "gemma3.block_count", "describe 18 blocks"),
        ({"gemma3__block_count": 17}, InconsistentHeaderError, "gemma3.block_count", "describe 18 blocks"),
        ({"gemma3__nextn_predict_layers": 19}, InconsistentHeaderError, "gemma3.nextn_predict_layers", "is 18"),
        ({"gemma3__context_length": 2**32 - 1}, ImplausibleValueError, "gemma3.context_length", f"{MAX_CONTEXT:,}"),
        ({"gemma3__embedding_length": 2**31}, ImplausibleValueError, "gemma3.embedding_length", "2,147,483,648"),
        ({"gemma3__embedding_length": 1280}, InconsistentHeaderError, "gemma3.embedding_length", "640 wide"),
        (
            {"gemma3__attention__head_count_kv": 2},
            InconsistentHeaderError,
            "gemma3.attention.head_count_kv",
            "2 x 256 = 512 but blk.0.attn_k.weight is 256 wide",
        ),
        (
            {"gemma3__attention__head_count_kv": 2**31},
            InconsistentHeaderError,
            "gemma3.attention.head_count_kv",
            "blk.0.attn_k.weight",
        ),
        (
            {"gemma3__attention__head_count": 16},
            InconsistentHeaderError,
            "gemma3.attention.head_count",
            "blk.0.attn_q.weight is 1,024 wide",
        ),
        (
            {"gemma3__attention__key_length": 64},
            InconsistentHeaderError,
            "gemma3.attention.head_count_kv",
            "gemma3.attention.key_length is 1 x 64",
        ),
        (
            {"gemma3__attention__value_length": 512},
            InconsistentHeaderError,
            "gemma3.attention.head_count_kv",
            "gemma3.attention.value_length is 1 x 512",
        ),
        (
            {"gemma3__expert_count": MAX_EXPERTS + 1, "gemma3__expert_used_count": 1},
            ImplausibleValueError,
            "gemma3.expert_count",
            "LLAMA_MAX_EXPERTS",
        ),
        (
            {"gemma3__expert_used_count": 2},
            InconsistentHeaderError,
            "gemma3.expert_used_count",
            "'gemma3.expert_count' is 0",
        ),
        (
            {"gemma3__expert_count": 4, "gemma3__expert_used_count": 8},
            InconsistentHeaderError,
            "gemma3.expert_used_count",
            "is 8",
        ),
    ],
)
def test_a_header_its_tensors_contradict_is_refused_naming_the_key(gemma_header, edits, error, key, says):
    with pytest.raises(error) as info:
        facts_of(gemma_header, **edits)
    assert info.value.key == key
    assert key in str(info.value)
    assert says in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_a_block_tensor_beyond_the_block_count_is_refused(gemma_header):
    extra = dataclasses.replace(gemma_header.tensors[-1], name="blk.60000.attn_norm.weight")
    with pytest.raises(InconsistentHeaderError, match=r"'gemma3.block_count' is 18 but the tensors describe 60,001"):
        facts_of(gemma_header, tensors=(*gemma_header.tensors, extra))


def test_an_expert_count_the_expert_tensors_contradict_is_refused(zoo_dir):
    header = gguf.read(zoo_dir / "qwen3moe-moe.gguf").shards[0]
    with pytest.raises(InconsistentHeaderError) as info:
        facts_of(header, qwen3moe__expert_count=4)
    assert (info.value.key, info.value.value, info.value.found) == ("qwen3moe.expert_count", 4, 2)
    assert "holds 2 experts" in str(info.value)


def test_missing_block_count_still_comes_from_the_tensors(gemma_header):
    metadata = {k: v for k, v in gemma_header.metadata.items() if k != "gemma3.block_count"}
    facts = GGUFFile(shards=(dataclasses.replace(gemma_header, metadata=MappingProxyType(metadata)),)).facts
    assert facts.block_count == 18 and facts.approximate


def test_every_zoo_model_and_gemma_pass(zoo_dir, gemma_model):
    for path in [gemma_model, *sorted(zoo_dir.glob("*.gguf"))]:
        assert gguf.read(path).facts.block_count > 0, path


def test_an_mtp_model_passes_with_and_without_its_mtp_tensors(qwen35_mtp_model, tmp_path):
    model = gguf.read(qwen35_mtp_model)
    facts = model.facts
    assert facts.nextn_predict_layers == 1 and facts.block_count == facts.layer_count + 1
    # a trunk-only file: the NextN block's tensors left out, block_count and nextn_predict_layers kept
    head = model.shards[0]
    last = f"blk.{facts.layer_count}."
    trunk = write_gguf(
        tmp_path / "trunk-only.gguf",
        head.metadata,
        [copy_of(head, t) for t in head.tensors if not t.name.startswith(last)],
        value_types=head.value_types,
    )
    assert gguf.read(trunk).facts.block_count == facts.block_count


@pytest.mark.parametrize("name", ["llama-dense", "gemma3-dense", "granitehybrid-dense", "qwen3moe-moe"])
def test_models_widened_to_real_proportions_pass(zoo_dir, llama_server_bin, tmp_path, name):
    """Several heads per layer (the zoo has one or two), shapes llama-server itself accepted."""
    wide = widen_model(zoo_dir / f"{name}.gguf", tmp_path / "wide.gguf", llama_server_bin, factor=8)
    assert wide is not None, f"llama-server refused {name} widened"
    facts = gguf.read(wide).facts
    assert max(facts.head_count) >= 8
    assert bool(facts.expert_count) == name.endswith("-moe")  # the MoE case is never skipped by a lost expert count
    if facts.expert_count:
        many = gguf.read(with_experts(wide, tmp_path / "experts.gguf", 64, 8)).facts
        assert (many.expert_count, many.expert_used_count) == (64, 8)
