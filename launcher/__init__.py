"""Everything about one llama-server: build it, find it, start and stop it.

Imports flow ``studio -> launcher -> gguf``; nothing here imports ``studio``,
and nothing here names an architecture (``gguf.arch_traits`` says how each runs).

Memory: ``memory`` estimates a ``bill`` from ``memory_options`` and the
``context_shape`` (which the ``planner`` asks too), with ``compute_buffer``;
``allocations`` reads the same bill from llama-server's log. The launch:
``planner`` -> ``command`` (argv; ``extra_args`` validates the user's flags) ->
``supervisor`` / ``process``. ``units`` holds byte units and the size formatter.
"""
