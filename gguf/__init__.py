"""GGUF Studio's own GGUF reader and writer (not PyPI's ``gguf``).

``read(path)`` returns a ``GGUFFile`` (metadata, tensors, shards, ``facts``);
``GGUFError`` is the one exception type raised for bad files.

The file: ``reader`` (headers), ``model`` (a whole model, cached), ``shards``
(split files' names and keys), ``writer``, ``files`` (atomic writes),
``ggml_types``, ``templates`` (chat templates). What llama.cpp makes of it:
``facts`` (``ModelFacts``), built by ``facts_builder`` from ``metadata`` (typed
reads), ``hparams`` and ``arch_rules`` (each architecture's loader rules),
``tensor_layout`` and ``file_types``, checked by ``consistency``; and
``arch_traits``, how llama.cpp runs each architecture, which the launcher asks
instead of naming architectures.
"""

from gguf.errors import (
    CorruptHeaderError,
    GGUFError,
    ImplausibleValueError,
    InconsistentHeaderError,
    MissingShardError,
    NeedMoreBytes,
    NotGGUFError,
    TruncatedError,
    UnsupportedVersionError,
)
from gguf.ggml_types import GGML_TYPES, GGMLType
from gguf.model import GGUFFile, clear_cache, read
from gguf.reader import Header, LazyArray, TensorInfo, read_header, read_header_prefix

__all__ = [
    "CorruptHeaderError",
    "GGML_TYPES",
    "GGMLType",
    "GGUFError",
    "GGUFFile",
    "Header",
    "ImplausibleValueError",
    "InconsistentHeaderError",
    "LazyArray",
    "MissingShardError",
    "NeedMoreBytes",
    "NotGGUFError",
    "TensorInfo",
    "TruncatedError",
    "UnsupportedVersionError",
    "clear_cache",
    "read",
    "read_header",
    "read_header_prefix",
]
