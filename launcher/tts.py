"""Run llama.cpp's own text-to-speech tool (``llama-tts``) for one utterance, supervised like every child.

``llama-tts`` (pinned ``tools/tts/tts.cpp``) loads a TTS backbone and its
projector through libmtmd (Qwen3-TTS, Pocket TTS), speaks one prompt and writes
a 16-bit mono WAV, then exits: there is no server to keep, so each utterance is
one run. Like a llama-server child it gets its own process group (a cancelled
request kills the whole group), dies with the studio (``child_popen_kwargs``),
is recorded in the child registry (a crashed studio's orphan is reaped on the
next start) and appends its output to a log that is kept.

Its flags (``common_params_parse`` with ``LLAMA_EXAMPLE_TTS``): ``-m`` the
backbone, ``-mm`` the projector, ``-p`` the text, ``-o`` the WAV, ``-n`` the most
frames to generate (a frame's length is the model's: 1920 samples at 24 kHz for
Qwen3-TTS-12Hz), ``--tts-speaker-file`` a reference voice (wav or mp3; Pocket
TTS needs one), ``--tts-lang`` Qwen3-TTS's language. It logs ``generated N
frames, B bytes of WAV audio (R Hz)`` before writing the file.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import struct
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from launcher import platform
from launcher.errors import SpeechError
from launcher.registry import ChildRegistry

log = structlog.get_logger(__name__)

#: ``tts.cpp``'s summary line, printed once the audio is complete.
_GENERATED = re.compile(r"generated (\d+) frames, (\d+) bytes of WAV audio \((\d+) Hz\)")
#: Lines of the log an error carries.
LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class TTSJob:
    """One utterance for ``llama-tts``: the files, the text and how long it may grow."""

    binary: Path
    model: Path
    projector: Path
    text: str
    max_frames: int  # ``-n``: generation stops here if the model has not ended the speech itself
    n_ctx: int  # ``-c``: the prompt and every generated frame take a position
    threads: int | None = None
    speaker: Path | None = None  # a reference recording of the voice to speak in
    language: str | None = None  # Qwen3-TTS: en, zh, de, ... (llama-tts's default is English)
    seed: int | None = None
    samples_per_frame: int | None = None  # the model's frame length, where its projector says (``frame_samples``)

    def command(self, out: Path) -> list[str]:
        """Return the ``llama-tts`` command line that writes this utterance to ``out``."""
        cmd = [str(self.binary), "-m", str(self.model), "-mm", str(self.projector)]
        cmd += ["-p", self.text, "-o", str(out), "-n", str(self.max_frames), "-c", str(self.n_ctx)]
        if self.threads:
            cmd += ["-t", str(self.threads)]
        if self.speaker is not None:
            cmd += ["--tts-speaker-file", str(self.speaker)]
        if self.language:
            cmd += ["--tts-lang", self.language]
        if self.seed is not None:
            cmd += ["--seed", str(self.seed)]
        return cmd


@dataclass(frozen=True)
class TTSResult:
    """What one run said: the WAV file's bytes and the counts the tool logged."""

    wav: bytes
    frames: int  # model frames generated (codec frames), as llama-tts counted them
    sample_rate: int
    samples: int  # PCM samples in ``wav`` (mono)
    seconds: float  # wall time of the run


async def run_tts(
    job: TTSJob, *, log_path: Path, registry: ChildRegistry | None = None, timeout: float = 600.0
) -> TTSResult:
    """Return the audio of ``job``, run as a supervised child; cancelling the caller kills the run.

    Raises:
        SpeechError: llama-tts could not start, exited with an error, ran past ``timeout`` or wrote no WAV;
            ``log_tail`` holds the end of its output.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tts-") as scratch:
        out = Path(scratch) / "speech.wav"
        cmd = job.command(out)
        with log_path.open("ab") as sink:
            sink.write(f"\n$ {shlex.join(cmd)}\n".encode(errors="replace"))
            sink.flush()
            offset = sink.tell()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *cmd,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=sink,
                    stderr=sink,
                    **platform.child_popen_kwargs(),
                )
            except OSError as exc:
                raise SpeechError(f"llama-tts could not start ({job.binary}): {exc}") from exc
        if registry is not None:
            registry.add(proc.pid, str(job.binary))
        log.info("tts_started", pid=proc.pid, model=job.model.name, chars=len(job.text), max_frames=job.max_frames)
        try:
            status = await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            await _stop(proc)
            raise SpeechError(
                f"llama-tts ran longer than {timeout:g} s on {len(job.text)} characters and was stopped",
                pid=proc.pid,
                log_tail=_tail(log_path, offset),
            ) from None
        except asyncio.CancelledError:  # the client left: nothing of the run outlives the request
            await _stop(proc)
            log.info("tts_cancelled", pid=proc.pid)
            raise
        finally:
            if registry is not None:
                registry.remove(proc.pid)
        output = _since(log_path, offset)
        tail = "\n".join(output.splitlines()[-LOG_TAIL_LINES:])
        if status != 0:
            raise SpeechError(
                f"llama-tts exited with status {status}: {_last_error(tail)}",
                pid=proc.pid,
                exit_code=status,
                log_tail=tail,
            )
        try:
            wav = out.read_bytes()
        except OSError as exc:
            raise SpeechError("llama-tts exited without writing its WAV file", pid=proc.pid, log_tail=tail) from exc
    found = _GENERATED.search(output)
    rate, samples = wav_shape(wav)
    # The WAV is cut to whole frames, so its length counts them exactly; the summary line is the fallback, as
    # llama-tts logs through a thread whose last lines are sometimes lost when the process exits.
    frames = samples // job.samples_per_frame if job.samples_per_frame else int(found.group(1)) if found else 0
    seconds = time.monotonic() - started
    log.info("tts_done", pid=proc.pid, frames=frames, samples=samples, sample_rate=rate, seconds=round(seconds, 2))
    return TTSResult(wav=wav, frames=frames, sample_rate=rate, samples=samples, seconds=seconds)


def frame_samples(projector_tensors: Mapping[str, tuple[int, ...]]) -> int | None:
    """Return the samples one frame becomes in a Qwen3-TTS projector's code2wav, or None for another projector.

    ``models/qwen3tts-gen.cpp``: two transposed convolutions of stride 2, then a DAC block per stride whose
    kernel is twice its stride (``a.gen.wav.dac.blk.N.conv.weight``, kernel first).
    """
    strides: list[int] = []
    while (shape := projector_tensors.get(f"a.gen.wav.dac.blk.{len(strides)}.conv.weight")) is not None:
        strides.append(shape[0] // 2)
    if not strides:
        return None
    samples = 4
    for stride in strides:
        samples *= stride
    return samples


def wav_shape(wav: bytes) -> tuple[int, int]:
    """Return ``(sample rate, samples)`` of a 16-bit mono PCM WAV as ``tts.cpp`` writes it (a 44-byte header).

    Raises:
        SpeechError: the bytes are not such a WAV.
    """
    if len(wav) < 44 or wav[:4] != b"RIFF" or wav[8:12] != b"WAVE" or wav[36:40] != b"data":
        raise SpeechError(f"llama-tts wrote {len(wav)} bytes that are not a WAV file")
    channels, rate = struct.unpack_from("<HI", wav, 22)
    bits = struct.unpack_from("<H", wav, 34)[0]
    size = struct.unpack_from("<I", wav, 40)[0]
    if channels != 1 or bits != 16 or size > len(wav) - 44:
        raise SpeechError(f"llama-tts wrote an unexpected WAV ({channels} channels, {bits} bits, {size} data bytes)")
    return rate, size // 2


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """Kill the run's whole process group and reap it."""
    platform.kill_group(proc.pid)
    await proc.wait()


def _since(log_path: Path, offset: int) -> str:
    """What this run appended to ``log_path`` (from ``offset``)."""
    try:
        with log_path.open("rb") as fh:
            fh.seek(offset)
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def _tail(log_path: Path, offset: int) -> str:
    """The last lines this run appended to ``log_path``."""
    return "\n".join(_since(log_path, offset).splitlines()[-LOG_TAIL_LINES:])


def _last_error(tail: str) -> str:
    """The most telling line of a failed run: its last error line, else its last line."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    errors = [line for line in lines if " E " in line or "error" in line.lower() or "failed" in line.lower()]
    return (errors or lines or ["(no output)"])[-1]


def default_threads() -> int:
    """Threads for a run: the cores this process may use (llama-tts's own default counts every core)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)
