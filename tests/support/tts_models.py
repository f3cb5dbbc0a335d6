"""A tiny Qwen3-TTS the pinned ``llama-tts`` runs: the zoo's random backbone, a speaking vocabulary, its projector.

No small Qwen3-TTS ships on the package registries (the smallest real one is
0.6B parameters plus a 0.7 GB projector), so the tests write their own:

- ``derive_qwen3tts_model``: the zoo's ``qwen3tts`` backbone (random weights,
  the ``test`` tokenizer) with the special tokens ``mtmd-helper-gen.cpp``'s
  Qwen3-TTS pipeline looks up by text renamed into its vocabulary:
  ``<|codec_0|>`` at id 0, so every token the backbone samples is a valid
  first-codebook code, and the codec / text markers at the top ids. Sampling
  ``<|codec_eos_token|>`` ends the speech early, as in the real model.
- ``write_qwen3tts_projector``: one mmproj holding both halves ``clip.cpp``
  loads for it (``mtmd_init_from_file`` refuses a file without an encoder): the
  speaker encoder (``qwen3tts_spkenc``, an ECAPA-TDNN over a mel spectrogram,
  ``models/qwen3tts-spkenc.cpp``) and the generator (``qwen3tts_gen``,
  ``models/qwen3tts-gen.cpp``): the code predictor (a small transformer that
  samples the acoustic codebooks from the backbone's hidden state) and
  code2wav (codebooks -> a windowed transformer -> 2 x 2 upsampling -> a DAC
  decoder whose strides give the samples per frame).

``clip.cpp`` hard-codes part of code2wav (8 transformer layers of 16 heads, 2
upsampling and 4 DAC blocks of 3 residual units, a 72-frame window), so those
counts are the real model's; every width is small. The DAC strides are the real
8, 5, 4, 3, so a frame is 4 x 480 = 1920 samples at 24 kHz (12.5 frames a
second), as in Qwen3-TTS-12Hz. Weights are seeded noise: the speech is noise,
but a valid WAV whose length follows the frames generated.
"""

from __future__ import annotations

from pathlib import Path

import gguf
from gguf.writer import TensorToWrite, copy_of, write_gguf
from tests.support.projectors import _noise, _Tensors, _write

#: Samples each generated frame becomes: 2 x 2 upsampling, then the DAC strides.
DAC_STRIDES = (8, 5, 4, 3)
SAMPLES_PER_FRAME = 4 * DAC_STRIDES[0] * DAC_STRIDES[1] * DAC_STRIDES[2] * DAC_STRIDES[3]
SAMPLE_RATE = 24000

#: The special tokens the Qwen3-TTS pipeline finds by text, at the top of the vocabulary.
_SPECIALS = (
    "<|codec_bos|>",
    "<|codec_eos_token|>",
    "<|codec_pad|>",
    "<|codec_think|>",
    "<|codec_think_bos|>",
    "<|codec_think_eos|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<|codec_language_english|>",
    "<|codec_language_german|>",
)


def derive_qwen3tts_model(zoo_model: Path, dst: Path) -> Path:
    """Write the zoo's ``qwen3tts`` backbone to ``dst`` with the pipeline's special tokens; return ``dst``."""
    model = gguf.read(zoo_model)
    head = model.shards[0]
    metadata = dict(head.metadata)
    tokens = [str(t) for t in head.metadata["tokenizer.ggml.tokens"]]
    tokens[0] = "<|codec_0|>"
    tokens[len(tokens) - len(_SPECIALS) :] = _SPECIALS
    metadata["tokenizer.ggml.tokens"] = tokens
    metadata["general.name"] = "tiny-qwen3-tts"
    tensors = [copy_of(head, t) for t in head.tensors]
    return write_gguf(dst, metadata, tensors, value_types=head.value_types, version=head.version)


def write_qwen3tts_projector(
    path: Path,
    *,
    n_embd: int = 256,  # the backbone's width (the zoo model's)
    n_vocab: int = 3072,  # the backbone's vocabulary: every sampled id is a first-codebook code
    n_acoustic: int = 3,  # acoustic codebooks after the first (the real model has 15)
    acoustic_vocab: int = 64,
    n_mel: int = 16,
    seed: int = 3,
) -> Path:
    """Write a Qwen3-TTS projector (speaker encoder + generator) to ``path`` and return it."""
    t = _Tensors(seed)
    _speaker_encoder(t, n_mel=n_mel, n_out=n_embd)
    _code_predictor(t, n_embd=n_embd, n_vocab=n_vocab, n_acoustic=n_acoustic, acoustic_vocab=acoustic_vocab)
    _code2wav(t, n_vocab=n_vocab, n_acoustic=n_acoustic, acoustic_vocab=acoustic_vocab)
    metadata = {
        "general.architecture": "clip",
        "general.name": "tiny-qwen3-tts-projector",
        "general.file_type": 0,
        "clip.has_audio_encoder": True,
        "clip.has_gen_audio_encoder": True,
        "clip.audio.projector_type": "qwen3tts_spkenc",
        "clip.gen.audio.projector_type": "qwen3tts_gen",
        "clip.audio.num_mel_bins": n_mel,
        "clip.audio.embedding_length": 16,
        "clip.audio.feed_forward_length": 16,
        "clip.audio.block_count": 3,  # the three SE-Res2Net blocks the graph asserts
        "clip.audio.projection_dim": n_embd,
        "clip.audio.attention.head_count": 1,
        "clip.audio.attention.layer_norm_epsilon": 1e-5,
        "clip.gen.audio.embedding_length": n_embd,
        "clip.gen.audio.feed_forward_length": 64,
        "clip.gen.audio.block_count": 1,
        "clip.gen.audio.projection_dim": n_embd,
        "clip.gen.audio.attention.head_count": 2,
        "clip.gen.audio.attention.head_count_kv": 2,
        "clip.gen.audio.attention.layer_norm_epsilon": 1e-6,
    }
    return _write(path, metadata, t.out)


def _conv(t: _Tensors, name: str, k: int, c_in: int, c_out: int, scale: float = 0.2) -> None:
    """A 1-D convolution as ``clip.cpp`` reads it: weight ``[kernel, in, out]``, bias ``[out]``."""
    t.out.append(_noise_tensor(t, f"{name}.weight", (k, c_in, c_out), scale))
    t.zeros(f"{name}.bias", c_out)


def _noise_tensor(t: _Tensors, name: str, shape: tuple[int, ...], scale: float) -> TensorToWrite:
    """Noise of ``scale`` (larger than ``_Tensors.noise``'s, so the convolutions' output is not near silence)."""
    n = 1
    for d in shape:
        n *= d
    return TensorToWrite(name, shape, "F32", _noise(t.rng, n, scale))


def _speaker_encoder(t: _Tensors, *, n_mel: int, n_out: int) -> None:
    """ECAPA-TDNN: a TDNN, three SE-Res2Net blocks (8 chunks), aggregation, attentive pooling, a projection."""
    c, chunk, se, agg, attn = 16, 2, 8, 24, 8
    _conv(t, "a.conv1d.0", 5, n_mel, c)
    for bid in (1, 2, 3):
        _conv(t, f"a.blk.{bid}.conv_pw1", 1, c, c)
        _conv(t, f"a.blk.{bid}.conv_pw2", 1, c, c)
        _conv(t, f"a.blk.{bid}.se_conv1", 1, c, se)
        _conv(t, f"a.blk.{bid}.se_conv2", 1, se, c)
        for xid in range(7):
            _conv(t, f"a.blk.{bid}.res2.{xid}", 3, chunk, chunk)
    _conv(t, "a.conv_out", 1, 3 * c, agg)
    _conv(t, "a.asp_tdnn", 1, 3 * agg, attn)
    _conv(t, "a.asp_attn", 1, attn, agg)
    _conv(t, "mm.a.fc", 1, 2 * agg, n_out)


def _code_predictor(t: _Tensors, *, n_embd: int, n_vocab: int, n_acoustic: int, acoustic_vocab: int) -> None:
    """One pre-norm transformer block at the backbone's width (no ``proj_in``), its heads and code tables."""
    n_head, d_head, n_ff = 2, 16, 64
    p = "a.gen.code.blk.0"
    t.ones(f"{p}.ln1.weight", n_embd)
    t.ones(f"{p}.ln2.weight", n_embd)
    for part in ("attn_q", "attn_k", "attn_v"):
        t.noise(f"{p}.{part}.weight", n_embd, n_head * d_head)
    t.noise(f"{p}.attn_out.weight", n_head * d_head, n_embd)
    t.ones(f"{p}.attn_q_norm.weight", d_head)
    t.ones(f"{p}.attn_k_norm.weight", d_head)
    t.noise(f"{p}.ffn_gate.weight", n_embd, n_ff)
    t.noise(f"{p}.ffn_up.weight", n_embd, n_ff)
    t.noise(f"{p}.ffn_down.weight", n_ff, n_embd)
    t.noise("a.gen.code.embd.weight", n_embd, acoustic_vocab, n_acoustic)
    t.noise("a.gen.code.head.weight", n_embd, acoustic_vocab, n_acoustic)
    t.noise("a.gen.code.out_embd.weight", n_embd, n_vocab)
    t.ones("a.gen.code.output_norm.weight", n_embd)


def _code2wav(t: _Tensors, *, n_vocab: int, n_acoustic: int, acoustic_vocab: int) -> None:
    """Codebooks -> causal conv -> 8-layer windowed transformer -> 2 x (transposed conv + ConvNeXt) -> DAC."""
    w = "a.gen.wav"
    dim, q_out, pre, hidden, d_tfm, n_ff, up = 8, 16, 16, 32, 64, 64, 16
    t.noise(f"{w}.quant.first.codebook.weight", dim, n_vocab)
    t.noise(f"{w}.quant.rest.codebook.weight", dim, acoustic_vocab, n_acoustic)
    for group in ("first", "rest"):
        t.noise(f"{w}.quant.{group}.in_proj.weight", q_out, dim)  # loaded, unused when decoding
        t.noise(f"{w}.quant.{group}.out_proj.weight", dim, q_out)
    _conv(t, f"{w}.pre_conv", 3, q_out, pre)
    t.noise(f"{w}.tfm.in_proj.weight", pre, hidden)
    t.zeros(f"{w}.tfm.in_proj.bias", hidden)
    for il in range(8):  # clip.cpp: wav_tfm_n_layer = 8, 16 heads of d_tfm / 16
        p = f"{w}.tfm.blk.{il}"
        for part in ("attn_q", "attn_k", "attn_v"):
            t.noise(f"{p}.{part}.weight", hidden, d_tfm)
        t.noise(f"{p}.attn_out.weight", d_tfm, hidden)
        for norm in ("ln1", "ln2", "ls1", "ls2"):
            t.ones(f"{p}.{norm}.weight", hidden)
        t.noise(f"{p}.ffn_gate.weight", hidden, n_ff)
        t.noise(f"{p}.ffn_up.weight", hidden, n_ff)
        t.noise(f"{p}.ffn_down.weight", n_ff, hidden)
    t.ones(f"{w}.tfm.output_norm.weight", hidden)
    t.noise(f"{w}.tfm.out_proj.weight", hidden, up)
    t.zeros(f"{w}.tfm.out_proj.bias", up)
    for il in range(2):  # clip.cpp: wav_upsample_n_block = 2, kernel == stride == 2
        p = f"{w}.up.blk.{il}"
        t.out.append(_noise_tensor(t, f"{p}.conv.weight", (2, up, up), 0.2))  # [kernel, out, in]
        t.zeros(f"{p}.conv.bias", up)
        t.out.append(_noise_tensor(t, f"{p}.dwconv.weight", (7, 1, up), 0.2))
        t.zeros(f"{p}.dwconv.bias", up)
        t.ones(f"{p}.norm.weight", up)
        t.zeros(f"{p}.norm.bias", up)
        t.noise(f"{p}.pw1.weight", up, 4 * up)
        t.zeros(f"{p}.pw1.bias", 4 * up)
        t.noise(f"{p}.pw2.weight", 4 * up, up)
        t.zeros(f"{p}.pw2.bias", up)
        t.ones(f"{w}.up.blk.{il}.gamma", up)
    channels = (16, 8, 8, 4, 4)
    _conv(t, f"{w}.dac.entry", 7, up, channels[0])
    for il, stride in enumerate(DAC_STRIDES):  # clip.cpp: 4 blocks of 3 residual units, kernel == 2 * stride
        p = f"{w}.dac.blk.{il}"
        c_in, c_out = channels[il], channels[il + 1]
        t.ones(f"{p}.snake.alpha", c_in)
        t.ones(f"{p}.snake.beta", c_in)
        t.out.append(_noise_tensor(t, f"{p}.conv.weight", (2 * stride, c_out, c_in), 0.2))  # [kernel, out, in]
        t.zeros(f"{p}.conv.bias", c_out)
        for ir in range(3):
            r = f"{p}.res.{ir}"
            t.ones(f"{r}.act1.alpha", c_out)
            t.ones(f"{r}.act1.beta", c_out)
            _conv(t, f"{r}.conv1", 7, c_out, c_out)
            t.ones(f"{r}.act2.alpha", c_out)
            t.ones(f"{r}.act2.beta", c_out)
            _conv(t, f"{r}.conv2", 1, c_out, c_out)
    t.ones(f"{w}.dac.post_snake.alpha", channels[-1])
    t.ones(f"{w}.dac.post_snake.beta", channels[-1])
    _conv(t, f"{w}.dac.post_conv", 7, channels[-1], 1)
