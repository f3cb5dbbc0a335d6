"""Model facts agree with what the pinned llama-server itself reports.

Every zoo model (one tiny random-weight GGUF per architecture, written by the
pinned ``test-llama-archs``), the real Gemma 3 270M model, and zoo models
re-written without their layout keys (so the facts must come from llama.cpp's
per-family built-in rules) are loaded once by the real llama-server. Its
``print_info:`` lines, its KV-cache lines and its recurrent-state lines are
parsed and compared with ``gguf.read(path).facts``.

The server runs happen once per session, two at a time, each stopped as soon as
the server listens: about 20 s for the module on 2 cores once the zoo exists
(building the zoo adds about 10 s the first time).
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gguf
from gguf.arch_rules import swa_layers_from_hf_config
from gguf.arch_traits import KNOWN_ARCHITECTURES
from gguf.facts import ModelFacts
from gguf.facts_builder import model_facts
from gguf.model import GGUFFile
from gguf.reader import Header, StatKey
from gguf.writer import rewrite
from studio.library import default_model
from tests.support.dry_run import load_report

pytestmark = pytest.mark.slow

GEMMA = default_model.GEMMA_FILENAME

#: Every model the pinned test-llama-archs writes (checked against the real zoo below).
ZOO_MODELS = tuple(
    """
    afmoe-moe arcee-dense arctic-moe baichuan-dense bailingmoe-moe bailingmoe2-moe bailingmoe3-moe bloom-dense
    chatglm-dense codeshell-dense cogvlm-dense cohere2-dense cohere2moe-moe command-r-dense dbrx-moe deci-dense
    deepseek-moe deepseek2-moe deepseek32-moe deepseek4-moe dots1-moe dots3note-moe dream-dense ernie4_5-moe-moe
    ernie4_5-moe exaone-dense exaone-moe-moe exaone4-dense falcon-dense falcon-h1-dense gemma-dense gemma2-dense
    gemma3-dense glm-dsa-moe glm4-dense glm4moe-moe glm5-next-moe gpt-oss-moe gpt2-dense gptneox-dense
    granite-dense granite-moe granite_swa-dense granitehybrid-dense granitemoe-dense granitemoe-moe grok-moe
    grovemoe-moe hrm_text-dense hunyuan-dense-dense hunyuan-moe-moe hunyuan_vl-dense hy_v3-moe hy_v4-moe
    internlm2-dense jais-dense jais2-dense jamba-dense kimi-k3-moe kimi-linear-moe laguna-moe lfm2-dense
    lfm2moe-moe llada-dense llada-moe-moe llama-dense llama-moe llama4-moe maincoder-dense mamba-dense
    mamba2-dense maple-moe mellum-moe mimo2-moe minicpm-dense minicpm-moe minicpm3-dense minimax-01-moe
    minimax-m2-moe minimax-m3-moe mistral3-dense mistral3-moe mistral4-moe mpt-dense muse-glimmer-dense
    nanbeige-dense nemotron-dense nemotron_h-dense nemotron_h_moe-dense olmo-dense olmo2-dense olmoe-moe
    openelm-dense orion-dense paddleocr-moe pangu-embedded-dense phi2-dense phi3-dense phimoe-moe plamo-dense
    plamo2-dense plamo3-dense pockettts-dense qwen-dense qwen2-dense qwen2moe-moe qwen2vl-dense qwen3-dense
    qwen35-dense qwen35moe-moe qwen3moe-moe qwen3next-moe qwen3tts-dense qwen3vl-dense qwen3vlmoe-moe
    qwen4exp-moe refact-dense refact-moe rnd1-moe seed_oss-dense smallthinker-moe smollm3-dense spark2_5-dense
    stablelm-dense starcoder-dense starcoder2-dense talkie-dense xverse-dense
""".split()
)

#: Models whose print_info llama-server does not print, with the reason. Empty at b11434:
#: every zoo model and Gemma get through hyper-parameter loading.
LOAD_FAILURES: dict[str, str] = {}

#: Zoo models re-written without the keys that spell out their layer layout, so that the
#: facts must come from the rules llama.cpp hard-codes per family (as for most real GGUFs):
#: name -> (zoo model, keys dropped, keys set as (GGUF value type, value)).
BUILTIN_RULE_VARIANTS: dict[str, tuple[str, tuple[str, ...], dict[str, tuple[int, Any]]]] = {
    **{
        f"{m}-builtin-swa.gguf": (m, (f"{m.rsplit('-', 1)[0]}.attention.sliding_window_pattern",), {})
        for m in (
            "gemma3-dense",
            "cohere2-dense",
            "cohere2moe-moe",
            "gpt-oss-moe",
            "afmoe-moe",
            "mellum-moe",
            "olmo2-dense",
            "plamo3-dense",
            "exaone-moe-moe",
            "muse-glimmer-dense",
            "smallthinker-moe",
            "laguna-moe",
        )
    },
    # no window either: gemma2 falls back to 4096, llama4 to 8192-token chunks
    **{
        f"{m}-builtin-swa.gguf": (
            m,
            tuple(f"{m.rsplit('-', 1)[0]}.attention.{k}" for k in ("sliding_window_pattern", "sliding_window")),
            {},
        )
        for m in ("gemma2-dense", "llama4-moe")
    },
    # no recurrent-layer list: full_attention_interval decides which layers are linear attention
    **{
        f"{m}-builtin-interval.gguf": (
            m,
            (f"{m.rsplit('-', 1)[0]}.attention.recurrent_layers",),
            {f"{m.rsplit('-', 1)[0]}.full_attention_interval": (4, 2)},
        )
        for m in ("qwen35-dense", "qwen35moe-moe", "qwen3next-moe", "minimax-01-moe")
    },
}
ALL_MODELS = [GEMMA, *(f"{m}.gguf" for m in ZOO_MODELS), *BUILTIN_RULE_VARIANTS]

SERVER_TIMEOUT_S = 60
_PRINT_INFO = re.compile(r"\bprint_info: ([^=]+?)\s+= ?(.*)$")
_KV_CREATING = re.compile(r"creating\s+(.+?)\s+KV cache")
_KV_SIZE = re.compile(
    r"llama_kv_cache: size = +[\d.]+ MiB \( *(\d+) cells, +(\d+) layers, +(\d+)/(\d+) seqs\), "
    r"K \((\w+)\): +([\d.]+) MiB, V \((\w+)\): +([\d.]+) MiB"
)
_RS_SIZE = re.compile(
    r"llama_memory_recurrent: size = +[\d.]+ MiB \( *(\d+) cells, +(\d+) layers, +(\d+) seqs +(\d+) rs_seq\), "
    r"R \((\w+)\): +([\d.]+) MiB, S \((\w+)\): +([\d.]+) MiB"
)
_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
MIB = 1024 * 1024


# ---------------------------------------------------------------------------
# running llama-server once per model
# ---------------------------------------------------------------------------


@dataclass
class KVCacheLine:
    label: str  # "non-SWA", "SWA", "main", "indexer", ...
    cells: int
    layers: int
    streams: int
    k_type: str
    k_mib: float
    v_type: str
    v_mib: float


@dataclass
class ServerReport:
    """What llama-server said while loading one model."""

    log: str
    returncode: int | None
    info: dict[str, str] = field(default_factory=dict)
    kv: list[KVCacheLine] = field(default_factory=list)
    recurrent: list[tuple[int, int, float, float, str, str]] = field(default_factory=list)

    @property
    def loaded_hparams(self) -> bool:
        return "n_layer" in self.info


def _run_server(binary: Path, model: Path) -> ServerReport:
    """llama-server's report on ``model``, read until it listens (or exits)."""
    return parse_report(*load_report(binary, model, ["-c", "256"], timeout=SERVER_TIMEOUT_S))


def parse_report(log: str, returncode: int | None = None) -> ServerReport:
    report = ServerReport(log=log, returncode=returncode)
    label = "main"
    for line in log.splitlines():
        if m := _PRINT_INFO.search(line):
            report.info.setdefault(m.group(1).strip(), m.group(2).rstrip())
        elif m := _KV_CREATING.search(line):
            label = m.group(1).strip()
        elif m := _KV_SIZE.search(line):
            cells, layers, _, streams, kt, km, vt, vm = m.groups()
            report.kv.append(KVCacheLine(label, int(cells), int(layers), int(streams), kt, float(km), vt, float(vm)))
        elif m := _RS_SIZE.search(line):
            cells, _, _, rs_seq, rt, rm, stype, sm = m.groups()
            report.recurrent.append((int(cells), int(rs_seq), float(rm), float(sm), rt, stype))
    return report


@pytest.fixture(scope="session")
def model_paths(zoo_dir: Path, gemma_model: Path, tmp_path_factory) -> dict[str, Path]:
    paths = {f"{name}.gguf": zoo_dir / f"{name}.gguf" for name in ZOO_MODELS}
    paths[GEMMA] = gemma_model
    variants = tmp_path_factory.mktemp("builtin-rules")
    for name, (source, drop, add) in BUILTIN_RULE_VARIANTS.items():
        rewrite(
            zoo_dir / f"{source}.gguf",
            variants / name,
            drop_keys=tuple(drop),
            metadata_updates={k: v for k, (_, v) in add.items()},
            value_types={k: (t,) for k, (t, _) in add.items()},
        )
        paths[name] = variants / name
    return paths


@pytest.fixture(scope="session")
def server_reports(llama_server_bin: Path, model_paths: dict[str, Path]) -> dict[str, ServerReport]:
    """llama-server's own report for every model, two servers at a time."""
    present = {name: path for name, path in model_paths.items() if path.is_file()}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_run_server, llama_server_bin, path) for name, path in present.items()}
        return {name: future.result() for name, future in futures.items()}


# ---------------------------------------------------------------------------
# comparing
# ---------------------------------------------------------------------------


def _per_layer(text: str, n: int) -> tuple[int, ...]:
    """print_info's per-layer format: one number when every layer agrees, else a list."""
    text = text.strip()
    if text.startswith("["):
        return tuple(int(x) for x in text.strip("[]").split(","))
    return (int(text),) * n


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _params_text(n: int) -> str:
    if n >= 1e12:
        return f"{n * 1e-12:.2f} T"
    if n >= 1e9:
        return f"{n * 1e-9:.2f} B"
    if n >= 1e6:
        return f"{n * 1e-6:.2f} M"
    return f"{n * 1e-3:.2f} K"


def _file_size_text(n_bytes: int, n_elements: int) -> str:
    bpw = n_bytes * 8.0 / n_elements
    if n_bytes < 1024**3:
        return f"{n_bytes / 1024 / 1024:.2f} MiB ({bpw:.2f} BPW)"
    return f"{n_bytes / 1024 / 1024 / 1024:.2f} GiB ({bpw:.2f} BPW)"


def _token_id(text: str | None) -> int | None:
    return None if text is None else int(text.split()[0])


def expected_print_info(f: ModelFacts, info: dict[str, str]) -> dict[str, Any]:
    """The print_info values the facts predict, in llama-server's own units."""
    n = f.block_count
    scale = 1.0 if f.rope_scaling_factor == 0 else _f32(1.0 / _f32(f.rope_scaling_factor))
    exp: dict[str, Any] = {
        "arch": f.architecture,
        "n_ctx_train": str(f.context_length),
        "n_embd": str(f.embedding_length),
        "n_layer": str(f.layer_count),
        "n_layer_all": str(f.block_count),
        "n_head": f.head_count,
        "n_head_kv": f.head_count_kv,
        "n_swa": str(f.sliding_window),
        "is_swa_any": str(int(f.is_swa_any)),
        "n_embd_head_k": str(f.key_length),
        "n_embd_head_v": str(f.value_length),
        "n_gqa": tuple(h // kv if kv else 0 for h, kv in zip(f.head_count, f.head_count_kv, strict=False)),
        "n_embd_k_gqa": tuple(f.k_embd(il) for il in range(n)),
        "n_embd_v_gqa": tuple(f.v_embd(il) for il in range(n)),
        "n_ff": f.feed_forward_length,
        "n_expert": str(f.expert_count),
        "n_expert_used": str(f.expert_used_counts[0]),
        "rope scaling": f.rope_scaling_type,
        "freq_base_train": f"{f.rope_freq_base:.1f}",
        "freq_scale_train": f"{scale:g}",
        "n_ctx_orig_yarn": str(f.rope_original_context_length),
        "model params": _params_text(f.parameter_count),
        "file size": _file_size_text(f.tensor_bytes, f.parameter_count),
        "general.name": f.name if f.name is not None else "n/a",
        "file type": f.file_type_description,
        "n_vocab": str(f.vocab_size),
        "BOS token": f.bos_token_id,
        "EOS token": f.eos_token_id,
    }
    optional = {  # printed only for some architectures / when SWA is on
        "n_embd_head_k_swa": str(f.key_length_swa),
        "n_embd_head_v_swa": str(f.value_length_swa),
        "ssm_d_conv": str(f.ssm.conv_kernel),
        "ssm_d_inner": str(f.ssm.inner_size),
        "ssm_d_state": str(f.ssm.state_size),
        "ssm_dt_rank": str(f.ssm.time_step_rank),
        "ssm_n_group": str(f.ssm.group_count),
        "n_lora_kv": str(f.kv_lora_rank),
        "n_rot": str(f.rope_dimension_count),
        "n_embd_head_k_mla": str(f.key_length_mla if f.is_mla else f.key_length_of(0)),
        "n_embd_head_v_mla": str(f.value_length_mla if f.is_mla else f.value_length_of(0)),
        "n_expert_shared": str(f.expert_shared_count),
        "n_layer_nextn": str(f.nextn_predict_layers),
    }
    exp.update({k: v for k, v in optional.items() if k in info})
    return exp


def actual_print_info(info: dict[str, str], expected: dict[str, Any], n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, want in expected.items():
        got = info.get(key)
        if isinstance(want, tuple) and got is not None:
            out[key] = _per_layer(got, n)
        elif key in ("BOS token", "EOS token"):
            out[key] = _token_id(got)
        else:
            out[key] = got
    return out


def kv_mismatches(f: ModelFacts, report: ServerReport) -> list[str]:
    """Compare the attention KV caches llama-server allocated with what the facts predict.

    Indexer and compressed caches (DSA, DeepSeek-V4) are not modelled by the facts
    and are left out; each remaining cache kind must appear at most once.
    """
    full_layers = [il for il in f.attention_cache_layers() if not f.swa_layers[il]]
    swa_layers = [il for il in f.attention_cache_layers() if f.swa_layers[il]]
    by_kind: dict[str, list[KVCacheLine]] = {"full": [], "swa": []}
    for line in report.kv:
        label = line.label.lower()
        if "indexer" in label or "compressed" in label:
            continue
        by_kind["swa" if label == "swa" else "full"].append(line)
    problems = []
    for kind, layers in (("full", full_layers), ("swa", swa_layers)):
        lines = by_kind[kind]
        if not lines:
            if layers:
                problems.append(f"{kind}: facts expect {len(layers)} cached layers, llama-server made no cache")
            continue
        if len(lines) > 1:
            problems.append(f"{kind}: {len(lines)} caches of one kind; the comparison expects one")
            continue
        line = lines[0]
        if line.layers != len(layers):
            problems.append(f"{kind}: {line.layers} layers cached, facts expect {len(layers)}")
        cells = line.cells * line.streams
        k = cells * sum(f.k_embd(il) for il in layers) * _TYPE_BYTES[line.k_type] / MIB
        v = 0.0 if f.kv_cache_k_only else cells * sum(f.v_embd(il) for il in layers) * _TYPE_BYTES[line.v_type] / MIB
        if abs(k - line.k_mib) > 0.0051 or abs(v - line.v_mib) > 0.0051:
            problems.append(f"{kind}: K/V {line.k_mib}/{line.v_mib} MiB, facts give {k:.4f}/{v:.4f} MiB")
    return problems


def recurrent_mismatches(f: ModelFacts, report: ServerReport) -> list[str]:
    problems = []
    if any(f.recurrent_state_layers) and not report.recurrent:
        problems.append("facts say recurrent layers, llama-server made no recurrent state")
    for cells, rs_seq, r_mib, s_mib, r_type, s_type in report.recurrent:
        rows = cells * (1 + rs_seq)
        layers = sum(f.recurrent_state_layers)
        r = rows * layers * f.recurrent_conv_state * _TYPE_BYTES[r_type] / MIB
        s = rows * layers * f.recurrent_state * _TYPE_BYTES[s_type] / MIB
        if abs(r - r_mib) > 0.0051 or abs(s - s_mib) > 0.0051:
            problems.append(f"R/S {r_mib}/{s_mib} MiB, facts give {r:.4f}/{s:.4f} MiB")
    return problems


# ---------------------------------------------------------------------------
# the acceptance tests
# ---------------------------------------------------------------------------


def test_zoo_holds_exactly_the_listed_models(zoo_dir):
    assert sorted(p.stem for p in zoo_dir.glob("*.gguf")) == sorted(ZOO_MODELS)


def test_zoo_covers_only_known_architectures():
    for name in ZOO_MODELS:
        arch = name.rsplit("-", 1)[0]
        assert arch in KNOWN_ARCHITECTURES, name


@pytest.mark.parametrize("name", ALL_MODELS)
def test_facts_match_llama_server_print_info(name, server_reports, model_paths):
    report = server_reports[name]
    if name in LOAD_FAILURES:
        assert not report.loaded_hparams, f"{name} now loads; drop it from LOAD_FAILURES"
        return
    assert report.loaded_hparams, f"llama-server printed no hyper-parameters for {name}:\n{report.log[-3000:]}"
    facts = gguf.read(model_paths[name]).facts
    assert not facts.approximate, facts.notes
    if name.endswith("-builtin-swa.gguf"):  # the layout came from llama.cpp's per-family rule, and says so
        assert any("llama.cpp uses" in note for note in facts.notes), facts.notes
    elif name.endswith("-builtin-interval.gguf"):
        assert facts.full_attention_interval == 2 and facts.is_hybrid
    expected = expected_print_info(facts, report.info)
    actual = actual_print_info(report.info, expected, facts.block_count)
    assert actual == expected


@pytest.mark.parametrize("name", ALL_MODELS)
def test_kv_cache_and_recurrent_state_match_llama_server(name, server_reports, model_paths):
    report = server_reports[name]
    if name in LOAD_FAILURES:
        pytest.skip(f"llama-server cannot load {name}: {LOAD_FAILURES[name]}")
    facts = gguf.read(model_paths[name]).facts
    assert report.kv or report.recurrent or not facts.attention_cache_layers(), (
        f"llama-server made no cache for {name}:\n{report.log[-3000:]}"
    )
    assert kv_mismatches(facts, report) + recurrent_mismatches(facts, report) == []


def test_dense_ffn_widths_are_what_the_graph_multiplies_by(zoo_dir):
    """From each block's ffn_down weight: Qwen's blocks are n_ff / 2 wide, Arctic's residual FFN n_embd."""
    qwen, arctic, llama = (gguf.read(zoo_dir / f"{m}.gguf").facts for m in ("qwen-dense", "arctic-moe", "llama-dense"))
    assert qwen.dense_ffn_widths == (192, 192) and qwen.feed_forward_length == (384, 384)
    assert arctic.dense_ffn_widths == (arctic.embedding_length,) * 2
    assert llama.dense_ffn_widths == llama.feed_forward_length


def test_gemma_facts(gemma_model):
    f = gguf.read(gemma_model).facts
    assert (f.architecture, f.name, f.basename, f.size_label) == ("gemma3", "Gemma 3 270m", "gemma-3", "270M")
    assert (f.quant_label, f.file_type, f.file_type_guessed) == ("Q4_K_M", 15, False)
    assert (f.block_count, f.layer_count, f.has_mtp) == (18, 18, False)
    # the GGUF has no pattern: llama.cpp's gemma3 rule makes every 6th layer full attention
    assert f.swa_layers == tuple(il % 6 != 5 for il in range(18))
    assert (f.sliding_window, f.full_attention_interval, f.swa_type) == (512, 6, "standard")
    assert f.kv_bytes_per_token() == gguf.facts.KVBytesPerToken(full=3 * 2 * 256 * 2, swa=15 * 2 * 256 * 2)
    assert f.kv_bytes_per_token(1.0).total == 18 * 512
    assert (f.vocab_size, f.bos_token_id, f.eos_token_id) == (262144, 2, 1)
    assert sum(f.layer_weight_bytes) + f.non_layer_weight_bytes == f.tensor_bytes
    assert f.token_embedding_bytes > 0 and len(f.layer_weight_bytes) == 18
    assert any("built-in pattern" in note for note in f.notes) and not f.approximate
    assert gguf.read(gemma_model).facts is gguf.read(gemma_model).facts  # cached on the model


# ---------------------------------------------------------------------------
# synthetic metadata: rules, fallbacks and errors
# ---------------------------------------------------------------------------


def _model(metadata: dict[str, Any], tensors: Iterable = (), path: str = "synthetic.gguf") -> GGUFFile:
    header = Header(
        path=Path(path),
        version=3,
        metadata=MappingProxyType(dict(metadata)),
        value_types={},
        tensors=tuple(tensors),
        alignment=32,
        data_offset=0,
        file_size=0,
        stat_key=StatKey(0, 0, 0, 0),
    )
    return GGUFFile(shards=(header,))


def _renamed(metadata: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    out = {}
    for key, value in metadata.items():
        out[new + key[len(old) :] if key.startswith(old + ".") else key] = value
    out["general.architecture"] = new
    return out


@pytest.fixture(scope="module")
def gemma_meta(gemma_model) -> dict[str, Any]:
    model = gguf.read(gemma_model)
    return dict(model.metadata)


def test_known_family_rule_without_pattern_gemma2():
    md = {
        "general.architecture": "gemma2",
        "gemma2.context_length": 8192,
        "gemma2.embedding_length": 256,
        "gemma2.block_count": 6,
        "gemma2.attention.head_count": 4,
        "gemma2.attention.head_count_kv": 2,
    }
    f = model_facts(_model(md))
    assert f.swa_layers == (True, False) * 3
    assert f.sliding_window == 4096 and f.full_attention_interval == 2
    assert not f.approximate and f.key_length == 64


def test_mtp_layers_are_counted_apart(gemma_meta):
    md = dict(gemma_meta)
    md["gemma3.nextn_predict_layers"] = 2
    f = model_facts(_model(md))
    assert (f.block_count, f.layer_count, f.nextn_predict_layers) == (18, 16, 2)
    assert (f.has_mtp, f.trunk_only) == (False, True)  # the key alone: no blk.16.nextn.eh_proj.weight in the file
    # the built-in SWA pattern covers the main layers only; MTP blocks are dense
    assert f.swa_layers[16:] == (False, False) and f.swa_layers[:16] == tuple(il % 6 != 5 for il in range(16))


def test_qwen35_hybrid_layout_from_the_interval():
    md = {
        "general.architecture": "qwen35",
        "qwen35.context_length": 4096,
        "qwen35.embedding_length": 128,
        "qwen35.block_count": 9,
        "qwen35.nextn_predict_layers": 1,
        "qwen35.attention.head_count": 2,
        "qwen35.attention.head_count_kv": 1,
        "qwen35.ssm.conv_kernel": 4,
        "qwen35.ssm.inner_size": 256,
        "qwen35.ssm.state_size": 128,
        "qwen35.ssm.time_step_rank": 2,
        "qwen35.ssm.group_count": 2,
    }
    f = model_facts(_model(md))
    assert f.recurrent_layers == (True, True, True, False, True, True, True, False, False)
    # the MTP block (layer 8) gets its cache in the draft context, not the main one
    assert f.kv_layers == (False, False, False, True, False, False, False, True, False)
    assert f.is_hybrid and f.full_attention_interval == 4 and f.nextn_predict_layers == 1
    assert f.trunk_only  # the metadata alone: no blk.8.nextn.eh_proj.weight here
    assert f.kv_bytes_per_token(2).full == 2 * (64 + 64) * 2
    assert f.recurrent_state_bytes_per_sequence() == 6 * (3 * (256 + 2 * 2 * 128) + 128 * 256) * 4


def test_unknown_architecture_is_approximate_and_can_use_a_hf_config():
    md = {
        "general.architecture": "futurelm",
        "futurelm.context_length": 4096,
        "futurelm.embedding_length": 128,
        "futurelm.block_count": 4,
        "futurelm.attention.head_count": 2,
        "futurelm.attention.sliding_window": 128,
    }
    f = model_facts(_model(md))
    assert f.approximate and not f.known_architecture
    assert f.swa_layers == (False,) * 4 and f.sliding_window == 128
    assert any("no loader" in n for n in f.notes) and any("upper bound" in n for n in f.notes)
    config = {"layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]}
    g = model_facts(_model(md), hf_config=config)
    assert g.swa_layers == (True, True, True, False) and g.approximate


def test_hf_config_hook_reads_layer_types_and_periods():
    assert swa_layers_from_hf_config({"sliding_window_pattern": 3}, 6) == (True, True, False) * 2
    nested = {"text_config": {"layer_types": ["full_attention", "sliding_attention"]}}
    assert swa_layers_from_hf_config(nested, 2) == (False, True)
    assert swa_layers_from_hf_config({"hidden_size": 4}, 2) is None


def test_missing_required_key_is_reported_not_raised():
    md = {
        "general.architecture": "cohere2",
        "cohere2.context_length": 4096,
        "cohere2.embedding_length": 128,
        "cohere2.block_count": 4,
        "cohere2.attention.head_count": 2,
    }
    f = model_facts(_model(md))
    assert f.approximate and any("cohere2.attention.sliding_window" in n for n in f.notes)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("gemma3.block_count", "eighteen"),
        ("gemma3.context_length", 1.5),
        ("gemma3.embedding_length", -640),
        ("gemma3.attention.head_count", [4, 4]),
        ("gemma3.attention.head_count_kv", "1"),
        ("gemma3.attention.sliding_window", [512]),
        ("gemma3.attention.sliding_window_pattern", ["sliding"]),
        ("gemma3.rope.freq_base", "1e6"),
        ("gemma3.rope.scaling.type", "cubic"),
        ("gemma3.nextn_predict_layers", True),
        ("general.architecture", 3),
        ("general.name", 7),
        ("general.file_type", "Q4_K_M"),
        ("tokenizer.ggml.bos_token_id", -1),
        ("tokenizer.ggml.tokens", "abc"),
    ],
)
def test_wrong_metadata_types_raise_gguf_error_naming_the_key(gemma_meta, key, value):
    md = dict(gemma_meta)
    md[key] = value
    with pytest.raises(gguf.GGUFError) as info:
        model_facts(_model(md))
    assert key in str(info.value)


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.lists(st.one_of(st.integers(-3, 600), st.booleans(), st.text(max_size=2)), max_size=20),
)
_FUZZ_KEYS = [
    "general.architecture",
    "block_count",
    "context_length",
    "embedding_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.sliding_window",
    "attention.sliding_window_pattern",
    "attention.recurrent_layers",
    "full_attention_interval",
    "nextn_predict_layers",
    "expert_count",
    "expert_used_count",
    "feed_forward_length",
    "rope.scaling.factor",
    "attention.kv_lora_rank",
    "attention.key_length_mla",
    "ssm.inner_size",
    "num_loops",
    "attention.shared_kv_layers",
    "general.file_type",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.eos_token_id",
]
_FUZZ_ARCHS = ["gemma3", "qwen35", "nanbeige", "deepseek2", "gemma4", "graniteswitch", "lfm2", "llama4", "futurelm"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arch=st.sampled_from(_FUZZ_ARCHS), edits=st.dictionaries(st.sampled_from(_FUZZ_KEYS), _VALUES, max_size=4))
def test_any_metadata_gives_facts_or_gguf_error(gemma_meta, arch, edits):
    md = _renamed(gemma_meta, "gemma3", arch)
    for key, value in edits.items():
        full = key if key.startswith(("general.", "tokenizer.")) else f"{arch}.{key}"
        if value is None:
            md.pop(full, None)
        else:
            md[full] = value
    try:
        f = model_facts(_model(md))
    except gguf.GGUFError:
        return
    n = f.block_count
    assert len(f.swa_layers) == len(f.recurrent_layers) == len(f.kv_layers) == len(f.head_count) == n
    kv = f.kv_bytes_per_token()
    assert kv.full >= 0 and kv.swa >= 0 and math.isfinite(kv.total)


def test_facts_are_frozen(gemma_model):
    f = gguf.read(gemma_model).facts
    with pytest.raises(AttributeError):
        f.block_count = 3  # type: ignore[misc]
    assert replace(f, notes=()).notes == ()
