"""The tokens at the head of a llama-server slot file (``POST /slots/{id}?action=save``).

``llama_state_seq_save_file`` (``src/llama-context.cpp``) writes a u32 magic ``ggsq``, a u32 version
(4 in b11434), a u32 count and that many int32 words, then the KV state. llama-server b11434 fills the
words with its ``server_tokens`` state (``tools/server/server-common.cpp``): a -1 marker, a format
version, a length-prefixed token list, then media keys; older servers wrote the plain token list.
Reading only this head tells which conversation a saved slot holds without loading it anywhere.
"""

from __future__ import annotations

import struct
from pathlib import Path

from launcher.errors import SlotFileError

__all__ = ["SEQ_MAGIC", "SEQ_VERSION", "read_tokens"]

SEQ_MAGIC = 0x67677371  # "ggsq"
SEQ_VERSION = 4
#: A slot never holds more tokens than a context; past this a count is garbage.
MAX_TOKENS = 1 << 24


def read_tokens(path: Path) -> list[int]:
    """The prompt tokens ``path`` holds.

    Raises:
        SlotFileError: not a slot file of this format, or cut short.
    """
    try:
        with path.open("rb") as f:
            head = f.read(12)
            if len(head) < 12:
                raise SlotFileError(f"{path.name} is cut short: no slot file header", path=path)
            magic, version, count = struct.unpack("<III", head)
            if magic != SEQ_MAGIC or version != SEQ_VERSION:
                raise SlotFileError(f"{path.name} is not a slot file of version {SEQ_VERSION}", path=path)
            if count > MAX_TOKENS + 16:
                raise SlotFileError(f"{path.name} claims {count} tokens", path=path)
            raw = f.read(4 * count)
    except OSError as exc:
        raise SlotFileError(f"{path.name} cannot be read: {exc.strerror or exc}", path=path) from exc
    if len(raw) < 4 * count:
        raise SlotFileError(f"{path.name} is cut short in its token list", path=path)
    words = list(struct.unpack(f"<{count}i", raw))
    if not words or words[0] != -1:
        return words  # the plain token list of older servers
    if len(words) < 3 or words[2] < 0 or 3 + words[2] > len(words):
        raise SlotFileError(f"{path.name} holds a malformed token state", path=path)
    return words[3 : 3 + words[2]]
