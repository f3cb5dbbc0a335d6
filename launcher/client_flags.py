"""The llama-server flags an API client may add to a load (``extra_args``): an allowlist.

Whoever can reach the studio's API can load a model with extra llama-server flags;
whoever can write its config file owns the machine already. So an API client gets
only the flags classified here as safe: settings of how the model samples, batches,
caches prompts, uses the CPUs, reads its template and reasons, and what it serves
(embeddings, reranking). A flag not listed is refused for API clients, and so is
one a future llama-server adds until it is classified here; the config file's
``[models.NAME] extra_args`` may pass any flag but the managed ones
(``launcher.extra_args.MANAGED_FLAGS``, refused for everyone).

Left out on purpose, besides the managed flags:

- files, downloads and programs: ``--lora``, ``--control-vector``, ``--grammar-file``,
  ``-jf``, ``--slot-save-path``, ``--media-path``, ``--log-prompts-dir``, ``-lcs``/``-lcd``,
  ``--spec-draft-model``, ``--spec-draft-hf``, ``--hf-token``, the ``--*-default`` presets,
  ``--tools``, ``--agent``, ``--mcp-*``, ``--video-ffmpeg-dir``, the web UI's flags;
- llama-server's own endpoints and CORS (``--props``, ``--slots``, ``--cors-*``, ``--ui``),
  its timeouts, SSE pings, sleep and log format, which the studio's proxy and log reader
  rely on;
- memory and devices behind the planner's back: placement (``-ot``, ``--cpu-moe``,
  ``--n-cpu-moe``, ``-sm``, ``-mg``, ``--no-kv-offload``, the draft's devices and cache
  types), cache shapes it does not model (``--swa-full``, ``--kv-unified-per-slot``, and
  ``--override-kv``, which can rewrite the facts it plans from), memory that grows while
  serving (``--cache-ram``, ``--ctx-checkpoints``), locked memory (``--load-mode mlock``)
  and real-time priority (``--prio``);
- what the studio's own options choose: ``--spec-type``, ``--spec-default``,
  ``--spec-draft-n-max`` and the ngram-mod knobs (``spec``, ``spec_n_max``).

The batch sizes are in, though the planner bills compute buffers at llama-server's
default micro-batch: a much larger ``-ub`` can make that load fail for want of memory,
which the load's error says; memory other models hold is not touched.

Each entry is one declaration of the pinned build's help (b11434), with all its spellings;
a spelling another build adds is let through when its help lists it with one of these
(``Capabilities.aliases_of``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from launcher.extra_args import is_flag, normalize_flag

__all__ = ["CLIENT_FLAGS", "client_flag_refused", "flag_name"]

#: The flags API clients may pass, by what they set; each tuple one flag's spellings.
CLIENT_FLAGS: Mapping[str, tuple[tuple[str, ...], ...]] = {
    "sampling": (
        ("--samplers",),
        ("--sampler-seq", "--sampling-seq"),
        ("-s", "--seed"),
        ("--ignore-eos",),
        ("--temp", "--temperature"),
        ("--top-k",),
        ("--top-p",),
        ("--min-p",),
        ("--top-nsigma", "--top-n-sigma"),
        ("--xtc-probability",),
        ("--xtc-threshold",),
        ("--typical", "--typical-p"),
        ("--repeat-last-n",),
        ("--repeat-penalty",),
        ("--presence-penalty",),
        ("--frequency-penalty",),
        ("--dry-multiplier",),
        ("--dry-base",),
        ("--dry-allowed-length",),
        ("--dry-penalty-last-n",),
        ("--dry-sequence-breaker",),
        ("--adaptive-target",),
        ("--adaptive-decay",),
        ("--dynatemp-range",),
        ("--dynatemp-exp",),
        ("--mirostat",),
        ("--mirostat-lr",),
        ("--mirostat-ent",),
        ("-l", "--logit-bias"),
        ("--grammar",),
        ("-j", "--json-schema"),
        ("-bs", "--backend-sampling"),
        ("-n", "--predict", "--n-predict"),
        ("--keep",),
        ("-r", "--reverse-prompt"),
        ("-sp", "--special"),
    ),
    "batching and prompt cache": (
        ("-b", "--batch-size"),
        ("-ub", "--ubatch-size"),
        ("-cb", "--cont-batching", "-nocb", "--no-cont-batching"),
        ("--cache-prompt", "--no-cache-prompt"),
        ("--cache-reuse",),
        ("--cache-idle-slots", "--no-cache-idle-slots"),
        ("-cms", "--checkpoint-min-step"),
        ("-sps", "--slot-prompt-similarity"),
    ),
    "CPU threads and performance": (
        ("-C", "--cpu-mask"),
        ("-Cr", "--cpu-range"),
        ("--cpu-strict",),
        ("--poll",),
        ("-Cb", "--cpu-mask-batch"),
        ("-Crb", "--cpu-range-batch"),
        ("--cpu-strict-batch",),
        ("--poll-batch",),
        ("--threads-http",),
        ("--numa",),
        ("-lzm", "--lazy-mode"),
        ("--repack", "-nr", "--no-repack"),
        ("--no-host",),
        ("--op-offload", "--no-op-offload"),
        ("--warmup", "--no-warmup"),
        ("--perf", "--no-perf"),
        ("--check-tensors",),
    ),
    "model and media settings": (
        ("--rope-scaling",),
        ("--rope-scale",),
        ("--rope-freq-base",),
        ("--rope-freq-scale",),
        ("--yarn-orig-ctx",),
        ("--yarn-ext-factor",),
        ("--yarn-attn-factor",),
        ("--yarn-beta-slow",),
        ("--yarn-beta-fast",),
        ("--embedding", "--embeddings"),
        ("--rerank", "--reranking"),
        ("--pooling",),
        ("--embd-normalize",),
        ("--image-min-tokens",),
        ("--image-max-tokens",),
        ("--mtmd-batch-max-tokens",),
        ("--video-fps",),
        ("--video-timestamp-interval",),
    ),
    "template and reasoning": (
        ("--reasoning-format",),
        ("-rea", "--reasoning"),
        ("--reasoning-effort",),
        ("--reasoning-budget",),
        ("--reasoning-budget-message",),
        ("--reasoning-preserve", "--no-reasoning-preserve"),
        ("--skip-chat-parsing", "--no-skip-chat-parsing"),
        ("--prefill-assistant", "--no-prefill-assistant"),
        ("--spm-infill",),
    ),
    "speculative decoding tuning": (
        ("--spec-draft-n-min",),
        ("--spec-draft-p-split", "--draft-p-split"),
        ("--spec-draft-p-min", "--draft-p-min"),
        ("--spec-draft-sampling",),
        ("--spec-draft-backend-sampling", "--no-spec-draft-backend-sampling"),
        ("--spec-draft-threads", "-td", "--threads-draft"),
        ("--spec-draft-threads-batch", "-tbd", "--threads-batch-draft"),
        ("--spec-ngram-simple-size-n",),
        ("--spec-ngram-simple-size-m",),
        ("--spec-ngram-simple-min-hits",),
        ("--spec-ngram-map-k-size-n",),
        ("--spec-ngram-map-k-size-m",),
        ("--spec-ngram-map-k-min-hits",),
        ("--spec-ngram-map-k4v-size-n",),
        ("--spec-ngram-map-k4v-size-m",),
        ("--spec-ngram-map-k4v-min-hits",),
    ),
}
_ALLOWED = frozenset(flag for groups in CLIENT_FLAGS.values() for group in groups for flag in group)


def flag_name(token: str) -> str | None:
    """The flag ``token`` names, as llama.cpp reads it (``--a_b``: ``--a-b``; ``--a=v``: ``--a``); None: a value."""
    return normalize_flag(token.split("=", 1)[0]) if is_flag(token) else None


def client_flag_refused(
    args: Sequence[str], aliases_of: Callable[[str], Iterable[str]] = lambda flag: (flag,)
) -> str | None:
    """The first token of ``args`` that names a flag off the allowlist under every spelling; None if there is none.

    ``aliases_of`` gives the spellings the binary declares for a flag (``Capabilities.aliases_of``).
    """
    for token in args:
        flag = flag_name(token)
        if flag is not None and not any(f in _ALLOWED for f in (flag, *aliases_of(flag))):
            return token
    return None
