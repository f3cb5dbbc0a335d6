"""JSON for the bodies the studio parses and writes on every request and every reshaped chunk: orjson.

A chat request carries the whole conversation, and the studio parses it, fills in what it adds
and writes it again for llama-server; with the standard library that cost an agent's 120 KB
conversation 0.44 ms of CPU a request, the rest of the studio's own work together ~0.25 ms
(orjson: 0.10 ms, measured with ``timeit`` on 50 messages of 2,000 characters and 20 tools). The
dialects that reshape a stream (Ollama's NDJSON, the GUI's typed events, tool-call healing) parse
and write every chunk.

What differs from ``json``, all of it what JSON (RFC 8259) and llama-server's parser allow anyway:
``NaN``/``Infinity`` and integers beyond 64 bits are not JSON (a body with them is refused as not
valid JSON, where llama-server refused it later), text must be UTF-8, and the output is compact
UTF-8 (what llama-server, Ollama and OpenAI write too).
"""

from __future__ import annotations

import orjson

#: The value of a JSON text (``bytes`` or ``str``); raises ``JSONDecodeError``, a ``ValueError`` as ``json``'s.
loads = orjson.loads
#: A value as compact UTF-8 JSON ``bytes``; raises ``TypeError`` for what JSON cannot hold.
dumps = orjson.dumps
JSONDecodeError = orjson.JSONDecodeError
