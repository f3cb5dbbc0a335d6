"""A tiny random-weight Orpheus: a byte-level BPE vocabulary plus Orpheus's 28,682 ``<custom_token_N>`` tokens.

The vocabulary has Orpheus's special tokens as control tokens (``<|begin_of_text|>``, ``<|eot_id|>`` and
every ``<custom_token_N>``) and, for text, GPT-2's 256 byte tokens without merges, so any text
tokenizes (byte by byte, as Llama 3's tokenizer would before its merges); Llama 3's full 128,256-token
vocabulary would make each sampled token several times slower on the test machine for nothing the
engine reads (it spells the answer's ids back through llama-server, never by number). The network is
one small llama layer of seeded random weights (the output reuses the token embeddings), so it writes
noise; a grammar holds it to codec tokens, as the studio's engine does for a real model. The ends
(``<|end_of_text|>``, ``<|eot_id|>`` and ``<custom_token_2>``, the end of speech) have zero embeddings,
so their logit is 0 where thousands of codes score above it: the model never stops by itself, and
an answer is as long as its token budget, a number a test can assert. So has the byte ``<``: the
grammar would let the model spell a code in bytes (``<``, ``c``, ...), which costs more tokens of the
budget than the one special token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gguf.reader import ARRAY, STRING, UINT32
from gguf.writer import TensorToWrite, write_gguf

CUSTOM_TOKENS = 10 + 7 * 4096  # Orpheus's markers, then seven codebooks of 4096
EMBD, FF, HEADS = 64, 128, 2
NORMAL, CONTROL = 1, 3


def byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: each of the 256 bytes as the printable character BPE vocabularies store."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def write_orpheus_model(path: Path, *, seed: int = 7) -> Path:
    """Write the tiny Orpheus to ``path`` and return it."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    tokens = byte_tokens() + specials + [f"<custom_token_{n}>" for n in range(CUSTOM_TOKENS)]
    types = [NORMAL] * 256 + [CONTROL] * (len(specials) + CUSTOM_TOKENS)
    metadata = {
        "general.architecture": "llama",
        "general.name": "tiny-orpheus",
        "llama.block_count": 1,
        "llama.context_length": 4096,
        "llama.embedding_length": EMBD,
        "llama.feed_forward_length": FF,
        "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": HEADS,
        "llama.rope.freq_base": 500000.0,
        "llama.rope.dimension_count": EMBD // HEADS,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.vocab_size": len(tokens),
        "general.file_type": 1,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 256,
        "tokenizer.ggml.eos_token_id": 258,
    }
    rng = np.random.default_rng(seed)

    def noise(shape: tuple[int, ...], scale: float = 0.5) -> bytes:
        return (rng.standard_normal(int(np.prod(shape))) * scale).astype("<f2").tobytes()

    tensors = [
        ("token_embd.weight", (EMBD, len(tokens)), "F16", _silent_ends(noise((EMBD, len(tokens)), scale=1.0), tokens)),
        ("output_norm.weight", (EMBD,), "F32", np.ones(EMBD, "<f4").tobytes()),
        ("blk.0.attn_norm.weight", (EMBD,), "F32", np.ones(EMBD, "<f4").tobytes()),
        ("blk.0.ffn_norm.weight", (EMBD,), "F32", np.ones(EMBD, "<f4").tobytes()),
    ]
    for name, shape in (
        ("attn_q", (EMBD, EMBD)),
        ("attn_k", (EMBD, EMBD)),
        ("attn_v", (EMBD, EMBD)),
        ("attn_output", (EMBD, EMBD)),
        ("ffn_gate", (EMBD, FF)),
        ("ffn_up", (EMBD, FF)),
        ("ffn_down", (FF, EMBD)),
    ):
        tensors.append((f"blk.0.{name}.weight", shape, "F16", noise(shape)))
    types_of = {key: (UINT32,) for key, value in metadata.items() if type(value) is int}  # llama.cpp reads u32
    types_of["tokenizer.ggml.merges"] = (ARRAY, STRING)  # empty: no type to infer from
    return write_gguf(path, metadata, [TensorToWrite(n, s, t, d) for n, s, t, d in tensors], value_types=types_of)


def _silent_ends(embeddings: bytes, tokens: list[str]) -> bytes:
    """``embeddings`` (one row of ``EMBD`` per token) with the rows of the ends and of the byte ``<`` zeroed."""
    rows = np.frombuffer(embeddings, "<f2").reshape(len(tokens), EMBD).copy()
    for end in ("<|end_of_text|>", "<|eot_id|>", "<custom_token_2>", "<"):
        rows[tokens.index(end)] = 0
    return rows.tobytes()
