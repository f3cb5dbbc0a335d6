"""Everything about one llama-server: build it, find it, start and stop it.

Imports flow ``studio -> launcher -> gguf``; nothing here imports ``studio``.
"""
