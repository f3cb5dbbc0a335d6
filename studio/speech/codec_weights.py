"""The codec's weights, through huggingface_hub like every model: the cache first, else a download.

The SNAC decoder is a file of a public Hub repo (``studio.speech.snac.CODEC_REPO``); it lands in the
shared Hugging Face cache in huggingface_hub's own layout, honours ``HF_ENDPOINT``, ``HF_TOKEN`` and
``HF_HUB_OFFLINE``, and once cached is used without asking the Hub again.
"""

from __future__ import annotations

from pathlib import Path

from studio.library import hub
from studio.library.hub import HubConfig, cached_snapshot
from studio.speech.snac import CODEC_FILE, CODEC_REPO


def cached_codec(config: HubConfig, repo: str = CODEC_REPO, file: str = CODEC_FILE) -> Path | None:
    """The codec file when the cache holds it, else None (no network)."""
    found = cached_snapshot(config.cache_dir, repo)
    if found is None:
        return None
    path = found[1] / file
    return path if path.is_file() else None


def codec_path(config: HubConfig | None = None, repo: str = CODEC_REPO, file: str = CODEC_FILE) -> Path:
    """Return the codec file in the Hugging Face cache, downloading it when missing (blocking: call from a thread).

    Raises:
        studio.errors.HubError: the Hub cannot be reached (and the cache lacks it), or refused the file.
    """
    from huggingface_hub import hf_hub_download

    cfg = config or HubConfig.from_env()
    cached = cached_codec(cfg, repo, file)
    if cached is not None:
        return cached
    with hub._hub_errors(repo, cfg, file):  # the one translation of the Hub's errors (as hub_search uses it)
        return Path(
            hf_hub_download(
                repo,
                file,
                cache_dir=cfg.cache_dir,
                endpoint=cfg.endpoint,
                token=cfg.token,
                etag_timeout=cfg.timeout,
                local_files_only=cfg.offline,
            )
        )


def codec_for(model: Path, config: HubConfig | None = None) -> Path | None:
    """Return the codec file the text-to-speech model at ``model`` speaks through, fetched into the cache; None for
    a model that needs none the studio can run (blocking: ``ggstudio pull`` calls it after the model's files)."""
    import gguf
    from gguf.speech import speech_facts

    facts = speech_facts(gguf.read(model))
    if facts is None or facts.vocoder or facts.codec != "SNAC":
        return None
    return codec_path(config)
