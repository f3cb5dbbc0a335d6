"""Zoo models re-written at realistic widths, to measure compute buffers where they matter.

The zoo's models are 256 wide with a 128-token vocabulary, so their compute
buffers are a few MiB: there, where ggml-alloc happens to place many small
tensors decides the peak, not the tensor sizes an estimate is built from. Real
models are 2-16k wide. ``widen_model`` multiplies a zoo model's widths (the
embedding, the FFN, the head counts) by ``factor`` and leaves head sizes, layer
counts and the vocabulary alone; the weights are holes, so a 400 MB model is
written sparse in milliseconds and llama-server maps it without reading.

Which dimensions of a tensor are widths is not in the file, so the guess (in the
first two axes, a multiple of the zoo's FFN width 384 that is not one of 256 is
an FFN width; any other dimension of 256 or more that is a multiple of 128 is an
embedding-like width) is checked by the pinned llama-server itself: when it refuses a tensor with
``check_tensor_dims: tensor 'X' has wrong shape; expected A, B``, that tensor
(in every block) takes the expected shape and the load is tried again. A model
is kept only once llama-server reserves its compute buffer (some widened graphs
break an assert of their own, e.g. Qwen3.5's delta-net: those are left out).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

import gguf
from gguf.writer import TensorToWrite, write_gguf
from tests.support.dry_run import load_report

log = structlog.get_logger(__name__)

MARKER = ".wide-zoo-complete"
#: Only models of the zoo's usual width are widened (a few architectures use other widths).
ZOO_WIDTH = 256
_WRONG_SHAPE = re.compile(r"check_tensor_dims: tensor '([^']+)' has wrong shape; expected\s+([\d,\s]+?),\s+got")
#: The shapes passed the loader's checks and the graph its own asserts once its compute buffer is reserved.
_ACCEPTED = "compute buffer size"
_BLOCK = re.compile(r"^blk\.\d+\.")


#: The zoo's FFN width; a dimension that is a multiple of it but not of ZOO_WIDTH is taken for an FFN width.
ZOO_FFN = 384


def _wide(dim: int, factor: int, ffn_factor: int) -> int:
    if dim % ZOO_FFN == 0 and dim % ZOO_WIDTH:
        return dim * ffn_factor
    return dim * factor if dim >= ZOO_WIDTH and dim % 128 == 0 else dim


def _widen_metadata(metadata: dict[str, Any], arch: str, factor: int, ffn_factor: int) -> dict[str, Any]:
    """Embedding and SSM widths and the query head count times ``factor``, FFN widths times ``ffn_factor``;
    KV heads when they fill a width."""
    out = dict(metadata)
    key_length = int(metadata.get(f"{arch}.attention.key_length", 0) or 0)

    def each(value: Any, f: Any) -> Any:
        return [f(v) for v in value] if isinstance(value, (list, tuple)) else f(value)

    for key, value in metadata.items():
        if not key.startswith(f"{arch}."):
            continue
        if key.endswith(("embedding_length", "feed_forward_length", "ssm.inner_size")):
            out[key] = each(value, lambda v: _wide(int(v), factor, ffn_factor))
        elif key.endswith("attention.head_count"):
            out[key] = each(value, lambda v: int(v) * factor)
        elif key.endswith("attention.head_count_kv"):
            out[key] = each(value, lambda v: int(v) * factor if int(v) * key_length >= ZOO_WIDTH else int(v))
    return out


def widen_model(
    src: Path, dst: Path, binary: Path, *, factor: int = 8, ffn_factor: int | None = None, attempts: int = 40
) -> Path | None:
    """Write ``src`` ``factor`` times wider to ``dst``; None when it is not 256 wide or llama-server refuses it.

    ``ffn_factor`` (default ``factor``) widens the FFN on its own, to vary the
    FFN-to-embedding ratio (the zoo's is 1.5; real models' 2.5-4).

    Each shape llama-server corrects costs one more start (tens of milliseconds:
    it stops at the first wrong tensor, before reading any weight).
    """
    model = gguf.read(src)
    head = model.shards[0]
    arch = str(head.metadata["general.architecture"])
    if len(model.shards) > 1 or head.metadata.get(f"{arch}.embedding_length") != ZOO_WIDTH:
        return None
    ffn_factor = ffn_factor or factor
    metadata = _widen_metadata(dict(head.metadata), arch, factor, ffn_factor)
    # the first two axes hold the widths; token_embd's second is the vocabulary
    shapes = {
        t.name: tuple(
            _wide(d, factor, ffn_factor) if axis < 2 and (t.name, axis) != ("token_embd.weight", 1) else d
            for axis, d in enumerate(t.shape)
        )
        for t in head.tensors
    }
    for _ in range(attempts):
        write_gguf(
            dst,
            metadata,
            [TensorToWrite(t.name, shapes[t.name], t.ggml_type) for t in head.tensors],
            value_types=head.value_types,
            version=head.version,
        )
        report, _ = load_report(binary, dst, ("-c", "256"), until=(_ACCEPTED,), timeout=30, attempts=1)
        if _ACCEPTED in report:
            return dst
        wrong = _WRONG_SHAPE.search(report)
        if wrong is None:
            refused = next((line for line in report.splitlines() if " E " in line), report[-200:])
            log.info("wide zoo: llama-server refuses the widened model", model=src.stem, reason=refused.strip())
            break
        name, expected = wrong.group(1), tuple(int(d) for d in wrong.group(2).replace(" ", "").split(","))
        suffix, guessed = _BLOCK.sub("", name), shapes[name]
        for t in head.tensors:  # the same tensor of every block
            if t.name == name or (
                _BLOCK.match(name) and _BLOCK.sub("", t.name) == suffix and shapes[t.name] == guessed
            ):
                shapes[t.name] = expected + shapes[t.name][len(expected) :]
    dst.unlink(missing_ok=True)
    return None


def with_experts(src: Path, dst: Path, n_expert: int, n_used: int, *, expert_type: str | None = None) -> Path:
    """``src`` with ``n_expert`` routed experts, ``n_used`` of them per token, written to ``dst`` (weights as holes).

    The zoo's MoE models route each token to 2 of 2 experts; real fine-grained MoE
    models route 8 of 128 (Qwen3-30B-A3B), where the experts' down projections,
    ``[n_embd, n_expert_used, n_tokens]``, outgrow their activations. The expert
    axis is the last of the experts' and the router's tensors. ``expert_type`` (e.g. ``Q8_0``) writes the
    experts' weight matrices in that type instead of the source's (a quarter of F32's bytes, for models that are
    sent whole to an RPC worker).
    """
    head = gguf.read(src).shards[0]
    arch = str(head.metadata["general.architecture"])
    old = int(head.metadata[f"{arch}.expert_count"])
    metadata = {**head.metadata, f"{arch}.expert_count": n_expert, f"{arch}.expert_used_count": n_used}

    tensors = []
    for t in head.tensors:
        # experts' weights [n_embd, n_ff, n_expert], their biases and scales, the router [n_embd, n_expert] and
        # its biases all end with the expert axis
        axis = len(t.shape) - 1 if any(k in t.name for k in ("_exps.", ".ffn_gate_inp.", ".exp_probs_b.")) else None
        shape = tuple(n_expert if i == axis and d == old else d for i, d in enumerate(t.shape))
        matrix = t.name.endswith("_exps.weight") and len(shape) == 3
        tensors.append(TensorToWrite(t.name, shape, expert_type if matrix and expert_type else t.ggml_type))
    write_gguf(dst, metadata, tensors, value_types=head.value_types, version=head.version)
    return dst


def ensure_wide_zoo(
    zoo: Path, binary: Path, out: Path, *, factor: int = 8, ffn_factor: int | None = None
) -> list[Path]:
    """Every zoo model llama-server accepts widened, generated into ``out`` once (a marker lists them)."""
    return _generated_once(
        out,
        lambda: [
            p
            for src in sorted(zoo.glob("*.gguf"))
            if (p := widen_model(src, out / f"{src.stem}-wide.gguf", binary, factor=factor, ffn_factor=ffn_factor))
            is not None
        ],
    )


def _generated_once(out: Path, make: Callable[[], list[Path]]) -> list[Path]:
    """The files ``make`` writes into ``out``, made on the first call; later calls read the marker listing them."""
    marker = out / MARKER
    if marker.is_file():
        return [out / name for name in marker.read_text().split()]
    out.mkdir(parents=True, exist_ok=True)
    made = make()
    marker.write_text("\n".join(p.name for p in made) + "\n")
    return made


#: Zoo MoE models rewritten at real MoE proportions: (zoo model, factor, FFN factor, experts, routed per token).
REAL_MOE_SHAPES = (
    ("qwen3moe-moe", 8, 2, 128, 8),  # Qwen3-30B-A3B: n_embd 2048, 128 experts 768 wide, 8 routed
    ("olmoe-moe", 8, 2, 64, 8),  # OLMoE-1B-7B: 64 experts, 8 routed
    ("gpt-oss-moe", 8, 8, 32, 4),  # GPT-OSS-20B: 32 experts about n_embd wide, 4 routed, biased
)


def ensure_moe_zoo(
    zoo: Path,
    binary: Path,
    out: Path,
    shapes: tuple[tuple[str, int, int, int, int], ...] = REAL_MOE_SHAPES,
    expert_type: str | None = None,
) -> list[Path]:
    """``shapes``' models (``REAL_MOE_SHAPES`` by default), generated into ``out`` once (a marker lists them)."""

    def make() -> list[Path]:
        made = []
        for name, factor, ffn_factor, n_expert, n_used in shapes:
            wide = widen_model(
                zoo / f"{name}.gguf", out / f"{name}-narrow.gguf", binary, factor=factor, ffn_factor=ffn_factor
            )
            if wide is not None:
                dst = out / f"{name}-{n_expert}x{n_used}.gguf"
                made.append(with_experts(wide, dst, n_expert, n_used, expert_type=expert_type))
                wide.unlink()
        return made

    return _generated_once(out, make)


#: The same MoE proportions (experts, routed) half as wide and with Q8_0 experts, small enough to send whole to a
#: loopback RPC worker several times (``scripts/memory_accuracy.py --moe-split``): n_embd 1024, experts 384 wide
#: (1536 for GPT-OSS), 80-160 MB of experts per layer.
SPLIT_MOE_SHAPES = (
    ("qwen3moe-moe", 4, 1, 128, 8),
    ("olmoe-moe", 4, 1, 64, 8),
    ("gpt-oss-moe", 4, 4, 32, 4),
)


def ensure_split_moe_zoo(zoo: Path, binary: Path, out: Path) -> list[Path]:
    """``SPLIT_MOE_SHAPES``' models, generated into ``out`` once (a marker lists them)."""
    return ensure_moe_zoo(zoo, binary, out, SPLIT_MOE_SHAPES, expert_type="Q8_0")
