"""GGUF Studio's own GGUF reader and writer (not PyPI's ``gguf``).

``read(path)`` returns a ``GGUFFile`` (metadata, tensors, shards, ``facts``);
``GGUFError`` is the one exception type raised for bad files.
"""

from gguf.errors import (
    CorruptHeaderError,
    GGUFError,
    ImplausibleValueError,
    InconsistentHeaderError,
    MissingShardError,
    NotGGUFError,
    TruncatedError,
    UnsupportedVersionError,
)
from gguf.ggml_types import GGML_TYPES, GGMLType
from gguf.model import GGUFFile, clear_cache, read
from gguf.reader import Header, LazyArray, TensorInfo, read_header

__all__ = [
    "CorruptHeaderError", "GGML_TYPES", "GGMLType", "GGUFError", "GGUFFile", "Header", "ImplausibleValueError",
    "InconsistentHeaderError", "LazyArray",
    "MissingShardError", "NotGGUFError", "TensorInfo", "TruncatedError", "UnsupportedVersionError",
    "clear_cache", "read", "read_header",
]
