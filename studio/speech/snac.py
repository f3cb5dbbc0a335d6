"""SNAC: Orpheus's codec tokens to SNAC's three code layers, and the layers to sound.

An Orpheus model speaks in ``<custom_token_N>`` tokens, seven a frame. Position ``p`` of a frame
(0..6) carries a code of 0..4095 as ``N = 10 + p * 4096 + code`` (the first ten numbers are the
prompt's markers: start and end of speech, of the human turn, of the AI turn). SNAC 24 kHz has
three codebooks at three rates: the coarse one gets one code a frame (position 0), the middle one
two (positions 1 and 4), the fine one four (positions 2, 3, 5, 6), in that order. The fine layer
runs at the latent rate, 512 samples a code, so a frame is ``SAMPLES_PER_FRAME`` samples of audio.

A frame cut short (the answer ended mid-frame) is dropped: the decoder needs all three layers of
each frame. The decoder itself is the ONNX export of ``hubertsiuzdak/snac_24khz``'s decoder
(``CODEC_REPO`` / ``CODEC_FILE``): inputs ``audio_codes.0`` ``[1, F]``, ``audio_codes.1`` ``[1, 2F]``,
``audio_codes.2`` ``[1, 4F]`` (int64), output ``audio_values`` ``[1, 1, 2048 F]`` (float32, -1..1),
run by onnxruntime (the optional ``speech`` extra) in a worker thread so the event loop keeps going.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from studio.errors import BadRequestError

#: The public ONNX export of SNAC 24 kHz's decoder, fetched through huggingface_hub like a model.
CODEC_REPO = "onnx-community/snac_24khz-ONNX"
CODEC_FILE = "onnx/decoder_model.onnx"
SAMPLE_RATE = 24_000
CODEBOOK = 4096  # codes per codebook
FRAME = 7  # tokens a frame
FIRST_CODE_TOKEN = 10  # <custom_token_10>: position 0, code 0
SAMPLES_PER_FRAME = 4 * 512  # four fine codes, 512 samples each
#: Which layer each position of a frame feeds (coarse, middle, fine), in order within its layer.
LAYER_OF_POSITION = (0, 1, 2, 2, 1, 2, 2)
INPUT_NAMES = ("audio_codes.0", "audio_codes.1", "audio_codes.2")
OUTPUT_NAME = "audio_values"
#: The extra that brings the runtime, as ``pip`` spells it.
EXTRA_HINT = "pip install 'gguf-studio[speech]' (onnxruntime and numpy)"

_CODEC_TOKEN = re.compile(r"<custom_token_(\d+)>")


@dataclass(frozen=True)
class Layers:
    """SNAC's three code layers for ``frames`` whole frames: ``frames``, ``2 * frames`` and ``4 * frames`` codes."""

    coarse: tuple[int, ...]
    middle: tuple[int, ...]
    fine: tuple[int, ...]

    @property
    def frames(self) -> int:
        return len(self.coarse)

    @property
    def samples(self) -> int:
        """The number of samples the decoder makes of these layers."""
        return self.frames * SAMPLES_PER_FRAME


def token_numbers(text: str) -> list[int]:
    """Return the ``N`` of every ``<custom_token_N>`` in ``text``, in order (any other text is skipped)."""
    return [int(n) for n in _CODEC_TOKEN.findall(text)]


def codes_of(numbers: Iterable[int]) -> list[int]:
    """Return each codec token's code (0..4095), counting positions from the first token.

    Raises:
        BadRequestError: a token is not a code of its position (a model that lost the frame's rhythm).
    """
    codes = []
    for index, number in enumerate(numbers):
        position = index % FRAME
        code = number - FIRST_CODE_TOKEN - position * CODEBOOK
        if not 0 <= code < CODEBOOK:
            raise BadRequestError(
                f"the model's audio token {index} (<custom_token_{number}>) is not a code of frame position "
                f"{position} (<custom_token_{FIRST_CODE_TOKEN + position * CODEBOOK}> to "
                f"<custom_token_{FIRST_CODE_TOKEN + (position + 1) * CODEBOOK - 1}>): it is not an Orpheus/SNAC model"
                " or it lost track of the frames",
                code="codec_tokens_out_of_order",
            )
        codes.append(code)
    return codes


def layers(codes: Sequence[int]) -> Layers:
    """Return SNAC's three layers of the whole frames in ``codes`` (an incomplete last frame is dropped)."""
    out: tuple[list[int], list[int], list[int]] = ([], [], [])
    whole = len(codes) - len(codes) % FRAME
    for index in range(whole):
        out[LAYER_OF_POSITION[index % FRAME]].append(codes[index])
    return Layers(tuple(out[0]), tuple(out[1]), tuple(out[2]))


def runtime() -> Any:
    """Return the ``onnxruntime`` module.

    Raises:
        BadRequestError: the optional ``speech`` extra is not installed (named, with the command).
    """
    try:
        import onnxruntime
    except ImportError as exc:
        raise BadRequestError(
            f"decoding SNAC audio needs onnxruntime, which is not installed: {EXTRA_HINT}",
            code="speech_runtime_missing",
        ) from exc
    return onnxruntime


class SnacDecoder:
    """SNAC's ONNX decoder in one onnxruntime session (sessions are safe to run from several threads)."""

    def __init__(self, path: Path) -> None:
        ort = runtime()
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only: its warnings are about graph optimisations
        try:
            self._session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types, all plain Exceptions
            raise BadRequestError(f"{path} is not a SNAC decoder onnxruntime can load: {exc}") from exc
        names = tuple(i.name for i in self._session.get_inputs())
        if sorted(names) != sorted(INPUT_NAMES):
            raise BadRequestError(
                f"{path} is not SNAC 24 kHz's decoder: its inputs are {', '.join(names)}, not {', '.join(INPUT_NAMES)}"
            )

    def decode(self, layers: Layers) -> Any:
        """Return the audio of ``layers`` as a float32 array of ``layers.samples`` samples (empty for no frames)."""
        import numpy as np

        if layers.frames == 0:
            return np.zeros(0, dtype=np.float32)
        feed = {
            name: np.asarray([codes], dtype=np.int64)
            for name, codes in zip(INPUT_NAMES, (layers.coarse, layers.middle, layers.fine), strict=True)
        }
        (audio,) = self._session.run([OUTPUT_NAME], feed)
        return np.asarray(audio, dtype=np.float32).reshape(-1)


_lock = threading.Lock()


@functools.lru_cache(maxsize=2)
def _decoder(path: Path, size: int, mtime_ns: int) -> SnacDecoder:
    return SnacDecoder(path)


def decoder(path: Path) -> SnacDecoder:
    """The decoder of the ONNX file at ``path``, loaded once per version of the file."""
    stat = path.stat()
    with _lock:  # two first requests load it once
        return _decoder(path, stat.st_size, stat.st_mtime_ns)
